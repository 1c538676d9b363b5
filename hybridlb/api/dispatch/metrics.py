"""Prometheus metrics of one API server, labelled per engine.

What vLLM also measures carries vLLM's name, type, labels (``model_name``, ``engine``) and
histogram buckets, so llm-d's endpoint picker (``vllm:num_requests_waiting``,
``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``) and vLLM's Grafana dashboard
read a hybridlb server unmodified. What only hybridlb has (expert-parallel waves and
collectives, busy time, engine memory) is under ``hybridlb:``.

``engine`` is the global data-parallel rank, so balance across ranks is checkable from
``/metrics`` alone. When several API server processes share a node's port, the launcher
sets ``PROMETHEUS_MULTIPROC_DIR`` and every scrape, whichever process answers it, reports
the node's totals: counters and histograms add up across the processes, engine gauges
show the most recent value any of them saw.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from hybridlb.protocol import EngineReady, EngineStats, LoadSnapshot

# vLLM's default buckets (vllm/v1/metrics/buckets.py), so dashboards' quantiles line up.
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
N_BUCKETS = (1, 2, 5, 10, 20)
DEFAULT_MAX_MODEL_LEN = 32768  # token-count buckets before the engines said their limit


def token_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (vLLM's request-token buckets)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


# vLLM's per-request histograms, by the key ``Metrics.observe`` takes: name, help, buckets
# (None: token counts up to max_model_len).
HISTOGRAMS = {
    "ttft": ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS),
    "itl": ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS),
    "tpot": ("vllm:request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.",
             ITL_BUCKETS),
    "e2e": ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS),
    "queue": ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
              REQUEST_LATENCY_BUCKETS),
    "inference": ("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
                  REQUEST_LATENCY_BUCKETS),
    "prefill": ("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
                REQUEST_LATENCY_BUCKETS),
    "decode": ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
               REQUEST_LATENCY_BUCKETS),
    "prompt": ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", None),
    "generation": ("vllm:request_generation_tokens", "Number of generation tokens processed.", None),
    "max_tokens": ("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", None),
    "max_generation": ("vllm:request_max_num_generation_tokens",
                       "Histogram of maximum number of requested generation tokens.", None),
    "n": ("vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS),
}


@dataclass
class Finished:
    """One finished request, as the API server saw it (times in seconds)."""

    rank: int
    reason: str
    e2e_s: float
    prompt_tokens: int
    output_tokens: int
    max_tokens: int | None
    ttft_s: float | None = None
    queued_s: float | None = None  # the engine's: waiting before it was first scheduled
    prefill_s: float | None = None  # the engine's: first scheduled to first token


class EngineTotals(Collector):
    """Counters the engines keep themselves (preemptions, prefix-cache queries and hits),
    exported as each engine's latest running total: exact whichever API server process
    answers the scrape (adding them up across processes would count them once per
    process), and back to zero when an engine restarts, as a counter reset should."""

    COUNTERS = (
        ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", "num_preemptions"),
        ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
         "prefix_queries"),
        ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", "prefix_hits"),
        ("hybridlb:engine_orphaned_requests", "Requests the engine aborted because their API server was gone.",
         "orphans_aborted"),
        ("hybridlb:engine_step_failures", "Engine steps that raised (their requests failed with 500).",
         "step_failures"),
        ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", "spec_drafts"),
        ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", "spec_draft_tokens"),
        ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", "spec_accepted_tokens"),
        ("hybridlb:lora_adapter_loads", "LoRA adapters loaded into one of the engine's slots (a miss of "
         "adapter-aware routing, or a first use).", "lora_loads"),
        ("hybridlb:engine_uptime_seconds", "Wall time of the engine's loop since it started (what "
         "engine_loop_seconds' phases add up to).", "uptime_s"),
    )

    TIME_COUNTERS = (
        ("hybridlb:engine_step_seconds", "Time in engine steps, by kind: decode, mixed (prefill chunks with "
         "decodes), prefill, unclassified (a backend that cannot tell).", "step_s", "kind"),
        ("hybridlb:engine_steps", "Engine steps that ran tokens, by kind.", "step_counts", "kind"),
        ("hybridlb:engine_step_tokens", "Positions computed by engine steps, by kind.", "step_tokens", "kind"),
        ("hybridlb:engine_loop_seconds", "Wall time of the engine's loop by phase: idle (waiting for work), "
         "take (requests in), step (scheduling and the step), publish (outputs and stats out).", "loop_s", "phase"),
    )

    def __init__(self, model_name: str, max_loras: int = 0):
        self.model_name = model_name
        self.max_loras = max_loras  # LoRA: adapters per engine (0: LoRA off, no lora_requests_info)
        self.stats: dict[int, EngineStats] = {}
        self.stats_at: dict[int, float] = {}  # when each engine's stats arrived (lora_requests_info's value)

    def collect(self):
        for name, help_, field in self.COUNTERS:
            family = CounterMetricFamily(name, help_, labels=["model_name", "engine"])
            for rank, stats in sorted(self.stats.items()):
                family.add_metric([self.model_name, str(rank)], getattr(stats, field))
            yield family
        family = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft's "
                                     "position.", labels=["model_name", "engine", "position"])
        for rank, stats in sorted(self.stats.items()):
            for position, accepted in enumerate(stats.spec_accepted_per_pos):
                family.add_metric([self.model_name, str(rank), str(position)], accepted)
        yield family
        yield from self._where_time_went()

    def _where_time_went(self):
        """Each engine's steps by kind and its loop's wall time by phase (engine.step_clock)."""
        for name, help_, field, label in self.TIME_COUNTERS:
            family = CounterMetricFamily(name, help_, labels=["model_name", "engine", label])
            for rank, stats in sorted(self.stats.items()):
                for key, value in sorted(getattr(stats, field).items()):
                    family.add_metric([self.model_name, str(rank), key], value)
            yield family
        if self.max_loras:
            yield self._lora_info()

    def _lora_info(self) -> GaugeMetricFamily:
        """vLLM's ``vllm:lora_requests_info``, one series per rank (so llm-d's LoRA scorer reads
        each rank's adapters, not a mix): the adapters its running and waiting requests use."""
        family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                   labels=["model_name", "engine", "max_lora", "running_lora_adapters",
                                           "waiting_lora_adapters"])
        for rank, stats in sorted(self.stats.items()):
            family.add_metric([self.model_name, str(rank), str(self.max_loras), ",".join(stats.lora_running),
                               ",".join(stats.lora_waiting)], self.stats_at.get(rank, 0.0))
        return family


