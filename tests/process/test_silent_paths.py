"""Each path that once lost a request without a word now fails it loudly: a step that
raises, an I/O thread that dies, an exception in the API server's reader or in a stream."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from hybridlb.api.engine_client import EngineConnection, EngineUnavailable
from hybridlb.config import EngineConfig
from hybridlb.engine.client import EngineClient
from hybridlb.engine.spawn import start_engine, stop_engines, wait_until_ready
from hybridlb.params import SamplingParams

LONG = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


def _simulated(model: str, step_ms: float = 2) -> EngineConfig:
    return EngineConfig(model=model, max_model_len=256, num_kv_blocks=64, simulate={"step_ms": step_ms})


@pytest.fixture(scope="module")
def engine(tiny_qwen3, tmp_path_factory):
    address = f"ipc://{tmp_path_factory.mktemp('ipc')}/engine-0"
    process = start_engine(_simulated(tiny_qwen3, step_ms=20), rank=0, address=address, torch_threads=1)
    try:
        wait_until_ready([process], timeout_s=60)
        yield process
    finally:
        stop_engines([process])


def test_an_exception_in_the_reader_fails_requests_and_reconnects(engine):
    """A stats callback that raises (a metrics bug): the request in flight fails with a reason,
    the engine stops it, and the connection serves the next request."""
    async def main():
        context = zmq.asyncio.Context()
        calls = []

        def on_stats(stats):
            calls.append(stats)
            if len(calls) == 2:
                raise ValueError("a metrics callback bug")

        connection = EngineConnection(0, engine.address, "reader-test", context, on_stats=on_stats)
        connection.start()
        try:
            await connection.wait_ready(30)
            queue = connection.add("first", [1, 2, 3], LONG)
            while True:
                item = await asyncio.wait_for(queue.get(), 10)
                if isinstance(item, EngineUnavailable):
                    break
                assert item.finish_reason is None, "the long request cannot have finished"
            assert item.reason == "reader_error"
            await connection.wait_ready(10)  # registered again
            queue = connection.add("second", [1, 2, 3], SHORT)
            tokens = []
            while not (output := await asyncio.wait_for(queue.get(), 10)).finish_reason:
                tokens += output.new_token_ids
            return tokens + output.new_token_ids, connection.stats
        finally:
            await connection.close()
            context.destroy(linger=0)

    tokens, _ = asyncio.run(main())
    assert tokens == [1, 2, 3]
    client = EngineClient(engine.address)
    client.hello(10)
    while (batch := client.recv(5)) is not None and batch.stats is None:
        pass
    client.close()
    assert batch.stats.num_running == 0  # 200 tokens take 4 s: the failed request was aborted
