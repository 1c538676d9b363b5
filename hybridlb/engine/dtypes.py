"""Which dtype an engine computes in: ``engine.dtype``, with ``auto`` resolved per machine.

Torch-free, so simulated engines size their KV cache exactly as real ones would.
"""

from __future__ import annotations

from hybridlb.config import EngineConfig
from hybridlb.cpu_features import has_native_bfloat16

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def engine_dtype(config: EngineConfig) -> str:
    """``auto``: bfloat16 on CUDA and on CPUs with native bfloat16 (as vLLM does), else float32."""
    if config.dtype != "auto":
        return config.dtype
    return "bfloat16" if config.device == "cuda" or has_native_bfloat16() else "float32"
