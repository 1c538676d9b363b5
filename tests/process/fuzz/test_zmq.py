"""Bad frames to every socket a `hybridlb serve` binds: engine, coordinator, handshake.

A two-node cluster (one rank each) on one host. Each receiver must drop every bad
message with exactly one "dropped ..." warning line (one line: a newline in the input
must not forge another), keep the sender's connection, and go on serving; a frame over
its size limit drops the sender's connection instead of being buffered.
"""

from __future__ import annotations

import re
import time

import httpx
import msgspec
import pytest
import zmq

from hybridlb.params import LoRARequest, SamplingParams
from hybridlb.protocol import (
    AbortRequests,
    AddRequest,
    EngineOutputs,
    EngineReady,
    EngineStats,
    Hello,
    LoadAdapters,
    LoadSnapshot,
    NodeLeaving,
    NodeReady,
    NodeRejected,
    RegisterNode,
    StartWave,
    WaveComplete,
    encoder,
    from_engine_decoder,
    from_head_decoder,
    loads_decoder,
)
from hybridlb.testing.ports import free_port_range
from hybridlb.testing.servers import Server, completion, start_servers
from hybridlb.testing.sockets import assert_drops_oversized
from hybridlb.transport import connect_securely

TOKEN = "fuzz-cluster-token"
pack = msgspec.msgpack.encode

# Bad for every receiver: not msgpack, truncated, the wrong shape, too many frames, and a
# newline that would forge a second "dropped" line if the receiver logged it raw.
COMMON = [
    [b""],
    [b"\xc1"],
    [bytes(range(256)) * 4],
    [encoder.encode(Hello("someone"))[:-3]],
    [pack(12345)],
    [pack(None)],
    [pack([1, 2, 3])],
    [pack({"no": "type"})],
    [pack({"type": "x\n12:00:00 WARNING [hybridlb:forged] dropped nothing"})],
    [encoder.encode(LoadSnapshot(engines=[]))],  # valid msgpack, a struct nobody sends here
    [b"a", b"b"],
    [b"a", b"b", b"c"],
]


def _dp_flags(start_rank: int, rpc_port: int) -> list[str]:
    return ["--data-parallel-size", "2", "--data-parallel-size-local", "1", "--data-parallel-start-rank",
            str(start_rank), "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(rpc_port),
            "--cluster-token", TOKEN]


@pytest.fixture(scope="module")
def cluster(tiny_qwen3):
    rpc = free_port_range(8)
    head, worker = start_servers(Server(tiny_qwen3, *_dp_flags(0, rpc)), Server(tiny_qwen3, *_dp_flags(1, rpc)))
    head.rpc = rpc
    try:
        yield head, worker
    finally:
        for node in (worker, head):
            node.process.terminate()  # both at once
        head.stop()
        worker.stop()


@pytest.fixture(scope="module")
def context():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def _socket(context: zmq.Context, kind: int, address: str) -> zmq.Socket:
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    connect_securely(sock, address, TOKEN)  # an insider: outsiders do not get this far (tests/cluster/security)
    sock.connect(address)
    return sock


def _count(server: Server, pattern: str) -> int:
    return sum(bool(re.search(pattern, line)) for line in list(server.lines))


