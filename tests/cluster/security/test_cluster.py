"""Real `hybridlb serve` nodes: joining needs the cluster token, and every TCP listener of
every node is on the configured interface (loopback by default), never on all of them."""

from __future__ import annotations

import contextlib
import time

import httpx
import pytest
import zmq

from hybridlb.protocol import EngineStats, encoder
from hybridlb.testing.listeners import assert_loopback_only, listeners
from hybridlb.testing.ports import free_port_range
from hybridlb.testing.servers import Server, completion, start_servers

TOKEN = "s3cret-cluster-token"


def _dp_flags(size: int, size_local: int, start_rank: int, rpc: int, *token: str) -> list[str]:
    return ["--data-parallel-size", str(size), "--data-parallel-size-local", str(size_local),
            "--data-parallel-start-rank", str(start_rank), "--data-parallel-rpc-port", str(rpc), *token]


def _outsiders_cannot_inject_or_listen(head: Server, rpc: int) -> None:
    """Without the token's keys, the coordinator takes no stats from you and tells you nothing."""
    context = zmq.Context()
    try:
        push = context.socket(zmq.PUSH)
        push.connect(f"tcp://127.0.0.1:{rpc + 1}")
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{rpc + 2}")
        fake = EngineStats(rank=0, num_running=999, num_waiting=999, kv_usage=1.0, seq=10**9, epoch=10**19)
        for _ in range(20):
            with contextlib.suppress(zmq.Again):  # mostly no peer to queue for: the handshake keeps failing
                push.send(encoder.encode(fake), zmq.NOBLOCK)
            time.sleep(0.1)
        assert not sub.poll(1500), "an outsider received load snapshots"
        cluster = httpx.get(f"{head.url}/ranks").json()["cluster"]
        assert cluster and all(stats["num_running"] != 999 for stats in cluster)
    finally:
        context.destroy(linger=0)


def _exit_code(server: Server, head: Server, timeout_s: float = 60) -> int:
    deadline = time.monotonic() + timeout_s
    while server.process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.process.poll() is not None, \
        f"the node did not exit:\n{server.output}\nthe head (running: {head.process.poll() is None}):\n{head.output}"
    return server.process.returncode


def _wait_listening(head: Server, port: int, timeout_s: float = 60) -> None:
    """Until the head listens on ``port`` (its handshake): a node started earlier waits for it."""
    deadline = time.monotonic() + timeout_s
    while port not in {p for _, p in listeners(head.process.pid)}:
        assert head.process.poll() is None and time.monotonic() < deadline, f"the head never listened:\n{head.output}"
        time.sleep(0.2)


def test_only_a_node_with_the_token_joins_and_nothing_listens_beyond_loopback(tiny_qwen3, monkeypatch):
    monkeypatch.delenv("HYBRIDLB_CLUSTER_TOKEN", raising=False)
    rpc = free_port_range(8)
    head = Server(tiny_qwen3, *_dp_flags(2, 1, 0, rpc, "--cluster-token", TOKEN))
    nodes = [head]
    try:
        _wait_listening(head, rpc)
        for token in ([], ["--cluster-token", "not-" + TOKEN]):
            intruder = Server(tiny_qwen3, *_dp_flags(2, 1, 1, rpc, *token))
            nodes.append(intruder)
            assert _exit_code(intruder, head) == 1
            assert "refused this node's secure connection: the cluster token differs" in intruder.output, \
                intruder.output
            assert "serving at" not in intruder.output  # rejected before loading anything
            assert TOKEN not in intruder.output
        assert "failed the secure handshake: wrong or missing cluster token" in head.output
        assert head.process.poll() is None and "hybridlb is ready" not in head.output

        worker = Server(tiny_qwen3, *_dp_flags(2, 1, 1, rpc, "--cluster-token", TOKEN))
        nodes.append(worker)
        start_servers(head, worker)
        assert completion(worker.url, worker.model)["usage"]["completion_tokens"] == 4
        assert_loopback_only(head, {head.port, rpc, rpc + 1, rpc + 2})
        assert_loopback_only(worker, {worker.port})
        assert all(TOKEN not in node.output for node in nodes)
        _outsiders_cannot_inject_or_listen(head, rpc)
    finally:
        for node in nodes:
            node.stop()


@pytest.mark.slow
def test_expert_parallel_rendezvous_listens_on_loopback_only(checkpoints):
    """MoE with sharded experts adds torch.distributed's store (rpc + 3) and its peers' sockets."""
    rpc = free_port_range(8)
    (server,) = start_servers(Server(checkpoints("qwen3_moe"), *_dp_flags(2, 2, 0, rpc), "--enable-expert-parallel"))
    try:
        assert_loopback_only(server, {server.port, rpc + 3})
        assert not {rpc + 1, rpc + 2, rpc + 4} & {port for _, port in listeners(server.process.pid)}
    finally:
        server.stop()


def test_one_node_has_no_coordinator_port_to_forge_stats_on(tiny_qwen3):
    """On one node the coordinator's sockets are IPC in the node's private (0700) runtime
    directory: forged stats sent where its TCP port would be reach nothing, and the node
    listens on its HTTP port alone."""
    rpc = free_port_range(8)
    (server,) = start_servers(Server(tiny_qwen3, *_dp_flags(2, 2, 0, rpc)))
    try:
        assert {port for _, port in listeners(server.process.pid)} == {server.port}
        _outsiders_cannot_inject_or_listen(server, rpc)
        assert completion(server.url, server.model)["usage"]["completion_tokens"] == 4
    finally:
        server.stop()


def test_without_a_token_the_nodes_share_a_key_drawn_for_the_run(tiny_qwen3):
    """Two nodes and no cluster token: the coordinator's ports are TCP, yet a process that did
    not join through the handshake can neither feed them forged stats nor read the snapshots,
    while the node that joined reports all its ranks (it got the run's key in NodeAccepted)."""
    rpc = free_port_range(8)
    head, worker = start_servers(Server(tiny_qwen3, *_dp_flags(4, 2, 0, rpc)),
                                 Server(tiny_qwen3, *_dp_flags(4, 2, 2, rpc)))
    try:
        _outsiders_cannot_inject_or_listen(head, rpc)
        deadline = time.monotonic() + 10
        while {s["rank"] for s in httpx.get(f"{head.url}/ranks").json()["cluster"] or []} != {0, 1, 2, 3}:
            assert time.monotonic() < deadline, httpx.get(f"{head.url}/ranks").json()
            time.sleep(0.2)
        assert completion(worker.url, worker.model)["usage"]["completion_tokens"] == 4
    finally:
        head.stop()
        worker.stop()
