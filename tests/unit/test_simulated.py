"""The simulated engine: behaves like EngineCore on the outside, never loads a model or torch."""

from __future__ import annotations

import time

import pytest

from hybridlb.config import ConfigError, EngineConfig, parse_config
from hybridlb.engine.core import SimulatedCore, make_core
from hybridlb.params import SamplingParams


def _core(model: str, step_ms: float = 1.0, **engine) -> SimulatedCore:
    config = EngineConfig(model=model, max_model_len=256, simulate={"step_ms": step_ms}, **engine)
    return make_core(config)


def _run(core: SimulatedCore) -> dict[str, tuple[list[int], str]]:
    """Step until idle; request id → (tokens, finish reason)."""
    tokens: dict[str, list[int]] = {}
    reasons = {}
    while core.has_work:
        for output in core.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finish_reason:
                reasons[output.request_id] = output.finish_reason
    return {rid: (tokens.get(rid, []), reason) for rid, reason in reasons.items()}


def test_tokens_echo_the_prompt_and_max_tokens_is_honoured(tiny_qwen3):
    core = _core(tiny_qwen3)
    assert isinstance(core, SimulatedCore)
    core.add_request("a", [5, 6, 7], SamplingParams(max_tokens=5))
    core.add_request("b", [9], SamplingParams(max_tokens=2, seed=4))  # a seed must not need torch
    assert _run(core) == {"a": ([5, 6, 7, 5, 6], "length"), "b": ([9, 9], "length")}


def test_eos_stops_unless_ignored(tiny_qwen3):
    core = _core(tiny_qwen3)
    eos = min(core.eos_token_ids)
    core.add_request("stops", [5, eos, 7], SamplingParams(max_tokens=10))
    core.add_request("goes_on", [5, eos, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    assert _run(core) == {"stops": ([5, eos], "stop"), "goes_on": ([5, eos, 7, 5], "length")}


def test_batches_up_to_max_num_seqs_and_steps_take_the_step_time(tiny_qwen3):
    core = _core(tiny_qwen3, step_ms=20, max_num_seqs=2, num_kv_blocks=64)
    for i in range(3):
        core.add_request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=3))
    started = time.perf_counter()
    first = core.step()
    assert time.perf_counter() - started >= 0.019
    assert len(first) == 2
    stats = core.stats()
    assert (stats.num_running, stats.num_waiting, stats.steps) == (2, 1, 1)
    assert stats.kv_usage > 0 and stats.busy_s >= 0.019


def test_abort_frees_kv_blocks_and_reports(tiny_qwen3):
    core = _core(tiny_qwen3, num_kv_blocks=64)
    core.add_request("a", list(range(1, 40)), SamplingParams(max_tokens=50))
    core.step()
    assert core.stats().kv_usage > 0
    (output,) = core.abort(["a", "unknown"])
    assert output.finish_reason == "abort"
    stats = core.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_usage) == (0, 0, 0.0)
    assert not core.has_work


def test_invalid_requests_get_errors_like_the_real_core(tiny_qwen3):
    core = _core(tiny_qwen3)
    assert core.add_request("a", [], SamplingParams()).finish_reason == "error"
    assert "max_model_len" in core.add_request("b", [1] * 300, SamplingParams()).error


def test_simulation_is_off_by_default_and_dense_only():
    assert EngineConfig(model="m").simulate is None
    with pytest.raises(ConfigError, match="simulate"):
        parse_config({"engine": {"model": "m", "simulate": {"step_ms": 1}, "expert_parallel": True}})
    with pytest.raises(ConfigError, match="step_ms"):
        parse_config({"engine": {"model": "m", "simulate": {"step_ms": 0}}})
