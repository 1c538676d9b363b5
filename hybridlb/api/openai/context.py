"""What every OpenAI route works with (``ApiContext``, built by ``hybridlb.api.app.create_app``):
the server's config, tokenizer and metrics, its adapters, and the node's engines."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hybridlb.api.errors import APIError
from hybridlb.api.spec import ApiServerSpec

if TYPE_CHECKING:
    from hybridlb.api.dispatch.admission import Slots
    from hybridlb.api.dispatch.lora import AdapterRegistry
    from hybridlb.api.dispatch.metrics import Metrics
    from hybridlb.api.dispatch.pool import EnginePool
    from hybridlb.api.dispatch.runner import RequestRunner
    from hybridlb.api.dispatch.scaling import ScaleLink
    from hybridlb.api.openai.logprobs import LogprobFormatter
    from hybridlb.checkpoint.tokenizer import Tokenizer
    from hybridlb.config import Config


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
    scale: ScaleLink | None = None  # resizes through the launcher (a `hybridlb serve` node)

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
