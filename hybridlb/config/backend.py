"""What an engine config cannot combine with its backend (``engine.backend``)."""

from __future__ import annotations

from typing import Any


def backend_problems(engine: Any) -> list[str]:
    """What ``engine`` (an EngineConfig) cannot take with its backend: the vLLM backend's limits
    (vLLM's own options go in vllm_args)."""
    if engine.backend != "vllm":
        return ["engine.vllm_args is for backend vllm; drop it or set engine.backend: vllm"] * bool(engine.vllm_args)
    found = []
    if engine.quantization not in (None, "none"):
        found.append(f"engine.quantization {engine.quantization} is hybridlb's own engine's; with backend vllm give "
                     "vLLM's method in vllm_args (quantization), or none for the checkpoint's own")
    for name in ("simulate", "kv_events", "num_kv_blocks"):
        if getattr(engine, name) is not None:
            found.append(f"engine.{name} is not supported with backend vllm; drop it")
    if engine.expert_parallel:
        found.append("engine.expert_parallel with backend vllm is not supported: hybridlb's lockstep waves do not "
                     "drive vLLM's dummy batches yet, and vLLM's CPU build cannot run expert parallelism at all "
                     "(vllm#57837); serve the MoE model with backend hybridlb, or each rank with all its experts")
    return found
