"""An engine whose steps are long is not taken for a stuck one: it publishes the longest step it
may take (``engine.step_clock``), and an API server waits a multiple of that before it calls
the engine stuck, however short ``api.engine_stall_s`` is."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hybridlb.api.dispatch.engine_client import STALL_STEPS, EngineConnection
from hybridlb.engine.step_clock import StepClock
from hybridlb.protocol import EngineStats


def test_the_longest_step_scales_the_slowest_large_step_to_a_full_budget():
    clock = StepClock(token_budget=8192)
    assert clock.longest_step_s() == 0.0
    for _ in range(10):
        clock.record(0.03, 1)  # decode steps say little about a full prefill
    assert clock.longest_step_s() == 0.03
    clock.record(1.0, 1024)  # a prefill chunk: ~1 ms a token, so 8,192 tokens ~8 s
    assert abs(clock.longest_step_s() - 8.0) < 1e-9


def test_an_api_server_waits_longer_for_an_engine_with_long_steps():
    def limit(stall_s: float, longest: float | None) -> float:
        stats = None if longest is None else EngineStats(0, 1, 0, 0.0, longest_step_s=longest)
        return EngineConnection.stall_limit_s.fget(SimpleNamespace(stall_s=stall_s, stats=stats))

    assert limit(10.0, None) == 10.0
    assert limit(10.0, 0.5) == 10.0
    assert limit(10.0, 8.0) == STALL_STEPS * 8.0 > 10.0


def test_an_engine_core_reports_its_longest_step(tiny_qwen3):
    from hybridlb.config import EngineConfig
    from hybridlb.engine.core import make_core
    from hybridlb.params import SamplingParams

    core = make_core(EngineConfig(model=tiny_qwen3, max_model_len=256, num_kv_blocks=64,
                                  simulate={"step_ms": 20}))
    core.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2))
    while core.has_work:
        core.step()
    assert 0.02 <= core.stats().longest_step_s < 1.0


def test_steps_are_counted_by_kind_and_every_position_once(tiny_qwen3):
    """A 40-token prompt in 16-token chunks (prefill), a second prompt joining its decodes (mixed),
    then decodes alone; each request computes its prompt and every output token but the last."""
    from hybridlb.config import EngineConfig
    from hybridlb.engine.core import make_core
    from hybridlb.params import SamplingParams

    core = make_core(EngineConfig(model=tiny_qwen3, max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=16,
                                  simulate={"step_ms": 1}))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    core.add_request("a", list(range(1, 41)), params)
    for _ in range(3):
        core.step()
    core.add_request("b", list(range(1, 11)), params)
    while core.has_work:
        core.step()
    stats = core.stats()
    assert stats.step_counts["prefill"] == 3 and stats.step_counts["mixed"] >= 1 and stats.step_counts["decode"] >= 1
    assert sum(stats.step_tokens.values()) == (40 + 3) + (10 + 3)
    assert set(stats.step_s) == set(stats.step_counts) and all(s > 0 for s in stats.step_s.values())


def test_the_loops_phases_add_up_to_its_wall_time():
    import time

    from hybridlb.engine.step_clock import LoopClock

    loop = LoopClock()
    for phase in ("idle", "take", "step", "publish", "step"):
        time.sleep(0.01)
        loop.lap(phase)
    stats = loop.stats()
    assert sum(stats["loop_s"].values()) == pytest.approx(stats["uptime_s"], abs=1e-3)
    assert stats["loop_s"]["step"] == pytest.approx(2 * stats["loop_s"]["take"], rel=0.5)
