"""The kernels' entry points on torch tensors: each wrapper passes a tensor's memory, strides and
shape to its C function (bound and typed by bindings.py) and allocates what the call returns."""

from __future__ import annotations

import ctypes

import torch

from hybridlb.kernels import bindings, layouts
from hybridlb.kernels.bindings import INT4_GROUP, PANEL

AMX_MIN_ROWS = 4  # bf16.c's and int8.c's matmuls on AMX tiles from this many rows up (where the CPU has AMX)
# int4.c's from this many: below it its vpdpbusd path is faster than turning the codes into bfloat16
# for the tiles on every call (SmolLM2's 120 projections on the Xeon, two threads, less the calls'
# Python cost: 6 rows 5.2-6.2 ms against 7.5-9.0, 8 rows 7.7 against 8.5, 12 rows 10.6 against 9.1)
INT4_AMX_MIN_ROWS = 10


class CPUKernels:
    """Typed entry points; each takes torch CPU tensors of one supported dtype. Large calls
    are split over torch's thread count (``torch.get_num_threads()``)."""

    int8_pack = staticmethod(layouts.int8_pack)
    int8_unpack = staticmethod(layouts.int8_unpack)
    int8_group_scales_pack = staticmethod(layouts.int8_group_scales_pack)
    int4_pack = staticmethod(layouts.int4_pack)
    int4_unpack = staticmethod(layouts.int4_unpack)

    def __init__(self, library: ctypes.CDLL):
        self._fns = bindings.bind(library)
        # program.c: a recorded decode step replayed (model/decode_program.py); returns -1, or the index
        # of an operation it does not know.
        self.program_run = self._fns["program_run"]
        # bf16.c's matmul needs AVX-512 BF16 (vdpbf16ps); without it the linear layers stay on oneDNN.
        self.bf16_matmul_supported = bool(self._fns["bf16_matmul_supported"]())
        # int8.c's needs AVX-512 VNNI (vpdpbusd); without it int8 layers run on torch's int8 kernel.
        self.int8_matmul_supported = bool(self._fns["int8_matmul_supported"]())
        # int4.c's needs AVX-512 BF16 and VNNI; without them 4-bit layers run on torch's kernel.
        self.int4_matmul_supported = bool(self._fns["int4_matmul_supported"]())
        # With AMX, the matmuls run on tiles from AMX_MIN_ROWS rows up (int4.c's from INT4_AMX_MIN_ROWS;
        # see amx.h); ``tiles``: whether this CPU and Linux allow that (then torch's own kernels use AMX too).
        self.tiles = self.use_tiles(AMX_MIN_ROWS, INT4_AMX_MIN_ROWS)

    def _typed(self, name: str, dtype: torch.dtype):
        """The element-type variant of a kernel (``rms_norm`` and bfloat16: ``rms_norm_bf16``)."""
        return self._fns[f"{name}_{layouts.DTYPES[dtype]}"]

    def use_tiles(self, min_rows: int, int4_min_rows: int | None = None) -> bool:
        """The matmuls on AMX tiles from ``min_rows`` rows up (0: never), int4.c's from
        ``int4_min_rows`` (default: the same), where the CPU has AMX and Linux grants it; whether
        tiles are in use. For the whole process."""
        self._fns["int4_amx_min_rows"](min_rows if int4_min_rows is None else int4_min_rows)
        return bool(self._fns["bf16_amx_enable"](min_rows))

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        """weight * norm(x); with ``residual``, first ``residual += x`` (in place) and normalise that."""
        out = torch.empty(x.shape, dtype=x.dtype)
        rows, hidden = x.numel() // x.shape[-1], x.shape[-1]
        self._typed("rms_norm", x.dtype)(
            x.data_ptr(), x.stride(-2) if x.dim() > 1 else hidden, None if residual is None else residual.data_ptr(),
            weight.data_ptr(), out.data_ptr(), rows, hidden, eps, torch.get_num_threads(),
        )
        return out

    def rope_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Rotate q [N, heads, dim] and k [N, kv_heads, dim] in place, then store k and v at ``slots``
        of caches in the kernels' layout: keys [blocks, kv_heads, dim, block_size], values
        [blocks, kv_heads, block_size, dim]."""
        self._typed("rope_store", q.dtype)(
            q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
            positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
            k_cache.data_ptr(), v_cache.data_ptr(), q.shape[0], q.shape[1], k.shape[1], q.shape[2],
            v_cache.shape[2], torch.get_num_threads(),
        )

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_table: torch.Tensor, query_start: torch.Tensor, lengths: torch.Tensor,
                        scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of a step's query rows q [N, heads, dim] over caches in
        ``rope_store``'s layout (which already hold this step's keys and values). Sequence s
        owns rows [query_start[s], query_start[s + 1]), the last new tokens of its lengths[s]
        tokens; block_table [seqs, width] int32 lists its blocks. Writes those rows of ``out``
        (contiguous, q's shape; allocated if not given)."""
        out = torch.empty(q.shape, dtype=q.dtype) if out is None else out
        self._typed("paged_attention", q.dtype)(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_table.data_ptr(),
            block_table.shape[1], query_start.data_ptr(), lengths.data_ptr(), out.data_ptr(), lengths.shape[0],
            q.shape[1], v_cache.shape[1], q.shape[2], v_cache.shape[2], scale, torch.get_num_threads(),
        )
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up [N, 2 * inter] holding gate then up."""
        inter = gate_up.shape[-1] // 2
        out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype)
        rows = gate_up.numel() // gate_up.shape[-1]
        self._typed("silu_mul", gate_up.dtype)(gate_up.data_ptr(), out.data_ptr(), rows, inter,
                                               torch.get_num_threads())
        return out

    def lora_add(self, x: torch.Tensor, out: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 ranks: torch.Tensor, columns: torch.Tensor, stride: int) -> None:
        """out[t] += its slot's LoRA of x[t], in place (lora.c; the layout is LoRALinear's). ``slots``
        [rows] int64 (-1: none), ``ranks`` [slots, parts] and ``columns`` [parts, 2] int64;
        ``stride``: rows of A and B per part (LoRALinear.stride)."""
        self._typed("lora_add", x.dtype)(
            x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), x.shape[0], x.shape[1], slots.data_ptr(),
            a.data_ptr(), b.data_ptr(), b.shape[1], ranks.data_ptr(), columns.data_ptr(), columns.shape[0], stride,
            torch.get_num_threads(),
        )

    def bf16_pack(self, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """A bfloat16 weight [n, k] in the layout ``bf16_matmul`` reads (bf16.c: panels of 16 output
        columns, input pairs interleaved), as a flat tensor (``out``, [n * k] contiguous, if given);
        ``bf16_fits`` says which weights it takes."""
        weight = weight.contiguous()
        packed = torch.empty(weight.numel(), dtype=torch.bfloat16) if out is None else out
        if packed.shape != (weight.numel(),) or packed.dtype != torch.bfloat16 or not packed.is_contiguous():
            raise ValueError(f"bf16_pack: out must be a contiguous bfloat16 [{weight.numel()}] tensor")
        self._fns["bf16_pack"](weight.data_ptr(), packed.data_ptr(), weight.shape[0], weight.shape[1],
                               torch.get_num_threads())
        return packed

    def bf16_matmul(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int,
                    out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """x [m, k] bfloat16 (rows may be strided, elements contiguous) @ w^T + bias → [m, n], w [n, k]
        packed by ``bf16_pack``; in bfloat16, or with ``out_dtype`` float32 the sums unrounded. Only
        where ``bf16_matmul_supported``."""
        if out_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"bf16_matmul: out_dtype must be bfloat16 or float32, not {out_dtype}")
        out = torch.empty((x.shape[0], n), dtype=out_dtype)
        self._fns["bf16_matmul"](
            x.data_ptr(), x.stride(0), packed.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
            int(out_dtype == torch.float32), x.shape[0], n, x.shape[1], torch.get_num_threads(),
        )
        return out

    def int8_matmul(self, x: torch.Tensor, packed: torch.Tensor, code_sums: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
        """x [m, k] (rows may be strided, elements contiguous) @ (codes [n, k] int8 * scale [n])^T + bias,
        in x's dtype, the codes packed by ``int8_pack`` (int8.c; ``int8_fits`` says which shapes it takes,
        ``int8_matmul_supported`` whether this CPU runs it). ``code_sums`` [n] int32: each output column's
        sum of codes."""
        n, k = packed.shape[0] * PANEL, packed.shape[1] * 4
        if x.shape[-1] != k or x.stride(-1) != 1:
            raise ValueError(f"int8_matmul: x must be [m, {k}] with contiguous rows, not {tuple(x.shape)}")
        out = torch.empty((x.shape[0], n), dtype=x.dtype)
        self._typed("int8_matmul", x.dtype)(
            x.data_ptr(), x.stride(0), packed.data_ptr(), code_sums.data_ptr(), scale.data_ptr(),
            None if bias is None else bias.data_ptr(), out.data_ptr(), x.shape[0], n, k, torch.get_num_threads(),
        )
        return out

    def int8_group_matmul(self, x: torch.Tensor, packed: torch.Tensor, group_scales: torch.Tensor) -> torch.Tensor:
        """x [m, k] float32 (rows may be strided, elements contiguous) @ W^T → [m, n] float32, W as int8 codes
        packed by ``int8_pack`` with a scale per group of 32 inputs of each output row
        (``int8_group_scales_pack``): GGUF's Q8_0, on int8.c. Only where ``int8_matmul_supported``."""
        n, k = packed.shape[0] * PANEL, packed.shape[1] * 4
        if x.dtype != torch.float32 or x.shape[-1] != k or x.stride(-1) != 1:
            raise ValueError(f"int8_group_matmul: x must be float32 [m, {k}] with contiguous rows, not {x.dtype} "
                             f"{tuple(x.shape)}")
        out = torch.empty((x.shape[0], n), dtype=torch.float32)
        self._fns["int8_group_matmul"](x.data_ptr(), x.stride(0), packed.data_ptr(), group_scales.data_ptr(),
                                       out.data_ptr(), x.shape[0], n, k, torch.get_num_threads())
        return out

    def int4_matmul(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [m, k] bfloat16 (rows may be strided, elements contiguous) @ w^T + bias → [m, n] bfloat16,
        w as ``int4_pack`` packs it (int4.c); only where ``int4_matmul_supported``."""
        n, k = packed.shape[0] * PANEL, packed.shape[1] * INT4_GROUP
        if x.dtype != torch.bfloat16 or x.shape[-1] != k or x.stride(-1) != 1:
            raise ValueError(f"int4_matmul: x must be bfloat16 [m, {k}] with contiguous rows, not {x.dtype} "
                             f"{tuple(x.shape)}")
        out = torch.empty((x.shape[0], n), dtype=torch.bfloat16)
        self._fns["int4_matmul"](
            x.data_ptr(), x.stride(0), packed.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
            x.shape[0], n, k, torch.get_num_threads(),
        )
        return out
