"""Which dtype an engine computes in: ``engine.dtype``, with ``auto`` resolved per machine.

Torch-free, so simulated engines size their KV cache exactly as real ones would.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from hybridlb.config import EngineConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@cache
def cpu_has_native_bfloat16() -> bool:
    """AMX or AVX512-BF16: bfloat16 matmuls run in hardware (elsewhere oneDNN emulates them,
    slower than float32)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def engine_dtype(config: EngineConfig) -> str:
    """``auto``: bfloat16 on CUDA and on CPUs with native bfloat16 (as vLLM does), else float32."""
    if config.dtype != "auto":
        return config.dtype
    return "bfloat16" if config.device == "cuda" or cpu_has_native_bfloat16() else "float32"
