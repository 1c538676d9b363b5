"""Weights kept quantized in memory: the linear layers run on int8 or 4-bit weights through
the engine's int8 kernel or torch's CPU weight-only kernels, never holding a dequantized copy.

* ``Int8Linear``: one int8 code per weight, one scale per output row (symmetric), on the engine's
  own kernel at every batch (``kernels/csrc/int8.c``: the codes in panels streamed once, multiplied as
  integers, AVX-512 VNNI); on CPUs without VNNI on ``torch._weight_int8pack_mm``.
* ``Int4Linear``: a 4-bit code per weight and, per block of ``GROUP`` (32) weights of a row, a scale
  and a low value: ``w = scale * code + low``, multiplied with bfloat16 activations (in float32 engines
  too) on the engine's own kernel (``kernels/csrc/int4.c``: codes in panels, scale and low in float16, AVX-512
  BF16), elsewhere on torch's ``_weight_int4pack_mm_for_cpu`` (``w = scale * (code - 8) + zero``).
  GGUF's Q4_0 / Q4_1 blocks are exactly this grid (32 values, an affine 4-bit code, float16 scale and
  low), so their codes are kept as the file has them.
* ``Int8Embedding``: the token embedding as int8 rows with a scale each, dequantized per looked-up row.

* ``Int8GroupLinear``: the output layer as int8 codes with a scale per group of 32 inputs (Q8_0's grid:
  a GGUF file's own Q8_0 codes, else the weights rounded to it), float32 logits, on int8.c where the CPU
  has AVX-512 VNNI.

What is quantized (``loader.quantization_targets``): the attention's qkv and output projections, the
dense MLP's gate-up and down projections, the embedding, and the output layer where int8.c runs it and
the checkpoint does not hold it as plain floats in a GGUF file (``loader._int8_head``; a tied one then
shares its codes with the embedding; bfloat16 engines also hold the codes' values packed for steps of
many rows). Otherwise the output layer stays in the engine's dtype (a tied one gets its own copy, which
bfloat16 engines hold packed): on a 2-core AMD EPYC its 49,152 x 576 bfloat16 matmul took 1.8 ms at
batch 1 and 4.6 ms at batch 16 against torch's int8 kernel's 2.7 and 13.9 ms. Norms, the MoE router and
MoE experts stay in the engine's dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridlb import kernels

GROUP = 32
PACK_ROWS = 16  # torch's 4-bit packing takes output sizes divisible by this (others are kept as int8)
METHODS = ("int8", "int4", "gguf")
INT8_MAX = 127
GROUP_ROWS_MAX = 6  # Int8GroupLinear: steps of up to this many rows on the group-scaled codes (see there)


def int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 codes [N, K] and float32 scales [N] of a float weight."""
    weight = weight.float()
    scale = weight.abs().amax(dim=1).clamp(min=1e-12) / INT8_MAX
    codes = torch.round(weight / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scale


def int4_groups(weight: torch.Tensor, grid: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4-bit codes [N, K] (int32, 0..15) and each group's float32 scale and low value [N, K / GROUP] of a
    float weight: ``w ≈ scale * code + low``. ``grid`` gives (scale, low) (GGUF Q4_0 / Q4_1 headers: the
    codes are then the file's, exactly); without it each group spans its own min..max."""
    rows, cols = weight.shape
    groups = weight.float().reshape(rows, cols // GROUP, GROUP)
    if grid is None:
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scale = ((high - low) / 15).clamp(min=1e-12)
    else:
        scale, low = grid
    codes = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    return codes.reshape(rows, cols), scale, low


class Int8Linear(nn.Module):
    """y = x @ (codes * scale)^T + bias, with codes int8 [out, in] and one scale per output row. On a
    CPU with AVX-512 VNNI the codes are held in int8.c's panel layout (``packed``) and every batch
    runs there; elsewhere row-major (``codes``) for torch's int8 kernel. One copy either way."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.register_buffer("scale", scale.to(dtype).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)
        found = kernels.load() if kernels.int8_fits(codes, dtype) else None
        self.kernels = found if found is not None and found.int8_matmul_supported else None
        if self.kernels is None:
            self.register_buffer("codes", codes.contiguous())
            return
        self.register_buffer("packed", self.kernels.int8_pack(codes))
        self.register_buffer("code_sums", codes.sum(dim=1, dtype=torch.int32), persistent=False)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> Int8Linear:
        return cls(*int8_rows(weight), bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(self.scale.dtype)
        if self.kernels is not None:
            if flat.stride(-1) != 1:
                flat = flat.contiguous()
            out = self.kernels.int8_matmul(flat, self.packed, self.code_sums, self.scale, self.bias)
            return out.reshape(*x.shape[:-1], self.out_features)
        out = torch._weight_int8pack_mm(flat, self.codes, self.scale)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def row_codes(self) -> torch.Tensor:
        """The codes [out, in], row-major (a view or a copy)."""
        return self.codes if self.kernels is None else self.kernels.int8_unpack(self.packed)

    def dense_weight(self) -> torch.Tensor:
        """The weight these codes stand for, in float32 (tests and tools)."""
        return self.row_codes().float() * self.scale.float()[:, None]


class Int4Linear(nn.Module):
    """y = x @ W^T + bias with W held as 4-bit codes in groups of GROUP along the input dimension. On a CPU
    with AVX-512 BF16 and VNNI the codes, scales and lows (float16) sit in int4.c's panel layout (``blocks``);
    otherwise in torch's 4-bit layout (``packed``) for its kernel.

    Both multiply bfloat16 activations, also in float32 engines (x is rounded to bfloat16 on the way in
    and the outputs come back in float32): the rounding (2^-9 relative) is far under the 4-bit weights' own
    step (1/15 of a group's range), and torch's float32 4-bit kernel is ~20x slower than its bfloat16 one
    (SmolLM2's 3,072 x 576 gate-up at batch 1 on a 2-core Xeon: 2.0 ms against 91 us; int4.c: 45 us),
    which made a float32 4-bit engine ~10x slower than the dense one it was to beat."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = codes.shape
        if self.in_features % GROUP or self.out_features % PACK_ROWS:
            raise ValueError(f"4-bit weights need an input size divisible by {GROUP} and an output size divisible "
                             f"by {PACK_ROWS}, got {self.out_features} x {self.in_features}")
        self.bias = None if bias is None else nn.Parameter(bias.to(torch.bfloat16), requires_grad=False)
        self.dtype = dtype
        found = kernels.load()
        self.kernels = found if found is not None and found.int4_matmul_supported else None
        if self.kernels is not None:
            self.register_buffer("blocks", self.kernels.int4_pack(codes, scale, low))
            return
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 2))
        # torch's convention, w = scale * (code - 8) + zero, so zero = low + 8 * scale; [K / GROUP, N, 2].
        zeros = low + 8 * scale
        self.register_buffer("scales_and_zeros", torch.stack((scale, zeros), dim=-1).transpose(0, 1)
                             .to(torch.bfloat16).contiguous())

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                    grid: tuple[torch.Tensor, torch.Tensor] | None = None) -> Int4Linear:
        return cls(*int4_groups(weight, grid), bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if self.kernels is not None:
            if flat.stride(-1) != 1:
                flat = flat.contiguous()
            out = self.kernels.int4_matmul(flat, self.blocks, self.bias)
        else:
            out = torch._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, self.scales_and_zeros)
            if self.bias is not None:
                out = out + self.bias
        return out.to(self.dtype).reshape(*x.shape[:-1], self.out_features)

    def dense_weight(self) -> torch.Tensor:
        """The weight these codes stand for, in float32: from the held codes, scales and lows (int4.c's
        layout), else via torch's kernel itself (an identity input)."""
        if self.kernels is not None:
            codes, scale, low = self.kernels.int4_unpack(self.blocks)
            return (codes.float().reshape(*scale.shape, GROUP) * scale[..., None] + low[..., None]).reshape(codes.shape)
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        return torch._weight_int4pack_mm_for_cpu(eye, self.packed, GROUP, self.scales_and_zeros).float().T


def int8_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes [N, K] and float32 scales [N, K / GROUP] (float16 values) of a float weight, per
    group of GROUP inputs of a row: GGUF Q8_0's grid, so a Q8_0 tensor's own codes and scales come back."""
    rows, cols = weight.shape
    groups = weight.float().reshape(rows, cols // GROUP, GROUP)
    scale = (groups.abs().amax(dim=-1) / INT8_MAX).to(torch.float16).float()
    steps = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(groups / steps[..., None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes.reshape(rows, cols), scale


class Int8GroupLinear(nn.Module):
    """A bias-free output layer as int8 codes with a scale per group of GROUP inputs of each row (Q8_0's grid,
    as llama.cpp runs it: a GGUF file's quantized layer, or one quantized at load) on int8.c for steps of up to
    ``GROUP_ROWS_MAX`` rows (``CPUKernels.int8_group_matmul``, CPUs with AVX-512 VNNI), float32 logits;
    in bfloat16 engines ``dense`` (the same values, packed for bf16.c) takes steps of more rows.

    At batch 1 the codes stream half the bytes (SmolLM2: 28 + 1.8 MiB of codes and scales against
    56 MiB of bfloat16): 0.67 ms against 1.18 on a 2-core Xeon. With more rows the per-group scaling
    (18 groups per row of 576) costs more than the bytes save, and the bfloat16 matmul runs on AMX
    tiles: at 16 rows 3.1 ms against 1.5. Float32 engines keep no dense copy (``dense`` None; 108 MiB
    on SmolLM2): their float32 matmul was slower than the codes at every size (2-core Xeon, 1 / 8 / 16 /
    64 rows: 3.0 / 10.9 / 9.9 / 18.7 ms against 0.57 / 1.46 / 2.71 / 10.8). Per-row scales
    (``Int8Linear``, which tiles take) would coarsen a Q8_0 row's grid ~1.8x on SmolLM2 (1.2 % weight
    error against bfloat16's 0.14 %) and move its greedy tokens. Only the loader builds it (``loader._int8_head``)."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, found: kernels.CPUKernels,
                 dense: nn.Linear | None):
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.kernels = found
        self.register_buffer("packed", found.int8_pack(codes))
        self.register_buffer("group_scales", found.int8_group_scales_pack(scale))
        # A row's words (4 codes) and group scales within its panel, for ``rows``.
        self.register_buffer("word_offsets", torch.arange(self.in_features // 4) * kernels.PANEL, persistent=False)
        self.register_buffer("scale_offsets", torch.arange(self.in_features // GROUP) * kernels.PANEL,
                             persistent=False)
        self.dense = dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Float32 logits of x [..., in_features] on the codes (``CausalLM.logits`` picks codes or ``dense``)."""
        flat = x.reshape(-1, self.in_features).float()
        out = self.kernels.int8_group_matmul(flat if flat.stride(-1) == 1 else flat.contiguous(), self.packed,
                                             self.group_scales)
        return out.reshape(*x.shape[:-1], self.out_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the weight, float32, from the codes. In the panels a row is 4-byte words 64 bytes
        apart, and its group scales 2-byte ones 32 bytes apart: each is one flat gather (indexing the panels
        as [panel, :, column] takes ~100 us a row)."""
        panel, column = (ids // kernels.PANEL)[..., None], (ids % kernels.PANEL)[..., None]
        words = self.packed.view(torch.int32).view(-1)  # 4 codes each
        codes = words[panel * self.word_offsets.numel() * kernels.PANEL + column + self.word_offsets]
        scales = self.group_scales.view(-1)
        scale = scales[panel * self.scale_offsets.numel() * kernels.PANEL + column + self.scale_offsets]
        return (codes.view(torch.int8).float().unflatten(-1, (-1, GROUP)) * scale.float()[..., None]).flatten(-2)

    def dense_weight(self) -> torch.Tensor:
        """The weight these codes stand for, in float32 (tests and tools)."""
        return self.rows(torch.arange(self.out_features))


class Int8Embedding(nn.Module):
    """Token embedding rows held as int8 with one scale per row (dequantized per looked-up row), or a tied
    ``Int8GroupLinear``'s rows (one copy of the codes serves both)."""

    def __init__(self, codes: torch.Tensor | None, scale: torch.Tensor | None, dtype: torch.dtype,
                 head: Int8GroupLinear | None = None):
        super().__init__()
        self.dtype = dtype
        self.head = [head]  # a list: the output layer is not this module's child
        if head is None:
            self.register_buffer("codes", codes.contiguous())
            self.register_buffer("scale", scale.to(dtype).contiguous())

    @classmethod
    def tied_to(cls, head: Int8GroupLinear, dtype: torch.dtype) -> Int8Embedding:
        return cls(None, None, dtype, head)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.head[0] is not None:
            return self.head[0].rows(ids).to(self.dtype)
        return self.codes[ids].to(self.scale.dtype) * self.scale[ids].unsqueeze(-1)


def quantized_linear(method: str, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                     gguf_type: str | None = None, grid=None) -> nn.Module:
    """The layer ``method`` keeps ``weight`` as. With ``gguf``, a 4-bit GGUF tensor stays 4-bit (its own
    codes where ``grid`` gives them, else regrouped from its values) and any other type becomes int8; so
    does a weight whose shape torch's 4-bit kernel cannot take (see GROUP, PACK_ROWS)."""
    from hybridlb.checkpoint.gguf import FOUR_BIT_TYPES

    four_bit = method == "int4" or (method == "gguf" and gguf_type in FOUR_BIT_TYPES)
    if four_bit and weight.shape[1] % GROUP == 0 and weight.shape[0] % PACK_ROWS == 0:
        return Int4Linear.from_weight(weight, bias, dtype, grid)
    return Int8Linear.from_weight(weight, bias, dtype)
