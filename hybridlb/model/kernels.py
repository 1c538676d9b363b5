"""The C kernels of ``csrc/`` (kernels.c, attention.c, lora.c, int8.c, int4.c, bf16.c, program.c): built once per
machine with the system's C compiler, loaded with ctypes, called on torch tensors' memory.

A CPU decoder layer in eager torch is ~60 small ops whose fixed cost (~5-10 µs each)
dominates a decode step; these kernels fuse the small work between the matmuls into
four calls per layer. The shared library is cached under ``$XDG_CACHE_HOME/hybridlb``
(``~/.cache/hybridlb``), keyed by the source, the compiler and the CPU's features, and
written atomically; engines starting together build it once (a file lock), the units
compiled in parallel. Without a compiler the
engine runs the same model on torch ops alone (``available()`` says which, and why).
Set ``HYBRIDLB_CPU_KERNELS=0`` to force the torch path when debugging.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from hybridlb.cpu_features import cpu_flags

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "csrc"
# -fopenmp: the kernels split large calls over threads with OpenMP. The library's DT_NEEDED
# libgomp.so.1 resolves, at load, to the copy torch already loaded (the dynamic loader matches
# loaded sonames), so both share one pool: no second set of threads contending for the cores.
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-fopenmp"]
# kernels.c rounds exactly as torch does, so no fused multiply-adds there; attention.c may. Its
# row loops in 16 lanes where the CPU has AVX-512 (GCC's default is 8 on Intel; SiLU-and-mul at
# 64 rows: 65 -> 48 us on a 2-core Xeon).
UNITS = {"kernels.c": ["-ffp-contract=off", "-mprefer-vector-width=512"], "attention.c": ["-ffp-contract=fast"],
         "lora.c": ["-ffp-contract=fast"], "int8.c": ["-ffp-contract=fast"], "bf16.c": ["-ffp-contract=fast"],
         "int4.c": ["-ffp-contract=fast"], "program.c": []}
SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
SIGNATURES = {
    "rms_norm": [_P, _I, _P, _P, _P, _I, _I, _F, _I],
    "rope_store": [_P, _I, _P, _I, _P, _I, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I],
    "paged_attention": [_P, _I, _P, _P, _P, _I, _P, _P, _P, _I, _I, _I, _I, _I, _F, _I],
    "silu_mul": [_P, _P, _I, _I, _I],
    "lora_add": [_P, _I, _P, _I, _I, _I, _P, _P, _P, _I, _P, _P, _I, _I, _I],
    "int8_matmul": [_P, _I, _P, _P, _P, _P, _P, _I, _I, _I, _I],
}
PANEL = 16  # bf16.c, int8.c and int4.c's PANEL: output columns per panel (output sizes are multiples of it)
BF16_ONLY = {"bf16_pack": [_P, _P, _I, _I, _I], "bf16_matmul": [_P, _I, _P, _P, _P, _I, _I, _I, _I, _I],
             "int4_matmul": [_P, _I, _P, _P, _P, _I, _I, _I, _I]}
INT4_GROUP = 32  # int4.c's GROUP: inputs per scale and low (input sizes are multiples of this)
AMX_MIN_ROWS = 4  # bf16.c's and int8.c's matmuls on AMX tiles from this many rows up (where the CPU has AMX)
# int4.c's from this many: below it its vpdpbusd path is faster than turning the codes into bfloat16
# for the tiles on every call (SmolLM2's 120 projections on the Xeon, two threads, less the calls'
# Python cost: 6 rows 5.2-6.2 ms against 7.5-9.0, 8 rows 7.7 against 8.5, 12 rows 10.6 against 9.1)
INT4_AMX_MIN_ROWS = 10


class CPUKernels:
    """Typed entry points; each takes torch CPU tensors of one supported dtype. Large calls
    are split over torch's thread count (``torch.get_num_threads()``)."""

    def __init__(self, library: ctypes.CDLL):
        self._fns = {}
        for name, argtypes in SIGNATURES.items():
            for dtype, suffix in SUFFIXES.items():
                fn = getattr(library, f"{name}_{suffix}")
                fn.argtypes, fn.restype = argtypes, None
                self._fns[name, dtype] = fn
        for name, argtypes in BF16_ONLY.items():
            fn = getattr(library, name)
            fn.argtypes, fn.restype = argtypes, None
            self._fns[name, torch.bfloat16] = fn
        library.bf16_matmul_supported.restype = ctypes.c_int64
        library.int8_matmul_supported.restype = ctypes.c_int64
        library.int4_matmul_supported.restype = ctypes.c_int64
        library.bf16_amx_enable.argtypes, library.bf16_amx_enable.restype = [ctypes.c_int64], ctypes.c_int64
        library.int4_amx_min_rows.argtypes, library.int4_amx_min_rows.restype = [ctypes.c_int64], None
        # program.c: a recorded decode step replayed (model/decode_program.py); returns -1, or the index
        # of an operation it does not know.
        self.program_run = library.program_run
        self.program_run.argtypes, self.program_run.restype = [_P, _I, _I, _P, _I], ctypes.c_int64
        # int8.c's matmul with a scale per 32 inputs (GGUF Q8_0), float32 only.
        self._int8_group_matmul = library.int8_group_matmul
        self._int8_group_matmul.argtypes, self._int8_group_matmul.restype = [_P, _I, _P, _P, _P, _I, _I, _I, _I], None
        self._library = library
        # bf16.c's matmul needs AVX-512 BF16 (vdpbf16ps); without it the linear layers stay on oneDNN.
        self.bf16_matmul_supported = bool(library.bf16_matmul_supported())
        # int8.c's needs AVX-512 VNNI (vpdpbusd); without it int8 layers run on torch's int8 kernel.
        self.int8_matmul_supported = bool(library.int8_matmul_supported())
        # int4.c's needs AVX-512 BF16 and VNNI; without them 4-bit layers run on torch's kernel.
        self.int4_matmul_supported = bool(library.int4_matmul_supported())
        # With AMX, the matmuls run on tiles from AMX_MIN_ROWS rows up (int4.c's from INT4_AMX_MIN_ROWS;
        # see amx.h); ``tiles``: whether this CPU and Linux allow that (then torch's own kernels use AMX too).
        self.tiles = self.use_tiles(AMX_MIN_ROWS, INT4_AMX_MIN_ROWS)

    def use_tiles(self, min_rows: int, int4_min_rows: int | None = None) -> bool:
        """The matmuls on AMX tiles from ``min_rows`` rows up (0: never), int4.c's from
        ``int4_min_rows`` (default: the same), where the CPU has AMX and Linux grants it; whether
        tiles are in use. For the whole process."""
        self._library.int4_amx_min_rows(min_rows if int4_min_rows is None else int4_min_rows)
        return bool(self._library.bf16_amx_enable(min_rows))

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        """weight * norm(x); with ``residual``, first ``residual += x`` (in place) and normalise that."""
        out = torch.empty(x.shape, dtype=x.dtype)
        rows, hidden = x.numel() // x.shape[-1], x.shape[-1]
        self._fns["rms_norm", x.dtype](
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
        self._fns["rope_store", q.dtype](
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
        self._fns["paged_attention", q.dtype](
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
        self._fns["silu_mul", gate_up.dtype](gate_up.data_ptr(), out.data_ptr(), rows, inter, torch.get_num_threads())
        return out

    def lora_add(self, x: torch.Tensor, out: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 ranks: torch.Tensor, columns: torch.Tensor, stride: int) -> None:
        """out[t] += its slot's LoRA of x[t], in place (lora.c; the layout is LoRALinear's). ``slots``
        [rows] int64 (-1: none), ``ranks`` [slots, parts] and ``columns`` [parts, 2] int64;
        ``stride``: rows of A and B per part (LoRALinear.stride)."""
        self._fns["lora_add", x.dtype](
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
        self._fns["bf16_pack", torch.bfloat16](weight.data_ptr(), packed.data_ptr(), weight.shape[0],
                                               weight.shape[1], torch.get_num_threads())
        return packed

    def bf16_matmul(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int,
                    out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """x [m, k] bfloat16 (rows may be strided, elements contiguous) @ w^T + bias → [m, n], w [n, k]
        packed by ``bf16_pack``; in bfloat16, or with ``out_dtype`` float32 the sums unrounded. Only
        where ``bf16_matmul_supported``."""
        if out_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"bf16_matmul: out_dtype must be bfloat16 or float32, not {out_dtype}")
        out = torch.empty((x.shape[0], n), dtype=out_dtype)
        self._fns["bf16_matmul", torch.bfloat16](
            x.data_ptr(), x.stride(0), packed.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
            int(out_dtype == torch.float32), x.shape[0], n, x.shape[1], torch.get_num_threads(),
        )
        return out

    @staticmethod
    def int8_pack(codes: torch.Tensor) -> torch.Tensor:
        """int8 codes [n, k] in the layout ``int8_matmul`` reads (int8.c: panels of 16 output columns,
        4 inputs deep per line): [n / 16, k / 4, 16, 4], contiguous."""
        n, k = codes.shape
        return codes.reshape(n // PANEL, PANEL, k // 4, 4).permute(0, 2, 1, 3).contiguous()

    @staticmethod
    def int8_unpack(packed: torch.Tensor) -> torch.Tensor:
        """``int8_pack``'s inverse: the codes [n, k] row-major."""
        panels, quads, _, _ = packed.shape
        return packed.permute(0, 2, 1, 3).reshape(panels * PANEL, quads * 4)

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
        self._fns["int8_matmul", x.dtype](
            x.data_ptr(), x.stride(0), packed.data_ptr(), code_sums.data_ptr(), scale.data_ptr(),
            None if bias is None else bias.data_ptr(), out.data_ptr(), x.shape[0], n, k, torch.get_num_threads(),
        )
        return out

    @staticmethod
    def int8_group_scales_pack(scale: torch.Tensor) -> torch.Tensor:
        """Per-group scales [n, k / 32] as ``int8_group_matmul`` reads them: float16, [n / 16, k / 32, 16]."""
        n, groups = scale.shape
        return scale.to(torch.float16).reshape(n // PANEL, PANEL, groups).permute(0, 2, 1).contiguous()

    def int8_group_matmul(self, x: torch.Tensor, packed: torch.Tensor, group_scales: torch.Tensor) -> torch.Tensor:
        """x [m, k] float32 (rows may be strided, elements contiguous) @ W^T → [m, n] float32, W as int8 codes
        packed by ``int8_pack`` with a scale per group of 32 inputs of each output row
        (``int8_group_scales_pack``): GGUF's Q8_0, on int8.c. Only where ``int8_matmul_supported``."""
        n, k = packed.shape[0] * PANEL, packed.shape[1] * 4
        if x.dtype != torch.float32 or x.shape[-1] != k or x.stride(-1) != 1:
            raise ValueError(f"int8_group_matmul: x must be float32 [m, {k}] with contiguous rows, not {x.dtype} "
                             f"{tuple(x.shape)}")
        out = torch.empty((x.shape[0], n), dtype=torch.float32)
        self._int8_group_matmul(x.data_ptr(), x.stride(0), packed.data_ptr(), group_scales.data_ptr(), out.data_ptr(),
                                x.shape[0], n, k, torch.get_num_threads())
        return out

    @staticmethod
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

    @staticmethod
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

    def int4_matmul(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [m, k] bfloat16 (rows may be strided, elements contiguous) @ w^T + bias → [m, n] bfloat16,
        w as ``int4_pack`` packs it (int4.c); only where ``int4_matmul_supported``."""
        n, k = packed.shape[0] * PANEL, packed.shape[1] * INT4_GROUP
        if x.dtype != torch.bfloat16 or x.shape[-1] != k or x.stride(-1) != 1:
            raise ValueError(f"int4_matmul: x must be bfloat16 [m, {k}] with contiguous rows, not {x.dtype} "
                             f"{tuple(x.shape)}")
        out = torch.empty((x.shape[0], n), dtype=torch.bfloat16)
        self._fns["int4_matmul", torch.bfloat16](
            x.data_ptr(), x.stride(0), packed.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
            x.shape[0], n, k, torch.get_num_threads(),
        )
        return out


def bf16_fits(weight: torch.Tensor) -> bool:
    """Whether bf16.c's matmul takes this weight (given a CPU with AVX-512 BF16): a bfloat16 CPU
    matrix whose output size is a multiple of PANEL and input size even."""
    n, k = weight.shape
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and n % PANEL == 0 and k % 2 == 0


def int8_fits(codes: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether int8.c takes this weight (given a CPU with AVX-512 VNNI): on the CPU, input and output
    sizes multiples of PANEL, activations in a dtype the kernels have."""
    n, k = codes.shape
    return codes.device.type == "cpu" and dtype in SUFFIXES and k % PANEL == 0 and n % PANEL == 0


def fit(device: torch.device, dtype: torch.dtype, group: int, head_dim: int, block_size: int) -> bool:
    """Whether the kernels cover this model and cache (they are CPU-only; the attention kernel
    wants at most 16 query heads per kv head, a head size that is a multiple of 16 up to
    256, and KV blocks of a multiple of 16 tokens)."""
    return (device.type == "cpu" and dtype in SUFFIXES and group <= 16 and head_dim % 16 == 0
            and head_dim <= 256 and block_size % 16 == 0)


@functools.cache
def load() -> CPUKernels | None:
    """The kernels, built if needed; None (logged once) where they cannot be."""
    if os.environ.get("HYBRIDLB_CPU_KERNELS", "1") == "0":
        return None
    try:
        return CPUKernels(ctypes.CDLL(str(_build())))
    except (OSError, subprocess.CalledProcessError, RuntimeError) as error:
        log.warning("CPU kernels unavailable (%s); the model runs on torch ops alone, slower", error)
        return None


def _build() -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler found (install gcc, or set CC)")
    sources = sorted(SOURCE_DIR.iterdir())
    key = hashlib.sha256()
    for part in [*(p.read_bytes() for p in sources), repr((FLAGS, UNITS)).encode(), _compiler_version(compiler),
                 _cpu_features(), platform.machine().encode()]:
        key.update(part)
    target = _cache_dir() / f"kernels-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Engines starting together on a fresh machine: the first builds, the others wait for it
    # (each would otherwise spend ~30 s of CPU on the same build while the first one runs).
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists():
            _compile(compiler, target)
    return target


def _compile(compiler: str, target: Path) -> None:
    """Every unit at once (the build is as long as attention.c's), then link; renamed into place."""
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        objects = {unit: str(Path(scratch) / f"{unit}.o") for unit in UNITS}
        jobs = {unit: subprocess.Popen([compiler, *FLAGS, *flags, "-c", str(SOURCE_DIR / unit), "-o", objects[unit]],
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for unit, flags in UNITS.items()}
        errors = {unit: job.communicate()[1] for unit, job in jobs.items()}
        failed = [unit for unit, job in jobs.items() if job.returncode]
        if failed:
            raise RuntimeError(f"compiling {failed[0]} ({SOURCE_DIR}) failed: {errors[failed[0]].strip()[:500]}")
        built = Path(scratch) / target.name
        _run([compiler, "-shared", "-fopenmp", *objects.values(), "-o", str(built), "-lm"], "linking the kernels")
        os.replace(built, target)


def _run(command: list[str], what: str) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{what} ({SOURCE_DIR}) failed: {result.stderr.strip()[:500]}")


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hybridlb"


def _compiler_version(compiler: str) -> bytes:
    return subprocess.run([compiler, "--version"], capture_output=True).stdout


def _cpu_features() -> bytes:
    """The flags -march=native compiles for; a cache shared between machines must not mix them."""
    return " ".join(sorted(cpu_flags())).encode() or platform.processor().encode()
