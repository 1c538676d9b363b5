"""ModelSpec: the architecture facts of a checkpoint, read from its config.json
(or, for a GGUF file, from the file's metadata mapped to the same fields).

One frozen description for every supported architecture, so the model code never
looks at raw config keys. Field names of transformers 4 and 5 are both accepted
(``rope_scaling`` or ``rope_parameters``, ``torch_dtype`` or ``dtype``, ``num_experts``
or ``num_local_experts``); ``architectures: null`` falls back on ``model_type``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridlb.checkpoint.path import CheckpointError, resolve

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
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
# Keys each scaled rope type needs in rope_parameters / rope_scaling.
ROPE_REQUIRED = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor",),
}
CHECKPOINT_DTYPES = ("float32", "bfloat16", "float16")
__all__ = ["CheckpointError", "ModelSpec", "load_spec", "parse_spec"]


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
    dtype: str = "float32"  # what the checkpoint stores (torch_dtype / dtype); engines choose their own
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[bool, ...] = ()

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def max_length(self) -> int:
        """Longest sequence the model supports: rope scaling (linear, dynamic, yarn) extends the
        pretraining length by its factor, as vLLM derives it; llama3 configs already state theirs."""
        if self.rope["rope_type"] in ("linear", "dynamic", "yarn"):
            scaled = int(self.rope["original_max_position_embeddings"] * self.rope["factor"])
            return max(self.max_position_embeddings, scaled)
        return self.max_position_embeddings

    def model_len(self, requested: int | None) -> int:
        """The max_model_len an engine serves: ``requested``, checked, or the model's own."""
        if requested is None:
            return self.max_length
        if requested > self.max_length:
            raise ValueError(
                f"max_model_len={requested} exceeds the model's maximum length {self.max_length} "
                f"(max_position_embeddings={self.max_position_embeddings}, rope {self.rope['rope_type']}); "
                "lower max_model_len"
            )
        return requested

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and self.moe_layers[layer]

    @property
    def num_parameters(self) -> int:
        """Weights the model holds (all experts; a tied output layer counted once)."""
        hidden, dim = self.hidden_size, self.head_dim
        attention = hidden * (self.num_heads + 2 * self.num_kv_heads) * dim + self.num_heads * dim * hidden
        attention += (self.num_heads + 2 * self.num_kv_heads) * dim if self.attention_bias else 0
        attention += 2 * dim if self.qk_norm else 0
        dense = 3 * hidden * self.intermediate_size
        moe = self.num_experts * 3 * hidden * self.moe_intermediate_size + hidden * self.num_experts
        layers = sum(attention + 2 * hidden + (moe if self.is_moe_layer(i) else dense) for i in range(self.num_layers))
        embeddings = self.vocab_size * hidden * (1 if self.tie_word_embeddings else 2)
        return layers + embeddings + hidden  # + the final norm


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
    missing = [key for key in ROPE_REQUIRED.get(rope_type, ()) if params.get(key) is None]
    if missing:
        raise CheckpointError(f"{path}: rope type {rope_type!r} needs {', '.join(missing)} in rope_parameters")
    params["rope_type"] = rope_type
    # dynamic and yarn scale relative to the pretraining length, which config.json may only imply.
    params.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings", 2048))
    return params


def _architecture(cfg: dict, path: Path) -> str:
    architectures = cfg.get("architectures") or []
    arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None and not architectures:  # e.g. written from a GGUF load: "architectures": null
        families = {family: name for name, family in SUPPORTED_ARCHITECTURES.items()}
        arch = families.get(cfg.get("model_type"))
    if arch is None:
        raise CheckpointError(
            f"{path}: architecture {architectures or cfg.get('model_type') or '(none)'} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _dtype(cfg: dict, path: Path) -> str:
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    if dtype not in CHECKPOINT_DTYPES:
        raise CheckpointError(f"{path}: dtype {dtype!r} is not supported; supported: {', '.join(CHECKPOINT_DTYPES)}")
    return dtype


def _moe_layers(cfg: dict, num_layers: int, family: str) -> tuple[bool, ...]:
    if family == "mixtral":
        return (True,) * num_layers
    step = cfg.get("decoder_sparse_step", 1) or 1
    dense_only = set(cfg.get("mlp_only_layers") or [])
    return tuple(i not in dense_only and (i + 1) % step == 0 for i in range(num_layers))


def parse_spec(cfg: dict, path: Path) -> ModelSpec:
    """Build a ModelSpec from a parsed config.json (``path`` only names it in errors)."""
    arch = _architecture(cfg, path)
    family = SUPPORTED_ARCHITECTURES[arch]
    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{path}: hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "?")
        raise CheckpointError(f"{path}: quantized checkpoints ({method}) are not supported; serve the "
                              "unquantized checkpoint, or a GGUF file")
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
        dtype=_dtype(cfg, path),
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


def load_spec(model: str | Path) -> ModelSpec:
    """The spec of a model argument: ``config.json`` of a directory, or a GGUF file's metadata."""
    checkpoint = resolve(model)
    if checkpoint.is_gguf:
        from hybridlb.checkpoint.gguf import gguf_config

        return parse_spec(gguf_config(checkpoint.path), checkpoint.path)
    path = checkpoint.path / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: a checkpoint directory needs config.json")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None
    return parse_spec(cfg, path)
