"""Each path that once lost a request without a word now fails it loudly: a step that
raises, an I/O thread that dies, an exception in the API server's reader or in a stream."""

# ruff: noqa: F811 - the fixtures imported from this file's unit-tier half are parameters here
from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from hybridlb.api.dispatch.engine_client import EngineConnection, EngineUnavailable
from hybridlb.engine.client import EngineClient
from tests.unit.test_silent_paths import LONG, SHORT, _simulated, engine  # noqa: F401 - fixtures: engine


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
