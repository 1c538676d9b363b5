"""Load a checkpoint (Hugging Face safetensors, single or sharded, or a GGUF file) into CausalLM.

``checkpoint_layout`` says, for every parameter of our fused model, which checkpoint
tensors (by Hugging Face name) fill it and the shape each must have; the loader checks
every tensor against that before copying, so a bad checkpoint fails with the file,
tensor and shape named. Tensors of any stored dtype (float32, bfloat16, float16, or
GGUF types dequantized by ``gguf_tensors``) are converted to the engine's dtype on copy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from hybridlb import kernels
from hybridlb.checkpoint.path import CheckpointError, resolve
from hybridlb.checkpoint.spec import ModelSpec
from hybridlb.model.layers import ExpertDispatch, RotaryEmbedding
from hybridlb.model.quantized import Int8Embedding, Int8GroupLinear, int8_groups, int8_rows, quantized_linear
from hybridlb.model.transformer import CausalLM

DENSE_GGUF_TYPES = {None, "F32", "F16", "BF16"}  # None: a safetensors tensor


@dataclass(frozen=True)
class Source:
    """Checkpoint tensors that make one parameter: concatenated along dim 0 and, when
    ``stacked``, each group of ``per_item`` stacked along a new leading dim (experts)."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    stacked: bool = False
    per_item: int = 1


def _attention_sources(spec: ModelSpec, p: str) -> dict[str, Source]:
    h, d = spec.hidden_size, spec.head_dim
    q, kv = spec.num_heads * d, spec.num_kv_heads * d
    projections = (f"{p}.self_attn.q_proj", f"{p}.self_attn.k_proj", f"{p}.self_attn.v_proj")
    out = {
        "self_attn.qkv.weight": Source(tuple(f"{n}.weight" for n in projections), ((q, h), (kv, h), (kv, h))),
        "self_attn.o.weight": Source((f"{p}.self_attn.o_proj.weight",), ((h, q),)),
    }
    if spec.attention_bias:
        out["self_attn.qkv.bias"] = Source(tuple(f"{n}.bias" for n in projections), ((q,), (kv,), (kv,)))
    if spec.qk_norm:
        out["self_attn.q_norm.weight"] = Source((f"{p}.self_attn.q_norm.weight",), ((d,),))
        out["self_attn.k_norm.weight"] = Source((f"{p}.self_attn.k_norm.weight",), ((d,),))
    return out


