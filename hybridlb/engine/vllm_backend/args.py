"""vLLM's engine arguments for one rank, and the cores its threads bind to."""

from __future__ import annotations

import dataclasses
import difflib
import os

from hybridlb.config import EngineConfig


def thread_binding(rank: int, threads: int) -> str:
    """The cores vLLM's OpenMP threads of ``rank`` bind to (VLLM_CPU_OMP_THREADS_BIND): the
    rank's own ``threads`` cores of the ones this process may use, ranks side by side (vLLM's own
    DP launcher binds every rank to every core: measured on 2 cores, DP=2 served less than DP=1)."""
    allowed = sorted(os.sched_getaffinity(0))
    threads = max(1, min(threads, len(allowed)))
    slot = rank % max(1, len(allowed) // threads)
    mine = allowed[slot * threads:(slot + 1) * threads]
    return ",".join(str(core) for core in mine)


def checked_binding(value: str) -> str:
    """A user's own VLLM_CPU_OMP_THREADS_BIND, refused before vLLM starts when it names a core this process
    may not use (vLLM would fail deep in its worker, or bind threads to cores another rank runs on).
    ``auto`` and ``nobind`` are vLLM's to interpret; a list is cores and ranges, ``|`` between TP ranks."""
    if value.strip() in ("auto", "nobind"):
        return value
    allowed = os.sched_getaffinity(0)
    named = set()
    try:
        for part in value.replace("|", ",").split(","):
            first, _, last = part.strip().partition("-")
            named.update(range(int(first), int(last or first) + 1))
    except ValueError:
        named = set()
    outside = sorted(named - allowed)
    if not named or outside:
        why = f"names cores {_ranges(outside)} " if outside else "is not a list of cores "
        raise ValueError(
            f"VLLM_CPU_OMP_THREADS_BIND={value!r} {why}(this process may use cores {_ranges(sorted(allowed))}); "
            "write cores and ranges such as 0-3,8 ('|' between tensor-parallel ranks), 'auto', 'nobind', or unset "
            "it: then hybridlb binds each rank of the node to cores of its own")
    return value


def _ranges(cores: list[int]) -> str:
    spans: list[list[int]] = []
    for core in cores:
        if spans and core == spans[-1][1] + 1:
            spans[-1][1] = core
        else:
            spans.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def engine_args(config: EngineConfig, path: str):
    """vLLM's EngineArgs for ``config`` (one rank: vLLM sees no data parallelism)."""
    from vllm.engine.arg_utils import EngineArgs

    extra = dict(config.vllm_args)
    kwargs = dict(
        model=path, dtype=config.dtype, seed=config.seed, max_num_seqs=config.max_num_seqs,
        enable_prefix_caching=config.prefix_caching, enforce_eager=config.enforce_eager,
        kv_cache_memory_bytes=int(config.kv_cache_gib * 2**30) if config.device == "cpu" else None,
        gpu_memory_utilization=config.gpu_memory_utilization or 0.9,
    )
    if config.max_model_len is not None:
        kwargs["max_model_len"] = config.max_model_len
    if config.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = config.max_num_batched_tokens  # unset: vLLM's default
    if config.device == "cuda" and config.block_size != 16:
        kwargs["block_size"] = config.block_size  # vLLM's CPU attention chooses its own block size
    if config.speculative is not None:
        spec = config.speculative
        kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": spec.num_speculative_tokens,
                                        "prompt_lookup_max": spec.prompt_lookup_max,
                                        "prompt_lookup_min": spec.prompt_lookup_min}
    if config.prefix_caching:  # the blocks vLLM evicts feed the API server's prefix index (_CacheEvents)
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    if config.lora is not None:
        kwargs.update(enable_lora=True, max_loras=config.lora.max_loras, max_lora_rank=config.lora.max_lora_rank,
                      max_cpu_loras=config.lora.max_cpu_loras)
    known = {field.name for field in dataclasses.fields(EngineArgs)}
    if unknown := sorted(set(extra) - known):
        close = {name: difflib.get_close_matches(name, sorted(known), n=1) for name in unknown}
        raise ValueError("not vLLM engine arguments (vllm_args, or flags handed to vLLM): " + ", ".join(
            f"{name} (did you mean {close[name][0]}?)" if close[name] else name for name in unknown))
    kwargs.update(extra)  # the user's vLLM flags win (--engine-backend vllm hands them over as given)
    return EngineArgs(**kwargs)
