"""The size of an engine's KV cache: how many blocks it gets, and the check that they hold
one sequence. Torch-free, so a simulated engine sizes its cache exactly as a real one."""

from __future__ import annotations

from hybridlb.checkpoint.spec import ModelSpec
from hybridlb.config import EngineConfig, check_kv_cache_fits
from hybridlb.engine.dtypes import DTYPE_BYTES, engine_dtype


def bytes_per_block(config: EngineConfig, spec: ModelSpec) -> int:
    """Keys and values of ``block_size`` tokens in every layer, in the engine's dtype."""
    per_token = 2 * spec.num_kv_heads * spec.head_dim * DTYPE_BYTES[engine_dtype(config)]
    return per_token * config.block_size * spec.num_layers


def num_blocks(config: EngineConfig, spec: ModelSpec, max_model_len: int, budget_bytes: int | None = None) -> int:
    """``engine.num_kv_blocks``, else as many blocks as ``budget_bytes`` hold (default:
    ``kv_cache_gib``); ValueError if they cannot hold one sequence of ``max_model_len``."""
    if config.num_kv_blocks:
        blocks = config.num_kv_blocks
    else:
        budget = budget_bytes if budget_bytes is not None else int(config.kv_cache_gib * 2**30)
        blocks = max(1, budget // bytes_per_block(config, spec))
    check_kv_cache_fits(blocks, config.block_size, max_model_len)
    return blocks
