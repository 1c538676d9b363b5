"""Key API server metrics mirrored into Ray's metrics, so the Ray dashboard graphs them:
request rate by engine and finish reason, time to first token, and per-engine load."""

from __future__ import annotations

from ray.util.metrics import Counter, Gauge, Histogram

from hybridlb.protocol import EngineStats

_TTFT_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]


class RayMetricsMirror:
    def __init__(self, cluster: str, api_server: str):
        self.tags = {"cluster": cluster, "api_server": api_server}
        keys = ("cluster", "api_server", "engine")
        self.requests = Counter("hybridlb_requests", "Finished requests.", tag_keys=(*keys, "finished_reason"))
        self.ttft = Histogram("hybridlb_time_to_first_token_seconds", "Time to first token.",
                              boundaries=_TTFT_BUCKETS, tag_keys=keys)
        self.running = Gauge("hybridlb_engine_requests_running", "Requests running in the engine.", tag_keys=keys)
        self.waiting = Gauge("hybridlb_engine_requests_waiting", "Requests waiting in the engine.", tag_keys=keys)

    def _tags(self, rank: int, **extra) -> dict:
        return {**self.tags, "engine": str(rank), **extra}

    def first_token(self, rank: int, seconds: float) -> None:
        self.ttft.observe(seconds, tags=self._tags(rank))

    def finished(self, rank: int, reason: str) -> None:
        self.requests.inc(1, tags=self._tags(rank, finished_reason=reason))

    def engine_stats(self, stats: EngineStats) -> None:
        self.running.set(stats.num_running, tags=self._tags(stats.rank))
        self.waiting.set(stats.num_waiting, tags=self._tags(stats.rank))
