"""ModelSpec: the architecture facts of a checkpoint, read from its config.json.

One frozen description for every supported architecture, so the model code never
looks at raw config keys. Field names of transformers 4 and 5 are both accepted
(``rope_theta`` or ``rope_parameters``; ``num_experts`` or ``num_local_experts``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DENSE_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
MOE_ARCHITECTURES = {
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
SUPPORTED_ARCHITECTURES = {**DENSE_ARCHITECTURES, **MOE_ARCHITECTURES}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the file and the fix."""


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    rope: dict[str, Any]
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[bool, ...] = ()

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and self.moe_layers[layer]


def _require(cfg: dict, key: str, path: Path) -> Any:
    if key not in cfg:
        raise CheckpointError(f"{path}: missing required field {key!r}")
    return cfg[key]


def _rope(cfg: dict, path: Path) -> dict[str, Any]:
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    params.setdefault("rope_theta", cfg.get("rope_theta", params.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"{path}: rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    params["rope_type"] = rope_type
    return params


def _moe_layers(cfg: dict, num_layers: int, family: str) -> tuple[bool, ...]:
    if family == "mixtral":
        return (True,) * num_layers
    step = cfg.get("decoder_sparse_step", 1) or 1
    dense_only = set(cfg.get("mlp_only_layers") or [])
    return tuple(i not in dense_only and (i + 1) % step == 0 for i in range(num_layers))


def parse_spec(cfg: dict, path: Path) -> ModelSpec:
    """Build a ModelSpec from a parsed config.json (``path`` only names it in errors)."""
    architectures = cfg.get("architectures") or []
    arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise CheckpointError(
            f"{path}: architecture {architectures or '(none)'} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    family = SUPPORTED_ARCHITECTURES[arch]
    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{path}: hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
    if cfg.get("mlp_bias"):
        raise CheckpointError(f"{path}: mlp_bias=true is not supported")
    hidden = _require(cfg, "hidden_size", path)
    heads = _require(cfg, "num_attention_heads", path)
    num_layers = _require(cfg, "num_hidden_layers", path)
    spec = dict(
        architecture=arch,
        family=family,
        vocab_size=_require(cfg, "vocab_size", path),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        intermediate_size=_require(cfg, "intermediate_size", path),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=family in ("qwen3", "qwen3_moe"),
        rope=_rope(cfg, path),
    )
    if family in MOE_ARCHITECTURES.values():
        experts = cfg.get("num_experts") or cfg.get("num_local_experts")
        if not experts:
            raise CheckpointError(f"{path}: MoE architecture {arch} needs num_experts / num_local_experts")
        spec.update(
            num_experts=experts,
            num_experts_per_tok=_require(cfg, "num_experts_per_tok", path),
            moe_intermediate_size=cfg.get("moe_intermediate_size") or spec["intermediate_size"],
            norm_topk_prob=family == "mixtral" or bool(cfg.get("norm_topk_prob", False)),
            moe_layers=_moe_layers(cfg, num_layers, family),
        )
    if spec["num_heads"] % spec["num_kv_heads"]:
        raise CheckpointError(f"{path}: num_attention_heads must be a multiple of num_key_value_heads")
    return ModelSpec(**spec)


def load_spec(model_dir: str | Path) -> ModelSpec:
    """Read ``config.json`` of a checkpoint directory."""
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise CheckpointError(f"model directory {model_dir} does not exist (nothing is ever downloaded)")
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: a checkpoint directory needs config.json")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None
    return parse_spec(cfg, path)