def _mlp_sources(spec: ModelSpec, p: str, layer: int, experts: range) -> dict[str, Source]:
    h = spec.hidden_size
    if not spec.is_moe_layer(layer):
        i = spec.intermediate_size
        gate_up = (f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight")
        return {
            "mlp.gate_up.weight": Source(gate_up, ((i, h), (i, h))),
            "mlp.down.weight": Source((f"{p}.mlp.down_proj.weight",), ((h, i),)),
        }
    i = spec.moe_intermediate_size
    if spec.family == "mixtral":
        block, gate, up, down = f"{p}.block_sparse_moe", "w1", "w3", "w2"
    else:
        block, gate, up, down = f"{p}.mlp", "gate_proj", "up_proj", "down_proj"
    gate_up = tuple(
        f"{block}.experts.{e}.{proj}.weight" for e in experts for proj in (gate, up)
    )
    return {
        "mlp.router.weight": Source((f"{block}.gate.weight",), ((spec.num_experts, h),)),
        "mlp.w_gate_up": Source(gate_up, ((i, h),) * len(gate_up), stacked=True, per_item=2),
        "mlp.w_down": Source(
            tuple(f"{block}.experts.{e}.{down}.weight" for e in experts), ((h, i),) * len(experts), stacked=True
        ),
    }


def checkpoint_layout(spec: ModelSpec, experts: range | None = None) -> dict[str, Source]:
    """Parameter name of CausalLM → the checkpoint tensors it is built from."""
    experts = experts or range(spec.num_experts)
    h, v = spec.hidden_size, spec.vocab_size
    layout = {"embed.weight": Source(("model.embed_tokens.weight",), ((v, h),))}
    for layer in range(spec.num_layers):
        p = f"model.layers.{layer}"
        parts = {
            "input_norm.weight": Source((f"{p}.input_layernorm.weight",), ((h,),)),
            "post_attn_norm.weight": Source((f"{p}.post_attention_layernorm.weight",), ((h,),)),
            **_attention_sources(spec, p),
            **_mlp_sources(spec, p, layer, experts),
        }
        layout.update({f"layers.{layer}.{name}": source for name, source in parts.items()})
    layout["norm.weight"] = Source(("model.norm.weight",), ((h,),))
    if not spec.tie_word_embeddings:
        layout["lm_head.weight"] = Source(("lm_head.weight",), ((v, h),))
    return layout


def tensor_files(model_dir: Path) -> dict[str, Path]:
    """Name of every tensor in the checkpoint → the safetensors file holding it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        for file in sorted(set(weight_map.values())):
            if not (model_dir / file).is_file():
                raise CheckpointError(f"{index} lists shard {file}, which is missing from {model_dir}")
        return {name: model_dir / file for name, file in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir} has no *.safetensors weights (nor model.safetensors.index.json)")
    found = {}
    for file in files:
        with safe_open(file, framework="pt") as handle:
            found.update(dict.fromkeys(handle.keys(), file))
    return found


class SafetensorsReader:
    """Reads checkpoint tensors by name, checking presence and shape; keeps files open."""

    def __init__(self, model_dir: Path):
        self.model_dir = model_dir
        self.files = tensor_files(model_dir)
        self.handles: dict[Path, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def read(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        file = self.files.get(name)
        if file is None:
            hint = ""
            if name == "lm_head.weight":
                hint = ("; if the model ties its output layer to the embeddings, config.json needs "
                        '"tie_word_embeddings": true')
            raise CheckpointError(f"{self.model_dir}: tensor {name} (shape {list(shape)}) is missing{hint}")
        if file not in self.handles:
            self.handles[file] = safe_open(file, framework="pt")
        handle = self.handles[file]
        got = tuple(handle.get_slice(name).get_shape())
        if got != shape:
            raise CheckpointError(f"{file}: tensor {name} has shape {list(got)}, expected {list(shape)}")
        return handle.get_tensor(name)

    def tensor_type(self, name: str) -> None:
        """Safetensors tensors are plain floats (no GGUF type; see GGUFTensorReader)."""
        return None

    def grid(self, name: str) -> None:
        return None


def build(reader, source: Source) -> torch.Tensor:
    """The parameter ``source`` describes, from a reader's tensors (see Source)."""
    parts = [reader.read(n, s) for n, s in zip(source.names, source.shapes, strict=True)]
    if not source.stacked:
        return torch.cat(parts) if len(parts) > 1 else parts[0]
    items = [torch.cat(parts[i : i + source.per_item]) for i in range(0, len(parts), source.per_item)]
    return torch.stack(items)


def tensor_reader(model: str | Path):
    """A reader of the checkpoint's tensors by Hugging Face name: safetensors or GGUF."""
    checkpoint = resolve(model)
    if checkpoint.is_gguf:
        from hybridlb.model.gguf_tensors import GGUFTensorReader

        return GGUFTensorReader(checkpoint.path)
    return SafetensorsReader(checkpoint.path)


def _allocate(module: nn.Module, device: torch.device) -> None:
    """``module.to_empty(device=device)`` for a module built on the meta device, without its
    ``empty_like``: on meta tensors that runs torch's Python reference, which imports torch.fx's symbolic
    shapes and sympy (~35 MiB of every engine's memory)."""
    for owner in module.modules():
        for name, param in owner._parameters.items():
            if param is not None:
                owner._parameters[name] = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device),
                                                       requires_grad=param.requires_grad)
        for name, buffer in owner._buffers.items():
            if buffer is not None:
                owner._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype, device=device)


def load_model(model: str | Path, spec: ModelSpec, dtype: torch.dtype, device: torch.device,
               max_positions: int, experts: range | None = None, dispatch: ExpertDispatch | None = None,
               quantization: str | None = None) -> CausalLM:
    """Build CausalLM on ``device`` and fill every parameter from the checkpoint (``experts`` and
    ``dispatch``: see CausalLM). ``quantization`` (int8, int4, gguf): keep the projections and the
    embedding quantized (``hybridlb.model.quantized``); their dense weights are never written, so they
    never take memory."""
    with torch.device("meta"):
        lm = CausalLM(spec, max_positions, experts, dispatch).to(dtype)
    # Allocated, not written: a weight kept quantized is never touched, so it never takes memory.
    _allocate(lm, device)
    lm.tie_weights()  # each parameter got its own memory, which unties a tied lm_head
    for module in lm.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset()
    layout = checkpoint_layout(spec, experts)
    reader = tensor_reader(model)
    if quantization == "gguf" and isinstance(reader, SafetensorsReader):
        raise CheckpointError(f"quantization gguf keeps a .gguf file's weights quantized, but {model} is not a "
                              ".gguf file; use int8 or int4 to quantize it at load")
    targets = quantization_targets(lm) if quantization else {}
    kept_quantized = {f"{name}.weight" for name in targets} | ({"embed.weight"} if targets else set())
    int8_head = bool(targets) and _int8_head(reader, layout, lm.spec, quantization)
    if int8_head:
        kept_quantized.add("lm_head.weight")  # an untied one's (a tied one is embed.weight)
    with torch.no_grad():
        for name, param in lm.named_parameters():
            if name not in kept_quantized:
                param.copy_(build(reader, layout[name]))
        if targets:
            _quantize(lm, reader, layout, targets, quantization, dtype, int8_head)
    return lm.eval()


