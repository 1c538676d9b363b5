"""Each path that once lost a request without a word now fails it loudly: a step that
raises, an I/O thread that dies, an exception in the API server's reader or in a stream."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from hybridlb.api.openai.jobs import Job
from hybridlb.api.openai.responses import _merged, _sse
from hybridlb.config import EngineConfig
from hybridlb.engine.client import EngineClient
from hybridlb.engine.core import SickEngine, make_core
from hybridlb.engine.shell import EngineFailed, EngineShell
from hybridlb.engine.spawn import start_engine, stop_engines, wait_until_ready
from hybridlb.params import SamplingParams

LONG = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


def _simulated(model: str, step_ms: float = 2) -> EngineConfig:
    return EngineConfig(model=model, max_model_len=256, num_kv_blocks=64, simulate={"step_ms": step_ms})


def test_a_failing_step_fails_only_its_requests(tiny_qwen3):
    core = make_core(_simulated(tiny_qwen3))
    core.add_request("a", [1, 2, 3], LONG)
    core.add_request("b", [4, 5], LONG)
    run = core.runner.run
    core.runner.run = lambda chunks: 1 / 0
    failed = core.step()
    assert {(o.request_id, o.finish_reason, o.error_kind) for o in failed} == {("a", "error", "internal"),
                                                                             ("b", "error", "internal")}
    assert "ZeroDivisionError" in failed[0].error
    assert not core.has_work and core.blocks.usage == 0.0 and core.stats().step_failures == 1
    core.runner.run = run  # the engine serves on
    core.add_request("c", [1, 2, 3], SHORT)
    tokens = [t for _ in range(3) for o in core.step() for t in o.new_token_ids]
    assert tokens == [1, 2, 3]


def test_steps_that_keep_failing_make_the_engine_sick(tiny_qwen3):
    """A one-off failure fails its requests and the engine serves on; engine.max_failed_steps
    in a row raise SickEngine (the process exits: its requests move, restart_policy restarts
    it), without failing the last step's requests first."""
    config = _simulated(tiny_qwen3).model_copy(update={"max_failed_steps": 3})
    core = make_core(config)
    core.runner.run = lambda chunks: 1 / 0
    for i in range(2):
        core.add_request(f"r{i}", [1, 2, 3], LONG)
        assert [o.finish_reason for o in core.step()] == ["error"]
    core.add_request("last", [1, 2, 3], LONG)
    with pytest.raises(SickEngine, match="3 steps in a row failed"):
        core.step()
    assert "last" in core.requests  # not failed here: it moves with the engine's death


def test_an_engine_whose_io_thread_dies_stops(tiny_qwen3, tmp_path, monkeypatch):
    """Without its I/O thread an engine hears nothing: it must exit, not look alive."""
    address = f"ipc://{tmp_path}/engine"
    server = EngineShell(make_core(_simulated(tiny_qwen3)), address)

    def broken(frames):
        raise RuntimeError("a bug in decoding")

    monkeypatch.setattr(server.io, "_receive", broken)
    failure: list[BaseException] = []

    def serve():
        try:
            server.serve_forever()
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = EngineClient(address)
    client.send_hello()
    thread.join(10)
    client.close()
    assert not thread.is_alive() and isinstance(failure[0], EngineFailed)


@pytest.fixture(scope="module")
def engine(tiny_qwen3, tmp_path_factory):
    address = f"ipc://{tmp_path_factory.mktemp('ipc')}/engine-0"
    process = start_engine(_simulated(tiny_qwen3, step_ms=20), rank=0, address=address, torch_threads=1)
    try:
        wait_until_ready([process], timeout_s=60)
        yield process
    finally:
        stop_engines([process])


def test_an_exception_in_a_stream_ends_it_with_an_error_event():
    async def broken():
        raise KeyError("a decode corner")
        yield  # an async generator

    job = Job("text_completion", "cmpl-1", "m", [[1]], [SHORT], include_usage=False)

    async def main():
        return [event async for event in _sse(None, job, _merged(job, [broken()]))]

    events = asyncio.run(main())
    assert events[-1] == b"data: [DONE]\n\n"
    error = json.loads(events[0][6:])["error"]
    assert "KeyError" in error["message"] and error["type"] == "internal_error"


def test_a_background_loop_that_raises_is_logged_and_started_again(caplog):
    import asyncio

    from hybridlb.lifecycle import supervised

    runs = []

    async def flaky() -> None:
        runs.append(len(runs))
        if len(runs) < 3:
            raise RuntimeError(f"bug number {len(runs)}")

    asyncio.run(supervised("the test loop", flaky, retry_s=0.01))
    assert runs == [0, 1, 2]
    failures = [r for r in caplog.records if "the test loop failed" in r.getMessage()]
    assert len(failures) == 2 and failures[0].exc_info is not None
