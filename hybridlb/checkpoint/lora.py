"""LoRA adapters in PEFT's format, read and checked against the base model without torch.

An adapter is a directory as ``peft``'s ``save_pretrained`` writes it: ``adapter_config.json``
and ``adapter_model.safetensors``, whose tensors are named
``base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight``. Module
``m`` of layer ``i`` then adds ``scaling * B @ A @ x`` to its output, with ``A`` [r, in],
``B`` [out, r] and ``scaling`` ``lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``).

The API server checks an adapter here when it is registered (``--lora-modules``, or loaded at
run time), so a bad directory is a clear 400 before any engine sees it; engines read the
tensors themselves (``hybridlb.model.lora``).
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from hybridlb.checkpoint.spec import ModelSpec, load_spec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
SUPPORTED = ", ".join(ATTENTION_MODULES + MLP_MODULES)
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.([A-Za-z0-9_.]+)\.lora_([AB])"
                  r"\.weight$")
_MAX_HEADER = 100 * 2**20


class AdapterError(ValueError):
    """An adapter directory hybridlb cannot serve; the message names the problem and the fix."""


@dataclass(frozen=True)
class AdapterModule:
    """One adapted projection: layer, PEFT module name, its rank and scaling."""

    layer: int
    module: str  # q_proj, ..., down_proj
    rank: int
    scaling: float

    @property
    def prefix(self) -> str:
        part = "self_attn" if self.module in ATTENTION_MODULES else "mlp"
        return f"model.layers.{self.layer}.{part}.{self.module}"  # tensor names, less peft's base_model.model.


@dataclass(frozen=True)
class AdapterInfo:
    """A checked adapter: what an engine needs to place its tensors."""

    path: str
    rank: int  # the largest module rank
    modules: tuple[AdapterModule, ...]
    base_model: str | None  # adapter_config's base_model_name_or_path, as written

    @property
    def target_modules(self) -> list[str]:
        return sorted({m.module for m in self.modules})


def module_shape(spec: ModelSpec, module: str) -> tuple[int, int]:
    """(in_features, out_features) of a projection of ``spec``'s decoder layers."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    return {
        "q_proj": (spec.hidden_size, q), "k_proj": (spec.hidden_size, kv), "v_proj": (spec.hidden_size, kv),
        "o_proj": (q, spec.hidden_size), "gate_proj": (spec.hidden_size, spec.intermediate_size),
        "up_proj": (spec.hidden_size, spec.intermediate_size), "down_proj": (spec.intermediate_size, spec.hidden_size),
    }[module]


def read_header(path: Path) -> dict[str, dict]:
    """A safetensors file's tensor table (name -> dtype, shape, offsets), without its data."""
    try:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > _MAX_HEADER:
                raise AdapterError(f"{path} is not a safetensors file (its header claims {size} bytes)")
            header = json.loads(f.read(size))
    except (OSError, struct.error, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{path} could not be read as safetensors ({type(exc).__name__}); save the adapter "
                           "with peft's save_pretrained") from None
    header.pop("__metadata__", None)
    return header


def _config(directory: Path) -> dict:
    file = directory / CONFIG_FILE
    if not file.is_file():
        raise AdapterError(f"{directory} has no {CONFIG_FILE}; give a directory written by peft's save_pretrained")
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{file} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{file} is not a JSON object")
    kind = config.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise AdapterError(f"{file}: peft_type {kind!r} is not served; hybridlb serves LoRA adapters only")
    refused = {"use_dora": "DoRA adapters", "modules_to_save": "modules_to_save (fully trained extra modules)",
               "fan_in_fan_out": "fan_in_fan_out (Conv1D models)", "layer_replication": "layer_replication",
               "use_qalora": "QA-LoRA", "lora_bias": "LoRA biases (lora_bias)",
               "target_parameters": "target_parameters (adapted expert weights)",
               "trainable_token_indices": "trained token embeddings (trainable_token_indices)",
               "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)"}
    for key, what in refused.items():
        if config.get(key):
            raise AdapterError(f"{file}: {what} are not supported; train a plain LoRA adapter")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{file}: bias {config['bias']!r} is not supported; train with bias='none'")
    return config