class Metrics:
    def __init__(self, model_name: str, observer=None, max_model_len: int = DEFAULT_MAX_MODEL_LEN,
                 max_loras: int = 0):
        # observer: also told of first tokens, finishes and engine stats (the Ray dashboard mirror)
        self.observer = observer
        self.model_name = model_name
        self._series: dict[tuple, object] = {}  # see of()
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        # In multiprocess mode values live in files and a collector reads them all at scrape time.
        self.registry = CollectorRegistry()
        self.totals = EngineTotals(model_name, max_loras)
        r = None if self.multiprocess else self.registry
        labels = ["model_name", "engine"]
        gauge = {"multiprocess_mode": "mostrecent"} if self.multiprocess else {}

        def g(name: str, help_: str, names=labels) -> Gauge:
            return Gauge(name, help_, names, registry=r, **gauge)

        self.running = g("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = g("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = g("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.registry.register(self.totals)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                         labels, registry=r)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               [*labels, "finished_reason"], registry=r)
        tokens = token_buckets(max_model_len)
        self.histograms = {key: Histogram(name, help_, labels, buckets=tokens if buckets is None else buckets,
                                          registry=r)
                           for key, (name, help_, buckets) in HISTOGRAMS.items()}
        self.cache_config = g("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                              ["block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching", "engine"])
        # hybridlb's own
        self.busy = g("hybridlb:engine_busy_seconds", "Time the engine spent stepping.")
        self.rss = g("hybridlb:engine_resident_memory_bytes", "The engine process's resident memory.")
        self.dummy_steps = g("hybridlb:dummy_steps", "MoE lockstep: steps run with no work.")
        self.collective = g("hybridlb:dp_collective_seconds", "MoE lockstep: time in DP collectives.")
        self.lost = Counter("hybridlb:lost_requests", "Requests whose client got an error because the engine they "
                            "were in flight on failed, by why: engine_down, lost_output (a gap in the engine's "
                            "messages), stuck (the engine silent for api.engine_stall_s), timeout (no output for "
                            "api.request_timeout_s), reader_error, shutdown. A request that moved on to another "
                            "engine is not lost (hybridlb:migrated_requests), unless it fails there later.",
                            [*labels, "reason"], registry=r)
        self.migrated = Counter("hybridlb:migrated_requests", "Requests that went on on another engine of the node "
                                "(or this one, once it answered again) after this one failed under them: mid-stream "
                                "with the tokens they had (api.migration_limit), or sent again before their first "
                                "token. Each counts once per move, by the engine it left.", labels, registry=r)
        self.quarantined = Counter("hybridlb:quarantined_requests", "Requests failed and never sent again because "
                                   "the engines they were in flight on failed twice (a request that kills "
                                   "engines).", ["model_name"], registry=r)
        self.resizes = Counter("hybridlb:data_parallel_resizes", "Resizes of this node (elastic data parallelism), by "
                               "what asked (api: POST /scale_elastic_ep; autoscaling) and direction (up, down).",
                               ["model_name", "trigger", "direction"], registry=r)
        self.pinned = Counter("hybridlb:pinned_requests", "Requests pinned to this engine by X-data-parallel-rank "
                              "(a gateway choosing the rank).", labels, registry=r)
        self.wave = g("hybridlb:dp_current_wave", "MoE lockstep: the current wave.", ["model_name"])
        self.waves_completed = g("hybridlb:dp_waves_completed", "MoE lockstep: waves completed.", ["model_name"])

    def labels(self, rank: int) -> dict[str, str]:
        return {"model_name": self.model_name, "engine": str(rank)}

    def of(self, metric, rank: int, *extra: str):
        """``metric``'s series for engine ``rank`` (and ``extra`` label values), looked up once:
        prometheus_client's ``labels()`` costs more per call than the observation itself."""
        key = (id(metric), rank, *extra)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = metric.labels(self.model_name, str(rank), *extra)
        return series

    def register_engine(self, rank: int) -> None:
        """Expose every series of an engine from the start, at zero."""
        self.update_stats(EngineStats(rank, 0, 0, 0.0))
        for metric in (self.prompt_tokens, self.generation_tokens):
            metric.labels(**self.labels(rank))
        for reason in ("stop", "length"):
            self.success.labels(**self.labels(rank), finished_reason=reason)

    def resized(self, trigger: str, direction: str) -> None:
        self.resizes.labels(self.model_name, trigger, direction).inc()

    def forget_engine(self, rank: int) -> None:
        """A rank the node shrank by: its gauges go (its counters stay, as counters do); with several
        API servers sharing /metrics, which cannot drop a series, they read 0."""
        for metric in (self.running, self.waiting, self.kv_usage, self.busy, self.rss, self.dummy_steps,
                       self.collective):
            if self.multiprocess:
                self.of(metric, rank).set(0)
                continue
            with contextlib.suppress(KeyError):
                metric.remove(self.model_name, str(rank))
        self._series = {key: series for key, series in self._series.items() if key[1] != rank}
        self.totals.stats.pop(rank, None)
        self.totals.stats_at.pop(rank, None)

    def engine_ready(self, info: EngineReady) -> None:
        self.cache_config.labels(block_size=str(info.block_size), num_gpu_blocks=str(info.num_kv_blocks),
                                 cache_dtype="auto", enable_prefix_caching=str(info.prefix_caching),
                                 engine=str(info.rank)).set(1)

    def update_stats(self, stats: EngineStats) -> None:
        if self.observer is not None:
            self.observer.engine_stats(stats)
        rank = stats.rank
        self.of(self.running, rank).set(stats.num_running)
        self.of(self.waiting, rank).set(stats.num_waiting)
        self.of(self.kv_usage, rank).set(stats.kv_usage)
        self.of(self.busy, rank).set(stats.busy_s)
        self.of(self.rss, rank).set(stats.rss_mib * 2**20)
        self.of(self.dummy_steps, rank).set(stats.dummy_steps)
        self.of(self.collective, rank).set(stats.collective_s)
        self.totals.stats[stats.rank] = stats
        self.totals.stats_at[stats.rank] = time.time()

    def update_waves(self, snapshot: LoadSnapshot) -> None:
        self.wave.labels(model_name=self.model_name).set(snapshot.current_wave)
        self.waves_completed.labels(model_name=self.model_name).set(snapshot.waves_completed)

    def pinned_request(self, rank: int) -> None:
        self.of(self.pinned, rank).inc()

    def migrated_request(self, rank: int) -> None:
        self.of(self.migrated, rank).inc()

    def quarantined_request(self) -> None:
        self.quarantined.labels(model_name=self.model_name).inc()

    def lost_requests(self, rank: int, reason: str, count: int = 1) -> None:
        self.of(self.lost, rank, reason).inc(count)

    def observe(self, key: str, rank: int, value: float) -> None:
        """One observation of histogram ``key`` (see HISTOGRAMS) for engine ``rank``."""
        self.of(self.histograms[key], rank).observe(value)

    def first_token(self, rank: int, seconds: float) -> None:
        self.observe("ttft", rank, seconds)
        if self.observer is not None:
            self.observer.first_token(rank, seconds)

    def finished(self, done: Finished) -> None:
        if self.observer is not None:
            self.observer.finished(done.rank, done.reason)
        rank = done.rank
        self.of(self.success, rank, done.reason).inc()
        self.of(self.prompt_tokens, rank).inc(done.prompt_tokens)
        self.of(self.generation_tokens, rank).inc(done.output_tokens)
        observed = {"e2e": done.e2e_s, "prompt": done.prompt_tokens, "generation": done.output_tokens, "n": 1}
        if done.max_tokens is not None:
            observed.update(max_tokens=done.max_tokens, max_generation=done.max_tokens)  # one sequence per request
        if done.ttft_s is not None and done.output_tokens > 1:
            observed["tpot"] = (done.e2e_s - done.ttft_s) / (done.output_tokens - 1)
        if done.queued_s is not None and done.prefill_s is not None and done.ttft_s is not None:
            decode_s = max(done.e2e_s - done.ttft_s, 0.0)
            observed.update(queue=done.queued_s, prefill=done.prefill_s, decode=decode_s,
                            inference=done.prefill_s + decode_s)
        for key, value in observed.items():
            self.observe(key, rank, value)

    def render(self) -> bytes:
        if self.multiprocess:
            registry = CollectorRegistry()
            MultiProcessCollector(registry)
            registry.register(self.totals)
            return generate_latest(registry)
        return generate_latest(self.registry)