def quantization_targets(lm: CausalLM) -> dict[str, nn.Linear]:
    """The linear layers a quantized model keeps quantized, by name: attention and dense MLP projections."""
    return {name: module for name, module in lm.named_modules()
            if isinstance(module, nn.Linear) and name.endswith((".qkv", ".o", ".gate_up", ".down"))}


def _int8_head(reader, layout: dict[str, Source], spec: ModelSpec, method: str) -> bool:
    """Whether the output layer runs on int8 codes (``Int8GroupLinear``, float32 logits): where int8.c runs
    them, for a GGUF file that holds the layer quantized (Q8_0, Q6_K, ...: llama.cpp's own output matmul
    runs on those codes; an F16 / F32 one keeps the file's values) and for every checkpoint quantized at
    load (int8, int4: its floats rounded to Q8_0's grid, a step of max|w| / 127 per 32 weights; SmolLM2's
    greedy tokens against float32 were the same as with the dense layer). At batch 1 the codes halve the
    bytes the largest matrix of a small model streams (SmolLM2: 28 MiB of codes instead of 56 MiB of
    bfloat16). CPUs without AVX-512 VNNI keep the dense layer."""
    source = layout["embed.weight" if spec.tie_word_embeddings else "lm_head.weight"]
    if method == "gguf" and any(reader.tensor_type(name) in DENSE_GGUF_TYPES for name in source.names):
        return False
    found = kernels.load()
    return (found is not None and found.int8_matmul_supported and spec.vocab_size % kernels.PANEL == 0
            and spec.hidden_size % kernels.PANEL == 0)


def _quantize(lm: CausalLM, reader, layout: dict[str, Source], targets: dict[str, nn.Linear], method: str,
              dtype: torch.dtype, int8_head: bool) -> None:
    """Replace each target, the embedding and (``int8_head``) the output layer with its quantized form, one
    tensor at a time."""
    for name, linear in targets.items():
        source = layout[f"{name}.weight"]
        types = {reader.tensor_type(part) for part in source.names}
        grids = [reader.grid(part) for part in source.names]
        grid = None
        if all(g is not None for g in grids):
            grid = tuple(torch.cat([g[i] for g in grids]) for i in (0, 1))
        gguf_type = types.pop() if len(types) == 1 else None  # mixed types (Q4_K_M's Q6_K parts): int8
        parent, _, child = name.rpartition(".")
        layer = quantized_linear(method, build(reader, source), linear.bias, dtype, gguf_type, grid)
        setattr(lm.get_submodule(parent), child, layer)
    embedding = build(reader, layout["embed.weight"])
    if not int8_head:
        if lm.spec.tie_word_embeddings:  # the output layer keeps its own dense copy (see hybridlb.model.quantized)
            lm.lm_head.weight.copy_(embedding)
        lm.embed = Int8Embedding(*int8_rows(embedding), dtype)
        return
    weight = embedding if lm.spec.tie_word_embeddings else build(reader, layout["lm_head.weight"])
    head = Int8GroupLinear(*int8_groups(weight), kernels.load(), None)
    del weight
    if dtype == torch.bfloat16:  # beside the codes, for steps of many rows: their values, dense (Int8GroupLinear)
        lm.lm_head.weight.copy_(head.dense_weight())
        head.dense = lm.lm_head
    lm.lm_head = head
    # A tied embedding reads the output layer's codes (one copy; a Q8_0 file's own codes and scales).
    lm.embed = (Int8Embedding.tied_to(lm.lm_head, dtype) if lm.spec.tie_word_embeddings
                else Int8Embedding(*int8_rows(embedding), dtype))
