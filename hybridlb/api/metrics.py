"""Prometheus metrics of one API server, vLLM-compatible names, labelled per engine.

``engine`` is the global data-parallel rank, so balance across ranks is checkable
from ``/metrics`` alone. When several API server processes share a node's port, the
launcher sets ``PROMETHEUS_MULTIPROC_DIR`` and every scrape, whichever process answers
it, reports the node's totals: counters and histograms add up across the processes,
engine gauges show the most recent value any of them saw.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from hybridlb.protocol import EngineStats, LoadSnapshot

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class Metrics:
    def __init__(self, model_name: str, observer=None):
        # observer: also told of first tokens, finishes and engine stats (the Ray dashboard mirror)
        self.observer = observer
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        # In multiprocess mode values live in files and a collector reads them all at scrape time.
        self.registry = CollectorRegistry()
        r = None if self.multiprocess else self.registry
        labels = ["model_name", "engine"]
        gauge = {"multiprocess_mode": "mostrecent"} if self.multiprocess else {}
        self.running = Gauge("hybridlb:num_requests_running", "Requests in the engine's running batch.", labels,
                             registry=r, **gauge)
        self.waiting = Gauge("hybridlb:num_requests_waiting", "Requests waiting in the engine.", labels,
                             registry=r, **gauge)
        self.kv_usage = Gauge("hybridlb:kv_cache_usage_perc", "Fraction of KV blocks in use.", labels,
                              registry=r, **gauge)
        self.busy = Gauge("hybridlb:engine_busy_seconds", "Time the engine spent stepping.", labels,
                          registry=r, **gauge)
        self.rss = Gauge("hybridlb:engine_resident_memory_bytes", "The engine process's resident memory.",
                         labels, registry=r, **gauge)
        self.dummy_steps = Gauge("hybridlb:dummy_steps", "MoE lockstep: steps run with no work.", labels,
                                 registry=r, **gauge)
        self.collective = Gauge("hybridlb:dp_collective_seconds", "MoE lockstep: time in DP collectives.",
                                labels, registry=r, **gauge)
        self.wave = Gauge("hybridlb:dp_current_wave", "MoE lockstep: the current wave.", ["model_name"],
                          registry=r, **gauge)
        self.waves_completed = Gauge("hybridlb:dp_waves_completed", "MoE lockstep: waves completed.",
                                     ["model_name"], registry=r, **gauge)
        self.ttft = Histogram("hybridlb:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("hybridlb:inter_token_latency_seconds", "Time between streamed tokens.", labels,
                             buckets=_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("hybridlb:e2e_request_latency_seconds", "Request latency, arrival to finish.",
                             labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("hybridlb:prompt_tokens", "Prompt tokens processed.", labels, registry=r)
        self.generation_tokens = Counter("hybridlb:generation_tokens", "Tokens generated.", labels, registry=r)
        self.success = Counter("hybridlb:request_success", "Finished requests by reason.",
                               [*labels, "finished_reason"], registry=r)
        self.model_name = model_name

    def labels(self, rank: int) -> dict[str, str]:
        return {"model_name": self.model_name, "engine": str(rank)}

    def register_engine(self, rank: int) -> None:
        """Expose every series of an engine from the start, at zero."""
        self.update_stats(EngineStats(rank, 0, 0, 0.0))
        for metric in (self.prompt_tokens, self.generation_tokens):
            metric.labels(**self.labels(rank))
        for reason in ("stop", "length"):
            self.success.labels(**self.labels(rank), finished_reason=reason)

    def update_stats(self, stats: EngineStats) -> None:
        if self.observer is not None:
            self.observer.engine_stats(stats)
        labels = self.labels(stats.rank)
        self.running.labels(**labels).set(stats.num_running)
        self.waiting.labels(**labels).set(stats.num_waiting)
        self.kv_usage.labels(**labels).set(stats.kv_usage)
        self.busy.labels(**labels).set(stats.busy_s)
        self.rss.labels(**labels).set(stats.rss_mib * 2**20)
        self.dummy_steps.labels(**labels).set(stats.dummy_steps)
        self.collective.labels(**labels).set(stats.collective_s)

    def update_waves(self, snapshot: LoadSnapshot) -> None:
        self.wave.labels(model_name=self.model_name).set(snapshot.current_wave)
        self.waves_completed.labels(model_name=self.model_name).set(snapshot.waves_completed)

    def first_token(self, rank: int, seconds: float) -> None:
        self.ttft.labels(**self.labels(rank)).observe(seconds)
        if self.observer is not None:
            self.observer.first_token(rank, seconds)

    def finished(self, rank: int, reason: str, e2e_s: float, prompt_tokens: int, output_tokens: int) -> None:
        if self.observer is not None:
            self.observer.finished(rank, reason)
        labels = self.labels(rank)
        self.success.labels(**labels, finished_reason=reason).inc()
        self.e2e.labels(**labels).observe(e2e_s)
        self.prompt_tokens.labels(**labels).inc(prompt_tokens)
        self.generation_tokens.labels(**labels).inc(output_tokens)

    def render(self) -> bytes:
        if self.multiprocess:
            registry = CollectorRegistry()
            MultiProcessCollector(registry)
            return generate_latest(registry)
        return generate_latest(self.registry)
