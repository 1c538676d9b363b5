"""kill -9 under MoE expert parallelism, mid-stream: one rank's death breaks the group.

Every client must end (a complete response or an error) within 10 s; a dead part shows
as 503 on /health (a MoE group cannot serve with a rank or its coordinator missing);
the restart policy brings the coordinator back and hands a broken group to the node's
supervisor (the node exits 1).
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from hybridlb.testing.servers import start_servers
from tests.cluster.dp.test_clusters import burst
from tests.cluster.moe.test_expert_parallel import ep_server
from tests.process.faults.streams import Streams
from tests.process.faults.test_dense import KILL_DEADLINE_S, _health, _wait_for


@pytest.fixture(scope="module")
def moe(checkpoints) -> str:
    return checkpoints("qwen3_moe")


def test_engine_death_fails_every_stream_fast(moe):
    (server,) = start_servers(ep_server(moe, 2))
    try:
        streams = Streams([server.url], moe, 4)
        streams.wait_streaming()
        killed_at = time.monotonic()
        os.kill(server.children()["hybridlb:engine:1"], signal.SIGKILL)
        outcomes = streams.join(60)
        assert max(o.ended_at for o in outcomes) - killed_at < KILL_DEADLINE_S
        assert [o.kind for o in outcomes] == ["error"] * 4
        _, body = _wait_for(lambda: (h := _health(server))[0] == 503 and h, 10, "/health turning 503")
        assert "no engine" in body["error"]["message"]
        response = httpx.post(f"{server.url}/v1/completions", json={"model": moe, "prompt": "x", "max_tokens": 2})
        assert response.status_code == 503 and response.json()["error"]["type"] == "service_unavailable_error"
        assert server.process.poll() is None  # restart policy none: it stays up and says why
    finally:
        server.stop()


def test_coordinator_death_without_restart_is_an_outage(moe):
    (server,) = start_servers(ep_server(moe, 2))
    try:
        streams = Streams([server.url], moe, 4)
        streams.wait_streaming()
        os.kill(server.children()["hybridlb:coordinator"], signal.SIGKILL)
        streams.join(60)  # the running wave needs no coordinator: these finish (or fail) on their own
        _, body = _wait_for(lambda: (h := _health(server))[0] == 503 and h, 10, "/health turning 503")
        assert "coordinator" in body["error"]["message"]
        started = time.monotonic()
        response = httpx.post(f"{server.url}/v1/completions", json={"model": moe, "prompt": "x", "max_tokens": 2})
        assert response.status_code == 503 and time.monotonic() - started < 2
    finally:
        server.stop()


def test_restart_policy_restarts_the_coordinator_and_hands_a_broken_group_on(moe):
    (server,) = start_servers(ep_server(moe, 2, "--restart-policy", "restart"))
    try:
        streams = Streams([server.url], moe, 4)
        streams.wait_streaming()
        old = server.children()["hybridlb:coordinator"]
        os.kill(old, signal.SIGKILL)
        outcomes = streams.join(60)
        assert all(o.kind == "complete" for o in outcomes), [o.detail for o in outcomes]
        _wait_for(lambda: server.children().get("hybridlb:coordinator") not in (None, old), 30, "a new coordinator")
        _wait_for(lambda: _health(server)[0] == 200, 30, "/health back to 200")
        assert burst([server.url], moe, 12) == [200] * 12  # waves start again

        streams = Streams([server.url], moe, 4)
        streams.wait_streaming()
        killed_at = time.monotonic()
        os.kill(server.children()["hybridlb:engine:0"], signal.SIGKILL)
        outcomes = streams.join(60)
        assert max(o.ended_at for o in outcomes) - killed_at < KILL_DEADLINE_S
        assert all(o.kind == "error" for o in outcomes)
        assert server.process.wait(KILL_DEADLINE_S) == 1
        assert "broke the expert-parallel group" in server.output
    finally:
        server.stop()
