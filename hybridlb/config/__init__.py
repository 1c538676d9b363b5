"""The one configuration tree, loaded from YAML or built from CLI flags.

One module per part of the tree: ``engine`` (the engine's sections) and ``cluster`` (API
server, data parallel, load balancing, Ray); this module holds the root ``Config`` and
the loaders, and is where everything is imported from (``from hybridlb.config import ...``).

Every field is documented with ``Field(description=...)``, and a field the command line
sets declares its flag there too (``flags.flag``): the CLI's options, their ``--help`` and
docs/configuration.md (``python -m hybridlb.config.doc``) are made from the fields. Models
forbid unknown keys and are frozen: values resolved at run time (the model's real max
length, the number of KV blocks) live in the component that resolved them, never back in
here.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import Field, ValidationError

from hybridlb.config.base import ConfigError, _Section
from hybridlb.config.cluster import (
    ApiConfig,
    AutoscalingConfig,
    DataParallelConfig,
    LoadBalancingConfig,
    NodeConfig,
    RayConfig,
)
from hybridlb.config.engine import (
    MODEL_ALIASES,
    EngineConfig,
    KVEventsConfig,
    MakeModelConfig,
    SimulateConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
    check_kv_cache_fits,
    model_own_name,
)
from hybridlb.config.explain import problem_lines
from hybridlb.config.lora import LoRAConfig, LoRAModuleConfig

__all__ = ["MODEL_ALIASES", "ApiConfig", "AutoscalingConfig", "Config", "ConfigError", "DataParallelConfig",
           "EngineConfig", "KVEventsConfig", "LoRAConfig", "LoRAModuleConfig", "LoadBalancingConfig",
           "MakeModelConfig", "NodeConfig", "RayConfig", "SimulateConfig", "SpeculativeConfig",
           "StructuredOutputsConfig", "check_kv_cache_fits", "load_config", "model_own_name", "parse_config",
           "read_config_file"]


class Config(_Section):
    """The whole hybridlb configuration."""

    engine: EngineConfig = Field(description="Model and engine settings shared by every rank.")
    api: ApiConfig = Field(default_factory=ApiConfig, description="HTTP API server settings.")
    data_parallel: DataParallelConfig = Field(
        default_factory=DataParallelConfig, description="Ranks, nodes and their wiring."
    )
    lb: LoadBalancingConfig = Field(default_factory=LoadBalancingConfig, description="Load-balancing mode.")
    ray: RayConfig = Field(default_factory=RayConfig, description="Placement on Ray (hybridlb up).")
    autoscaling: AutoscalingConfig | None = Field(
        None, description="Resize a one-node cluster (`serve` or `up`) by its load (off when absent).")

    @property
    def served_model_names(self) -> list[str]:
        names = self.api.served_model_name
        if not names:
            own = model_own_name(self.engine.model)
            return [own, self.engine.model] if own else [self.engine.model]
        return [names] if isinstance(names, str) else list(names)

    @property
    def served_model_name(self) -> str:
        """The first served name: the one metrics and logs use."""
        return self.served_model_names[0]


def parse_config(data: object, source: str = "config") -> Config:
    """Validate a mapping into a Config, or raise ConfigError listing every problem."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        problems = problem_lines(exc, Config)
        raise ConfigError(f"{source} is invalid:\n" + "\n".join(f"  {p}" for p in problems), problems) from None


def read_config_file(path: str | Path) -> object:
    """A YAML config file's contents, not validated yet (the CLI puts its flags on top first)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None


def load_config(path: str | Path) -> Config:
    """Load and validate a YAML config file."""
    return parse_config(read_config_file(path), str(path))