def _expect_lines(server: Server, pattern: str, before: int, expected: int) -> None:
    """Exactly ``expected`` more lines matching ``pattern`` (waiting for stragglers)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _count(server, pattern) - before < expected:
        time.sleep(0.1)
    time.sleep(0.5)  # a second line per message would be here by now
    got = _count(server, pattern) - before
    assert got == expected, f"{got} lines matching {pattern!r}, expected {expected}:\n{server.output}"


def _send_all(sock: zmq.Socket, messages: list[list[bytes]]) -> None:
    for frames in messages:
        sock.send_multipart(frames)


def _dropped_when_oversized(context: zmq.Context, kind: int, address: str) -> None:
    sock = _socket(context, kind, address)
    try:
        assert_drops_oversized(sock, address)
    finally:
        sock.close(linger=0)


def _assert_clean(server: Server) -> None:
    assert server.process.poll() is None, server.output
    assert "Traceback" not in server.output, server.output


# -- the handshake (head, rpc port) ------------------------------------------------------------
def test_handshake_drops_bad_messages_and_still_answers(cluster, context):
    head, _ = cluster
    dealer = _socket(context, zmq.DEALER, f"tcp://127.0.0.1:{head.rpc}")
    try:
        bad = [*COMMON,
               [pack({"type": "register", "start_rank": "zero", "size_local": 1, "size": 2,
                      "model_fingerprint": "", "config_hash": ""})],
               [encoder.encode(NodeReady(1))],  # from a node that never joined
               [encoder.encode(NodeLeaving(1))],  # likewise: it takes no ranks away
               [encoder.encode(EngineStats(0, 0, 0, 0.0))]]
        before = _count(head, r"WARNING .*dropped")
        _send_all(dealer, bad)
        _expect_lines(head, r"WARNING .*dropped", before, len(bad))

        # Still answering, on the same connection: a wrong token is rejected, no addresses given.
        rejected_before = _count(head, r"ERROR .*rejected node")
        impostor = RegisterNode(1, 1, 2, "fingerprint", "hash", token="not-the-token", hostname="impostor\nline")
        dealer.send(encoder.encode(impostor))
        assert dealer.poll(10_000), "the head's handshake stopped answering"
        reply = from_head_decoder.decode(dealer.recv())
        assert isinstance(reply, NodeRejected) and "cluster token" in reply.reason
        _expect_lines(head, r"ERROR .*rejected node", rejected_before, 1)
    finally:
        dealer.close(linger=0)
    _dropped_when_oversized(context, zmq.DEALER, f"tcp://127.0.0.1:{head.rpc}")
    _assert_clean(head)
    head.handshake_fuzzed_at = time.monotonic()


# -- the coordinator (head, rpc port + 1) ------------------------------------------------------
def _snapshots(context: zmq.Context, address: str, count: int) -> list[LoadSnapshot]:
    sub = _socket(context, zmq.SUB, address)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        got = []
        deadline = time.monotonic() + 10
        while len(got) < count and time.monotonic() < deadline:
            if sub.poll(500):
                got.append(loads_decoder.decode(sub.recv()))
        return got
    finally:
        sub.close(linger=0)


def test_coordinator_drops_bad_messages_and_keeps_publishing(cluster, context):
    head, _ = cluster
    push = _socket(context, zmq.PUSH, f"tcp://127.0.0.1:{head.rpc + 1}")
    try:
        bad = [*COMMON,
               [encoder.encode(Hello("not-an-engine"))],
               [pack({"type": "stats", "rank": "0", "num_running": 0, "num_waiting": 0, "kv_usage": 0.0})],
               [encoder.encode(EngineStats(rank=99, num_running=0, num_waiting=0, kv_usage=0.0))],
               [encoder.encode(StartWave(5, 0))],  # a dense cluster has no waves
               [encoder.encode(WaveComplete(2**64 - 1))]]
        before = _count(head, r"WARNING .*dropped")
        _send_all(push, bad)
        _expect_lines(head, r"WARNING .*dropped", before, len(bad))
    finally:
        push.close(linger=0)
    _dropped_when_oversized(context, zmq.PUSH, f"tcp://127.0.0.1:{head.rpc + 1}")
    snapshots = _snapshots(context, f"tcp://127.0.0.1:{head.rpc + 2}", 2)
    assert len(snapshots) == 2, "the coordinator stopped publishing"
    assert sorted(stats.rank for stats in snapshots[-1].engines) == [0, 1]
    assert snapshots[-1].current_wave == 0 and snapshots[-1].wave_messages == 0
    _assert_clean(head)


# -- an engine (head's rank 0, ipc) ------------------------------------------------------------
def _engine_address(server: Server) -> str:
    (engine,) = httpx.get(f"{server.url}/ranks", timeout=10).json()["engines"]
    return engine["address"]


def _outputs(dealer: zmq.Socket, request_id: str) -> list:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if dealer.poll(500):
            message = from_engine_decoder.decode(dealer.recv())
            if isinstance(message, EngineOutputs):
                found = [o for o in message.outputs if o.request_id == request_id]
                if found:
                    return found
    raise AssertionError(f"no output for {request_id}")


def test_engine_drops_bad_messages_and_keeps_serving(cluster, context):
    head, _ = cluster
    address = _engine_address(head)
    dealer = _socket(context, zmq.DEALER, address)
    try:
        bad = [*COMMON,
               [pack({"type": "add", "request_id": "r", "prompt_token_ids": ["one", 2], "params": {}})],
               [pack({"type": "add", "request_id": 7, "prompt_token_ids": [1], "params": {}})],
               [pack({"type": "add", "request_id": "r", "prompt_token_ids": [1.5], "params": {}})],
               [encoder.encode(EngineReady(0, "m", 1, 1, 1, 1, []))],
               [encoder.encode(StartWave(3, 1))],  # waves come from the coordinator only
               [encoder.encode(LoadAdapters([LoRARequest("x", "/etc")]))]]  # this engine serves no adapters
        before = _count(head, r"WARNING .*dropped")
        _send_all(dealer, bad)
        _expect_lines(head, r"WARNING .*dropped", before, len(bad))

        # The same connection still works; well-formed but invalid requests are answered, not logged.
        dealer.send(encoder.encode(Hello("fuzzer")))
        assert dealer.poll(10_000) and isinstance(from_engine_decoder.decode(dealer.recv()), EngineReady)
        dealer.send(encoder.encode(AddRequest("bad-ids", [-1, 10**9], SamplingParams(max_tokens=2))))
        (error,) = _outputs(dealer, "bad-ids")
        assert error.finish_reason == "error" and "prompt token ids" in error.error
        dealer.send(encoder.encode(AddRequest("bad-params", [1, 2], SamplingParams(max_tokens=0, top_p=9.0))))
        (error,) = _outputs(dealer, "bad-params")
        assert error.finish_reason == "error" and "max_tokens" in error.error
        dealer.send(encoder.encode(AbortRequests(["someone-elses-request"])))
        dealer.send(encoder.encode(AddRequest("good", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0))))
        tokens = []
        while not tokens or tokens[-1].finish_reason is None:
            tokens += _outputs(dealer, "good")
        assert sum(len(o.new_token_ids) for o in tokens) == 2
        assert _count(head, r"WARNING .*dropped") - before == len(bad)
    finally:
        dealer.close(linger=0)
    _dropped_when_oversized(context, zmq.DEALER, address)
    result = completion(head.url, head.model, prompt="after the fuzzing", max_tokens=3)
    assert result["usage"]["completion_tokens"] == 3
    _assert_clean(head)


def test_cluster_still_serves_on_both_nodes(cluster):
    """Last: the worker still hears the head's heartbeats (it leaves after 5 s of silence)."""
    head, worker = cluster
    time.sleep(max(0.0, getattr(head, "handshake_fuzzed_at", 0.0) + 6 - time.monotonic()))
    for node in (head, worker):
        assert completion(node.url, node.model, max_tokens=2)["usage"]["completion_tokens"] == 2
        _assert_clean(node)
