"""kill -9 of each part of a dense `hybridlb serve` node, mid-stream under load.

Every client must end (a complete response or an error) within 10 s of the kill, the
survivors must keep serving new requests with zero failures, and /health, /ranks and
`hybridlb status --url` must name what is down.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx

from hybridlb.testing.ports import free_port_range
from hybridlb.testing.servers import Server, start_servers
from tests.cluster.dp.test_clusters import _dp_flags, burst
from tests.process.faults.streams import Streams, kill_tree

KILL_DEADLINE_S = 10


def _wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"{what} did not happen within {timeout_s} s")


def _health(server: Server) -> tuple[int, dict]:
    response = httpx.get(f"{server.url}/health", timeout=10)
    return response.status_code, response.json()


def _status_cli(url: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridlb", "status", "--url", url], capture_output=True,
                          text=True, timeout=60)


def _dp2(model: str, *extra: str) -> Server:
    return Server(model, *_dp_flags(2, 2, 0, free_port_range(8)), *extra)


def test_engine_and_coordinator_deaths_without_restart(tiny_qwen3):
    (server,) = start_servers(_dp2(tiny_qwen3))
    try:
        children = server.children()
        # The coordinator first: dense ranks do not need it, so nobody notices but /health.
        streams = Streams([server.url], server.model, 8)
        streams.wait_streaming()
        os.kill(children["hybridlb:coordinator"], signal.SIGKILL)
        assert burst([server.url], server.model, 10) == [200] * 10
        assert [o.kind for o in streams.join(120)] == ["complete"] * 8
        code, body = _wait_for(lambda: (h := _health(server))[1].get("problems") and h, 10, "a degraded /health")
        assert code == 200 and body["status"] == "degraded" and "coordinator" in body["problems"][0]

        # Then an engine, mid-stream: its streams move to the other engine and finish there
        # (tests/process/faults/test_migration.py checks their text); with migration off they fail.
        streams = Streams([server.url], server.model, 8)
        streams.wait_streaming()
        os.kill(children["hybridlb:engine:0"], signal.SIGKILL)
        outcomes = streams.join(60)
        assert [o.kind for o in outcomes] == ["complete"] * 8, [o.detail for o in outcomes]
        assert all(o.finish_reason == "length" for o in outcomes)
        assert "moved, 0 lost" in server.output  # the API server's tally of what the death took off engine 0

        assert burst([server.url], server.model, 20) == [200] * 20  # the survivor serves them all
        code, body = _health(server)
        assert code == 200 and body["down_ranks"] == [0] and "engine 0 is down" in body["problems"]
        engines = {e["rank"]: e["alive"] for e in httpx.get(f"{server.url}/ranks").json()["engines"]}
        assert engines == {0: False, 1: True}
        status = _status_cli(server.url)
        assert status.returncode == 0 and "DOWN" in status.stdout and "engine 0 is down" in status.stdout
        assert server.process.poll() is None
    finally:
        server.stop()


def test_restart_policy_brings_every_part_back(tiny_qwen3):
    (server,) = start_servers(_dp2(tiny_qwen3, "--restart-policy", "restart"))
    try:
        # the fork server last: its engines (both) die with it and come back from a new one
        for title in ("hybridlb:engine:1", "hybridlb:coordinator", "hybridlb:api:0", "hybridlb:engine-forks"):
            streams = Streams([server.url], server.model, 4, max_tokens=200)
            streams.wait_streaming()
            old = server.children()[title]
            os.kill(old, signal.SIGKILL)
            streams.join(KILL_DEADLINE_S + 5)  # complete or error, none hangs
            new = _wait_for(lambda t=title: server.children().get(t), 30, f"{title} restarting")
            assert new != old
            _wait_for(lambda: _health(server) == (200, {"status": "ok", "problems": [], "down_ranks": []}), 60,
                      f"/health ok after {title} came back")
            assert burst([server.url], server.model, 10) == [200] * 10
        pinned = httpx.post(f"{server.url}/v1/completions", headers={"X-data-parallel-rank": "1"}, timeout=60,
                            json={"model": server.model, "prompt": "back", "max_tokens": 4})
        assert pinned.status_code == 200
        assert "restarting engine 1" in server.output and "restarting the coordinator" in server.output
        assert "restarting engine 0" in server.output  # with the fork server
    finally:
        assert server.stop() == 0


def test_api_server_death_without_restart_stops_the_node(tiny_qwen3):
    (server,) = start_servers(_dp2(tiny_qwen3))
    try:
        streams = Streams([server.url], server.model, 4)
        streams.wait_streaming()
        os.kill(server.children()["hybridlb:api:0"], signal.SIGKILL)
        outcomes = streams.join(KILL_DEADLINE_S)
        assert all(o.kind == "error" for o in outcomes)
        assert server.process.wait(KILL_DEADLINE_S) == 1
        assert "api:0 was killed by SIGKILL" in server.output
    finally:
        server.stop()


def _two_nodes(model: str) -> tuple[Server, Server]:
    """DP=4 as a head and a worker of two ranks each, both serving."""
    rpc = free_port_range(8)
    head, worker = Server(model, *_dp_flags(4, 2, 0, rpc)), Server(model, *_dp_flags(4, 2, 2, rpc))
    start_servers(head, worker)
    return head, worker


def test_whole_node_killed_the_other_keeps_serving(tiny_qwen3):
    head, worker = _two_nodes(tiny_qwen3)
    try:
        streams = Streams([head.url, worker.url], head.model, 8)
        streams.wait_streaming()
        killed_at = time.monotonic()
        kill_tree(worker.process.pid)
        outcomes = streams.join(60)
        assert max(o.ended_at for o in outcomes) - killed_at < KILL_DEADLINE_S
        assert all(o.kind == "complete" for o in outcomes if o.url == head.url)
        assert all(o.kind == "error" for o in outcomes if o.url == worker.url)
        assert burst([head.url], head.model, 20) == [200] * 20
        # Each rank's silence is noticed on its own stats tick: wait until both are.
        code, body = _wait_for(lambda: "ranks [2, 3]" in " ".join((h := _health(head))[1]["problems"]) and h, 10,
                               "the head noticing both lost ranks")
        assert code == 200 and "ranks [2, 3]" in body["problems"][0]
        assert httpx.get(f"{head.url}/ranks").json()["lost_ranks"] == [2, 3]
    finally:
        head.stop()
        worker.stop()


def test_losing_the_head_leaves_a_dense_node_serving(tiny_qwen3):
    head, worker = _two_nodes(tiny_qwen3)
    try:
        streams = Streams([worker.url], head.model, 4)
        streams.wait_streaming()
        kill_tree(head.process.pid)
        assert [o.kind for o in streams.join(60)] == ["complete"] * 4
        _wait_for(lambda: "lost the head node" in worker.output, 15, "the worker noticing")
        assert burst([worker.url], head.model, 20) == [200] * 20
        code, body = _health(worker)
        assert code == 200 and "coordinator" in body["problems"][0]
        assert worker.process.poll() is None
    finally:
        head.stop()
        worker.stop()


def test_requests_queued_on_a_dead_engine_move_to_another(tiny_qwen3):
    """With migration off, only requests that already streamed tokens fail; queued ones are
    re-sent, unseen by clients."""
    (server,) = start_servers(_dp2(tiny_qwen3, "--max-num-seqs", "2", "--migration-limit", "0"))
    try:
        streams = Streams([server.url], server.model, 16, max_tokens=300)
        _wait_for(lambda: sum(o.chunks > 0 for o in streams.outcomes) >= 4, 60, "both engines busy")
        waiting = 16 - sum(o.chunks > 0 for o in streams.outcomes)
        os.kill(server.children()["hybridlb:engine:0"], signal.SIGKILL)
        outcomes = streams.join(120)
        assert waiting >= 8
        assert streams.count("error") <= 2, [o.detail for o in streams.outcomes if o.kind == "error"]
        assert all("engine 0" in o.detail for o in outcomes if o.kind == "error")
        assert streams.count("complete") >= 14
        # One tally for the engine's requests: the queued ones moved, only the clients' errors lost.
        tally = re.search(r"engine 0: of its (\d+) in-flight requests, (\d+) moved, (\d+) lost", server.output)
        assert tally is not None, server.output
        assert int(tally[3]) == streams.count("error") and int(tally[2]) >= 1, tally[0]
    finally:
        server.stop()
