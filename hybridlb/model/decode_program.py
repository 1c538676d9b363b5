"""A step's forward pass as one C call: the decode program.

Eagerly, a bfloat16 decoder layer on the C kernels is ~8 calls from Python (norms, projections,
RoPE and KV store, attention, SiLU-and-mul), each through ctypes with its output allocated by
torch: a fixed ~15 µs a call. On SmolLM2-135M at batch 1 that is ~4 ms of a ~10 ms step, as long as
streaming its 4-bit weights. The program records those calls once, every pointer fixed (buffers
of its own, as wide as the most rows a step may have), and ``kernels/csrc/program.c`` replays them for each
step whose every token attends on the kernel: decodes, speculative drafts and (where the CPU has no
AMX, or a chunk continues a cached context) prompt chunks of up to ``max_rows`` tokens in all. What
changes per step (the rows, their positions and KV slots, the attention's sequences) comes with
the call. It is the CPU's counterpart of a captured CUDA graph, and vLLM's
``--enforce-eager`` (``engine.enforce_eager``) turns it off likewise.

The kernels and their arguments are the eager forward's, so a replayed step's values are the
eager step's exactly. It covers dense bfloat16 models whose every layer runs on the kernels (the
projections on bf16.c, int4.c or int8.c), without LoRA adapters; ``unsupported`` says why a model
is not covered. Steps with a prompt on torch's flash attention, or more rows, run eagerly.
"""

from __future__ import annotations

import ctypes
import logging
import struct

import torch

from hybridlb.kernels import PROGRAM_OP_WORDS, CPUKernels, Op, ProgramStep
from hybridlb.model.attention import PagedTable
from hybridlb.model.layers import DenseMLP, PackedLinear
from hybridlb.model.quantized import Int4Linear, Int8Linear
from hybridlb.model.transformer import CausalLM

log = logging.getLogger(__name__)


def _float_bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


def unsupported(model: CausalLM, kernels: CPUKernels | None) -> str | None:
    """Why ``model`` cannot run as a decode program, or None where it can."""
    if kernels is None:
        return "the C kernels are not in use"
    if model.norm.weight.dtype != torch.bfloat16:
        return f"the model runs in {model.norm.weight.dtype}, the program in bfloat16"
    for i, layer in enumerate(model.layers):
        attention = layer.self_attn
        if not isinstance(layer.mlp, DenseMLP):
            return f"layer {i} is a mixture of experts"
        if attention.q_norm is not None:
            return f"layer {i} normalises q and k per head"
        if attention.attn.kernels is None or layer.input_norm.kernels is None:
            return f"layer {i} is not on the kernels"
        for name, linear in (("qkv", attention.qkv), ("o", attention.o), ("gate_up", layer.mlp.gate_up),
                             ("down", layer.mlp.down)):
            if _matmul(linear) is None:
                return f"layer {i}'s {name} projection is a {type(linear).__name__} not on the kernels"
    return None


def _matmul(linear: torch.nn.Module) -> tuple[int, int, list[int]] | None:
    """(kind, weight pointer, extra words) of a projection on the kernels, or None."""
    bias = 0 if getattr(linear, "bias", None) is None else linear.bias.data_ptr()
    if isinstance(linear, PackedLinear) and linear.kernels is not None:
        return Op.BF16, linear.packed.data_ptr(), [bias]
    if isinstance(linear, Int4Linear) and linear.kernels is not None:
        return Op.INT4, linear.blocks.data_ptr(), [bias]
    if isinstance(linear, Int8Linear) and linear.kernels is not None:
        return Op.INT8, linear.packed.data_ptr(), [bias, linear.code_sums.data_ptr(), linear.scale.data_ptr()]
    return None