def _alpha(config: dict, name: str) -> float:
    """lora_alpha for module ``name`` (its full dotted name), alpha_pattern's override first."""
    for pattern, alpha in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", name):
            return float(alpha)
    return float(config.get("lora_alpha", 8))


def read_adapter(path: str | Path, spec: ModelSpec, max_rank: int) -> AdapterInfo:
    """Check the adapter at ``path`` against the base model ``spec``; raise AdapterError naming
    the problem (missing files, unsupported modules, shapes of another model, rank over ``max_rank``)."""
    directory = Path(path)
    if not directory.is_dir():
        raise AdapterError(f"no adapter directory at {path}; give the directory peft's save_pretrained wrote")
    config = _config(directory)
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        legacy = (directory / "adapter_model.bin").exists()
        hint = " (adapter_model.bin: re-save it with safe_serialization)" if legacy else ""
        raise AdapterError(f"{directory} has no {WEIGHTS_FILE}{hint}")
    header = read_header(weights)
    pairs: dict[tuple[int, str], dict[str, list[int]]] = {}
    for key, entry in header.items():
        match = _KEY.match(key)
        if match is None:
            raise AdapterError(f"{weights}: tensor {key!r} is not a LoRA weight of a decoder layer's projection; "
                               f"hybridlb adapts {SUPPORTED} (not embeddings, lm_head or norms)")
        layer, part, module, which = int(match[1]), match[2], match[3], match[4]
        expected = ATTENTION_MODULES if part == "self_attn" else MLP_MODULES
        if module not in expected:
            raise AdapterError(f"{weights}: target module {part}.{module} is not supported; hybridlb adapts "
                               f"{SUPPORTED}")
        if layer >= spec.num_layers:
            raise AdapterError(f"{weights}: layer {layer} does not exist; the base model has {spec.num_layers} "
                               "layers (an adapter for another model?)")
        if part == "mlp" and spec.is_moe_layer(layer):
            raise AdapterError(f"{weights}: layer {layer}'s MLP is a mixture of experts; hybridlb adapts the "
                               "attention projections of MoE layers only")
        pairs.setdefault((layer, module), {})[which] = list(entry.get("shape", []))
    modules = []
    for (layer, module), shapes in sorted(pairs.items()):
        name = f"model.layers.{layer}.{'self_attn' if module in ATTENTION_MODULES else 'mlp'}.{module}"
        if set(shapes) != {"A", "B"}:
            raise AdapterError(f"{weights}: {name} has lora_{next(iter(shapes))} but not its other half")
        rank = shapes["A"][0] if shapes["A"] else 0
        in_features, out_features = module_shape(spec, module)
        if shapes["A"] != [rank, in_features] or shapes["B"] != [out_features, rank]:
            raise AdapterError(f"{weights}: {name} has lora_A {shapes['A']} and lora_B {shapes['B']}, but the "
                               f"base model needs [r, {in_features}] and [{out_features}, r]; this adapter was "
                               "trained for another base model")
        if not 1 <= rank <= max_rank:
            raise AdapterError(f"{weights}: {name} has rank {rank}, above max_lora_rank={max_rank}; raise "
                               f"--max-lora-rank to at least {rank}")
        alpha = _alpha(config, name)
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        modules.append(AdapterModule(layer, module, rank, scaling))
    if not modules:
        raise AdapterError(f"{weights} holds no LoRA weights")
    return AdapterInfo(str(directory), max(m.rank for m in modules), tuple(modules),
                       config.get("base_model_name_or_path"))


def check_adapter(path: str | Path, model: str, max_rank: int) -> AdapterInfo:
    """``read_adapter`` against the checkpoint ``model`` (the engine's model argument)."""
    return read_adapter(path, load_spec(model), max_rank)
