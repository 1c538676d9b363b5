"""The weight layouts the matmul kernels read (bf16.c, int8.c, int4.c: panels of PANEL output
columns), built and undone in torch, and which models and weights the kernels take."""

from __future__ import annotations

import torch

from hybridlb.kernels.bindings import INT4_GROUP, PANEL

DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}  # the element types, as the kernels' name suffixes


def int8_pack(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes [n, k] in the layout ``int8_matmul`` reads (int8.c: panels of 16 output columns,
    4 inputs deep per line): [n / 16, k / 4, 16, 4], contiguous."""
    n, k = codes.shape
    return codes.reshape(n // PANEL, PANEL, k // 4, 4).permute(0, 2, 1, 3).contiguous()


def int8_unpack(packed: torch.Tensor) -> torch.Tensor:
    """``int8_pack``'s inverse: the codes [n, k] row-major."""
    panels, quads, _, _ = packed.shape
    return packed.permute(0, 2, 1, 3).reshape(panels * PANEL, quads * 4)


def int8_group_scales_pack(scale: torch.Tensor) -> torch.Tensor:
    """Per-group scales [n, k / 32] as ``int8_group_matmul`` reads them: float16, [n / 16, k / 32, 16]."""
    n, groups = scale.shape
    return scale.to(torch.float16).reshape(n // PANEL, PANEL, groups).permute(0, 2, 1).contiguous()


def int4_pack(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """4-bit codes [n, k] (0..15) with each group's scale and low [n, k / 32] (float16 values, or
    rounded to float16) in the layout ``int4_matmul`` reads (int4.c): per panel of 16 output columns
    and group of 32 inputs a 320-byte block, [n / 16, k / 32, 320] uint8."""
    n, k = codes.shape
    panels, groups = n // PANEL, k // INT4_GROUP
    # [panel, column, group, line, j, e] -> [panel, group, line, column, e, j]; input 32 g + 8 line + 2 j + e
    c = codes.to(torch.int32).reshape(panels, PANEL, groups, 4, 4, 2).permute(0, 2, 3, 1, 5, 4)
    words = (c[..., 0] | c[..., 1] << 4 | c[..., 2] << 8 | c[..., 3] << 12).to(torch.int16)
    words = words.contiguous().view(torch.uint8).reshape(panels, groups, 256)

    def per_block(values: torch.Tensor) -> torch.Tensor:  # [n, groups] -> [panel, group, 32 bytes]
        halves = values.to(torch.float16).reshape(panels, PANEL, groups).permute(0, 2, 1).contiguous()
        return halves.view(torch.uint8).reshape(panels, groups, 2 * PANEL)

    return torch.cat((words, per_block(scale), per_block(low)), dim=-1).contiguous()


def int4_unpack(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``int4_pack``'s inverse: codes [n, k] (int32), scale and low [n, k / 32] (float32)."""
    panels, groups, _ = packed.shape
    words = packed[..., :256].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    words = words.reshape(panels, groups, 4, PANEL, 2)
    c = torch.stack([(words >> (4 * j)) & 15 for j in range(4)], dim=-1)  # [p, g, line, column, e, j]
    codes = c.permute(0, 3, 1, 2, 5, 4).reshape(panels * PANEL, groups * INT4_GROUP)

    def per_row(part: torch.Tensor) -> torch.Tensor:
        halves = part.contiguous().view(torch.float16).reshape(panels, groups, PANEL)
        return halves.permute(0, 2, 1).reshape(panels * PANEL, groups).float()

    return codes, per_row(packed[..., 256:288]), per_row(packed[..., 288:])


def bf16_fits(weight: torch.Tensor) -> bool:
    """Whether bf16.c's matmul takes this weight (given a CPU with AVX-512 BF16): a bfloat16 CPU
    matrix whose output size is a multiple of PANEL and input size even."""
    n, k = weight.shape
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and n % PANEL == 0 and k % 2 == 0


def int8_fits(codes: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether int8.c takes this weight (given a CPU with AVX-512 VNNI): on the CPU, input and output
    sizes multiples of PANEL, activations in a dtype the kernels have."""
    n, k = codes.shape
    return codes.device.type == "cpu" and dtype in DTYPES and k % PANEL == 0 and n % PANEL == 0


def fit(device: torch.device, dtype: torch.dtype, group: int, head_dim: int, block_size: int) -> bool:
    """Whether the kernels cover this model and cache (they are CPU-only; the attention kernel
    wants at most 16 query heads per kv head, a head size that is a multiple of 16 up to
    256, and KV blocks of a multiple of 16 tokens)."""
    return (device.type == "cpu" and dtype in DTYPES and group <= 16 and head_dim % 16 == 0
            and head_dim <= 256 and block_size % 16 == 0)