class DecodeProgram:
    """The recorded forward of ``model`` for steps of up to ``max_rows`` tokens (see the module)."""

    def __init__(self, model: CausalLM, kernels: CPUKernels, max_rows: int):
        spec = model.spec
        self.model, self.max_rows = model, max_rows
        attention = model.layers[0].self_attn
        heads, kv_heads, dim = attention.heads, attention.kv_heads, attention.head_dim
        hidden, inter = spec.hidden_size, spec.intermediate_size
        qkv_width = (heads + 2 * kv_heads) * dim

        def buffer(width: int) -> torch.Tensor:
            return torch.zeros(max_rows, width, dtype=torch.bfloat16)

        self.residual, self.normed, self.qkv, self.attended = buffer(hidden), buffer(hidden), buffer(qkv_width), \
            buffer(heads * dim)
        self.projected, self.gate_up, self.activated, self.mlp_out, self.hidden = buffer(hidden), \
            buffer(2 * inter), buffer(inter), buffer(hidden), buffer(hidden)
        ops: list[list[int]] = []

        def norm(x: torch.Tensor, residual: torch.Tensor | None, module, out: torch.Tensor) -> None:
            ops.append([Op.NORM, x.data_ptr(), x.shape[1], 0 if residual is None else residual.data_ptr(),
                        module.weight.data_ptr(), out.data_ptr(), x.shape[1], _float_bits(module.eps)])

        def matmul(linear, x: torch.Tensor, out: torch.Tensor) -> None:
            kind, weight, extra = _matmul(linear)
            ops.append([kind, x.data_ptr(), x.shape[1], weight, extra[0], out.data_ptr(), linear.out_features,
                        linear.in_features, *extra[1:]])

        element = self.qkv.element_size()
        for i, layer in enumerate(model.layers):
            attn = layer.self_attn
            cache = attn.attn
            norm(self.residual if i == 0 else self.mlp_out, None if i == 0 else self.residual, layer.input_norm,
                 self.normed)
            matmul(attn.qkv, self.normed, self.qkv)
            q, k, v = (self.qkv.data_ptr() + element * offset for offset in (0, heads * dim, (heads + kv_heads) * dim))
            block_size = cache.v_cache.shape[2]
            ops.append([Op.ROPE, q, qkv_width, k, qkv_width, v, qkv_width, attn.rotary.cos.data_ptr(),
                        attn.rotary.sin.data_ptr(), cache.k_cache.data_ptr(), cache.v_cache.data_ptr(), heads,
                        kv_heads, dim, block_size])
            ops.append([Op.ATTENTION, q, qkv_width, cache.k_cache.data_ptr(), cache.v_cache.data_ptr(),
                        self.attended.data_ptr(), heads, kv_heads, dim, block_size, _float_bits(cache.scale)])
            matmul(attn.o, self.attended, self.projected)
            norm(self.projected, self.residual, layer.post_attn_norm, self.normed)
            matmul(layer.mlp.gate_up, self.normed, self.gate_up)
            ops.append([Op.SILU, self.gate_up.data_ptr(), self.activated.data_ptr(), inter])
            matmul(layer.mlp.down, self.activated, self.mlp_out)
        norm(self.mlp_out, self.residual, model.norm, self.hidden)
        self.ops = torch.tensor([op + [0] * (PROGRAM_OP_WORDS - len(op)) for op in ops], dtype=torch.int64)
        self.count = len(ops)
        self._run = kernels.program_run
        self.steps = self.rows = 0  # steps replayed, and their rows (tokens)

    @classmethod
    def build(cls, model: CausalLM, kernels: CPUKernels | None, max_rows: int) -> DecodeProgram | None:
        """The program, or None (logged) where the model is not covered (``unsupported``)."""
        reason = unsupported(model, kernels)
        if reason is not None:
            log.info("decode steps run eagerly: %s", reason)
            return None
        return cls(model, kernels, max_rows)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                table: PagedTable) -> torch.Tensor:
        """The final hidden states [rows, hidden] of a step whose rows all attend on the kernel, in one
        ``table`` from row 0: a view of the program's buffer, valid until its next step."""
        rows = input_ids.shape[0]
        if not 0 < rows <= self.max_rows or table.row != 0 or int(table.query_start[-1]) != rows:
            raise ValueError(f"a decode program step takes 1 to {self.max_rows} rows, all in one kernel table from "
                             f"row 0, not {rows} rows with a table of {int(table.query_start[-1])} at {table.row}")
        self.residual[:rows].copy_(self.model.embed(input_ids))
        step = ProgramStep(positions.data_ptr(), slots.data_ptr(), table.blocks.data_ptr(), table.blocks.shape[1],
                           table.query_start.data_ptr(), table.lengths.data_ptr(), table.lengths.shape[0])
        failed = self._run(self.ops.data_ptr(), self.count, rows, ctypes.addressof(step),
                           torch.get_num_threads())
        if failed >= 0:
            raise RuntimeError(f"decode program: operation {failed} has an unknown kind {int(self.ops[failed, 0])}")
        self.steps += 1
        self.rows += rows
        return self.hidden[:rows]
