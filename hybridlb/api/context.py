"""What one API server is and holds: its place in the cluster (``ApiServerSpec``, from the
launcher) and the objects every route works with (``ApiContext``, built by ``create_app``).

Light on purpose: launchers import ``ApiServerSpec`` and a spawned API server unpickles
it before it imports its metrics library (which reads ``PROMETHEUS_MULTIPROC_DIR`` once,
at import; ``hybridlb.api.http_server.use_shared_metrics``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hybridlb.api.errors import APIError

if TYPE_CHECKING:
    from hybridlb.api.admission import Slots
    from hybridlb.api.logprobs import LogprobFormatter
    from hybridlb.api.lora import AdapterRegistry
    from hybridlb.api.metrics import Metrics
    from hybridlb.api.pool import EnginePool
    from hybridlb.api.runner import RequestRunner
    from hybridlb.checkpoint.tokenizer import Tokenizer
    from hybridlb.config import Config


@dataclass(frozen=True)
class ApiServerSpec:
    """Which engines one API server fronts, and how it fits in the cluster."""

    engines: tuple[tuple[int, str], ...]  # (global rank, address)
    name: str = "api:0"
    node: int = 0
    mode: str = "hybrid"
    coordinator_loads: str | None = None
    policy: str = "cache_aware"
    cluster_token: str | None = None  # keys for TCP sockets (``hybridlb.transport``), resolved by the launcher
    # Several API server processes share the node's port: one /metrics for all of them, kept in
    # files here (whichever process answers a scrape reports the node's totals).
    metrics_dir: str | None = None


@dataclass
class ApiContext:
    """The routes' dependencies; ``pool`` and ``runner`` exist once the server has started."""

    config: Config
    spec: ApiServerSpec
    tokenizer: Tokenizer
    metrics: Metrics
    slots: Slots
    sampling_defaults: dict  # the model's generation_config.json, for fields a request leaves unset
    logprob_format: LogprobFormatter
    adapters: AdapterRegistry
    pool: EnginePool | None = None
    runner: RequestRunner | None = None

    @functools.cached_property
    def reasoning_start_ids(self) -> list[int]:
        """The tokens of ``<think>`` (see Constraint.opener), tokenized once."""
        return self.tokenizer.encode("<think>", add_special_tokens=False)

    @functools.cached_property
    def reasoning_end_ids(self) -> list[int]:
        """The tokens of ``</think>``: a reasoning model's constraint starts after them (tokenized once)."""
        return self.tokenizer.encode("</think>", add_special_tokens=False)

    @property
    def served_names(self) -> list[str]:
        return self.config.served_model_names

    def serving(self, model: str | None) -> EnginePool:
        """The engines, for a request naming ``model`` (None: a tokenizer call that names none):
        404 for a model this server does not serve, 503 until every engine said ready."""
        if model is not None and model not in self.served_names and self.adapters.get(model) is None:
            served = ", ".join(f"`{n}`" for n in self.served_names + list(self.adapters.adapters))
            raise APIError(404, f"the model `{model}` does not exist; this server serves {served}",
                           param="model", code="model_not_found")
        if not self.pool.started:
            raise APIError(503, "the engines of this node are not ready yet")
        return self.pool
