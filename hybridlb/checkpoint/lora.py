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
import os
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
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d{1,6})\.(self_attn|mlp)\.([A-Za-z0-9_.]+)\.lora_([AB])"
                  r"\.weight$")
# Caps on what checking an adapter reads, far above what peft writes (a config of ~1 KiB; a
# header of ~150 bytes per tensor, ~0.3 MiB for every projection of a 128-layer model), so a
# path a client names cannot make the API server read a huge file.
MAX_CONFIG_BYTES = 64 * 2**10
MAX_HEADER_BYTES = 4 * 2**20
# Bytes per element of each safetensors dtype.
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
                "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8}
# What a malformed JSON document raises: JSONDecodeError, UnicodeDecodeError, ValueError (an
# integer over Python's 4,300 digits), RecursionError (arrays nested thousands deep).
_JSON_ERRORS = (ValueError, RecursionError)


class AdapterError(ValueError):
    """An adapter directory hybridlb cannot serve; the message names the problem and the fix."""


class AdapterMissing(AdapterError):
    """No adapter to read at the path: missing, not a directory, no adapter_config.json, or a file
    that cannot be opened. The message says which (for the operator); a client loading adapters
    at run time gets one text for all of them (``hybridlb.api.dispatch.lora``)."""


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
    """A safetensors file's tensor table (name -> dtype, shape, offsets), without its data;
    AdapterError for a header that is too large, malformed, or points past the file's end."""
    text, data_size = _header_bytes(path)
    try:
        header = json.loads(text)
    except _JSON_ERRORS as exc:
        raise _not_safetensors(path, f"its header is not JSON ({type(exc).__name__})") from None
    if not isinstance(header, dict):
        raise _not_safetensors(path, "its header is not a JSON object")
    header.pop("__metadata__", None)
    for name, entry in header.items():
        if (problem := _entry_problem(entry, data_size)) is not None:
            raise _not_safetensors(path, f"tensor {name!r} {problem}")
    return header


def _header_bytes(path: Path) -> tuple[bytes, int]:
    """A safetensors file's header and the size of the data after it. The header's size (the
    first 8 bytes, little-endian) is checked before anything more is read."""
    try:
        with path.open("rb") as f:
            file_size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            size = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else None
            if size is not None and size > MAX_HEADER_BYTES:
                raise _not_safetensors(path, f"its header claims {size} bytes, more than the {MAX_HEADER_BYTES} "
                                             "an adapter may have")
            if size is None or size > file_size - 8:
                raise _not_safetensors(path, f"it is truncated ({file_size} bytes, shorter than its header)")
            return f.read(size), file_size - 8 - size
    except OSError as exc:
        raise AdapterMissing(f"{path} cannot be read ({exc.strerror})") from None


def _not_safetensors(path: Path, problem: str) -> AdapterError:
    return AdapterError(f"{path} is not a valid safetensors file: {problem}; save the adapter with peft's "
                        "save_pretrained")


def _entry_problem(entry: object, data_size: int) -> str | None:
    """What is wrong with one tensor of a safetensors header (None: nothing), as the library
    would refuse it when an engine reads the file."""
    if not isinstance(entry, dict) or entry.get("dtype") not in _DTYPE_BYTES:
        return "has no known dtype"
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        return "has no valid shape"
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(n) is int for n in offsets):
        return "has no valid data_offsets"
    begin, end = offsets
    if not 0 <= begin <= end <= data_size:
        return f"lies past the end of the file (data_offsets {offsets}, {data_size} bytes of data): truncated?"
    if end - begin != math.prod(shape) * _DTYPE_BYTES[entry["dtype"]]:
        return f"has {end - begin} bytes of data for shape {shape} in {entry['dtype']}"
    return None


def _read_config(directory: Path) -> tuple[Path, dict]:
    """adapter_config.json, read only up to MAX_CONFIG_BYTES, as a JSON object."""
    file = directory / CONFIG_FILE
    if not file.is_file():
        raise AdapterMissing(f"{directory} has no {CONFIG_FILE}; give a directory written by peft's save_pretrained")
    try:
        with file.open("rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise AdapterMissing(f"{file} cannot be read ({exc.strerror})") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise AdapterError(f"{file} is larger than {MAX_CONFIG_BYTES // 2**10} KiB; an adapter's config is a few "
                           "hundred bytes (save it with peft's save_pretrained)")
    try:
        config = json.loads(data)
    except _JSON_ERRORS as exc:
        raise AdapterError(f"{file} is not valid JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{file} is not a JSON object")
    return file, config


def _config(directory: Path) -> dict:
    """adapter_config.json, refusing what hybridlb does not serve by name."""
    file, config = _read_config(directory)
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
    _check_alphas(config, file)
    return config


def _check_alphas(config: dict, file: Path) -> None:
    """lora_alpha a number, alpha_pattern regexes mapped to numbers (as peft writes them)."""
    patterns = config.get("alpha_pattern") or {}
    alphas = [config.get("lora_alpha", 8), *(patterns.values() if isinstance(patterns, dict) else [])]
    if not isinstance(patterns, dict) or not all(_is_number(alpha) for alpha in alphas):
        raise AdapterError(f"{file}: lora_alpha must be a number, and alpha_pattern an object of numbers")
    for pattern in patterns:
        try:
            re.compile(_alpha_regex(pattern))
        except re.error as exc:
            raise AdapterError(f"{file}: alpha_pattern {pattern!r} is not a regular expression ({exc})") from None


def _is_number(value: object) -> bool:
    return type(value) in (int, float) and abs(value) < 1e9  # not NaN, infinite, or too large for a float


def _alpha_regex(pattern: str) -> str:
    """An alpha_pattern key as a regex of full module names (peft's matching)."""
    return rf"(.*\.)?({pattern})$"


def _alpha(config: dict, name: str) -> float:
    """lora_alpha for module ``name`` (its full dotted name), alpha_pattern's override first."""
    for pattern, alpha in (config.get("alpha_pattern") or {}).items():
        if re.match(_alpha_regex(pattern), name):
            return float(alpha)
    return float(config.get("lora_alpha", 8))


def read_adapter(path: str | Path, spec: ModelSpec, max_rank: int) -> AdapterInfo:
    """Check the adapter at ``path`` against the base model ``spec``; raise AdapterError naming
    the problem (missing files, unsupported modules, shapes of another model, rank over ``max_rank``),
    AdapterMissing when there is no adapter to read at ``path``."""
    directory = Path(path)
    if not directory.is_dir():
        raise AdapterMissing(f"no adapter directory at {path}; give the directory peft's save_pretrained wrote")
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
