"""What this machine's CPU can do, from /proc/cpuinfo (torch-free: the config and the API server use it)."""

from __future__ import annotations

from functools import cache
from pathlib import Path


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def has_native_bfloat16() -> bool:
    """AMX or AVX512-BF16: bfloat16 matmuls run in hardware (elsewhere oneDNN emulates them,
    slower than float32)."""
    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags())


def has_amx() -> bool:
    """AMX tiles for bfloat16 (Intel Sapphire Rapids and later): prompts prefill on them."""
    return "amx_bf16" in cpu_flags()


def has_onednn_bfloat16_packing() -> bool:
    """oneDNN packs bfloat16 linear weights (torch's ``mkldnn._reorder_linear_weight``) only with
    AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; elsewhere (an AVX2-only AMD EPYC) it raises."""
    flags = cpu_flags()
    return {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags
