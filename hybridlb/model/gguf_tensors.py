"""GGUF weights by their Hugging Face names (the metadata side: ``hybridlb.checkpoint.gguf``).

Tensor names (``blk.3.attn_q.weight``) map to checkpoint names
(``model.layers.3.self_attn.q_proj.weight``); the row permutation llama.cpp's converter
applies to the q/k projections of llama models is undone on read.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from hybridlb.checkpoint.gguf import block_grids, dequantized, gguf_config, parsed, tensor_type
from hybridlb.checkpoint.path import CheckpointError

LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def checkpoint_names(path: Path) -> dict[str, str]:
    """Hugging Face tensor name → GGUF tensor name, for every tensor the file holds."""
    names = {}
    for name in parsed(path).tensors:
        if name in GLOBAL_TENSORS:
            names[GLOBAL_TENSORS[name]] = name
        elif match := re.fullmatch(r"blk\.(\d+)\.(.+)", name):
            layer, rest = match.groups()
            if rest in LAYER_TENSORS:
                names[f"model.layers.{layer}.{LAYER_TENSORS[rest]}"] = name
    return names


class GGUFTensorReader:
    """Reads tensors of a GGUF file by their Hugging Face names (see loader.TensorReader)."""

    def __init__(self, path: Path):
        self.path = path
        self.names = checkpoint_names(path)
        config = gguf_config(path)
        self.permute = config["model_type"] == "llama"
        self.heads, self.kv_heads = config["num_attention_heads"], config["num_key_value_heads"]

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def read(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        gguf_name = self.names.get(name)
        if gguf_name is None:
            raise CheckpointError(f"{self.path}: tensor {name} (GGUF {_gguf_name(name)}, shape {list(shape)}) "
                                  "is missing")
        array = dequantized(self.path, gguf_name)
        if tuple(array.shape) != shape:
            raise CheckpointError(f"{self.path}: tensor {gguf_name} has shape {list(array.shape)}, "
                                  f"expected {list(shape)}")
        tensor = torch.from_numpy(np.array(array))  # a copy: the file is mapped read-only
        if self.permute and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            tensor = _unpermute(tensor, self.heads if "attn_q" in gguf_name else self.kv_heads)
        return tensor


    def tensor_type(self, name: str) -> str | None:
        """The GGUF type the tensor is stored as (Q4_1, Q8_0, F32, ...); None if absent."""
        gguf_name = self.names.get(name)
        return None if gguf_name is None else tensor_type(self.path, gguf_name)

    def grid(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A Q4_0 / Q4_1 tensor's per-block (scale, low) [rows, cols / 32], rows in the order ``read``
        returns them; None for other types."""
        gguf_name = self.names.get(name)
        grids = None if gguf_name is None else block_grids(self.path, gguf_name)
        if grids is None:
            return None
        scale, low = (torch.from_numpy(part) for part in grids)
        if self.permute and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = self.heads if "attn_q" in gguf_name else self.kv_heads
            scale, low = _unpermute(scale, heads), _unpermute(low, heads)
        return scale, low


_HF_GLOBAL = {hf: name for name, hf in GLOBAL_TENSORS.items()}
_HF_LAYER = {hf: name for name, hf in LAYER_TENSORS.items()}


def _gguf_name(hf_name: str) -> str:
    """The GGUF name a checkpoint tensor would have (for error messages)."""
    if hf_name in _HF_GLOBAL:
        return _HF_GLOBAL[hf_name]
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_name)
    return f"blk.{match.group(1)}.{_HF_LAYER.get(match.group(2), '?')}" if match else "?"


def _unpermute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order (interleaved rotary pairs) back to rotate-half order."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, -1).transpose(1, 2).reshape(weight.shape)
