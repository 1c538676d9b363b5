"""The head's handshake in-process, driven by raw DEALER sockets: the cluster token, and
registrations that claim ranks they must not."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import msgspec
import pytest
import zmq

from hybridlb.config import parse_config
from hybridlb.launch.handshake import ClusterError, HeadHandshake, registration
from hybridlb.launch.node_link import NodeLink
from hybridlb.protocol import (
    ClusterReady,
    Heartbeat,
    NodeAccepted,
    NodeReady,
    NodeRejected,
    Shutdown,
    encoder,
    from_head_decoder,
)
from hybridlb.testing.ports import free_port
from hybridlb.transport import connect_securely, serve_securely, speaks_curve

TOKEN = "cluster-secret"
SHARED = NodeAccepted("tcp://127.0.0.1:7001", "tcp://127.0.0.1:7002", None)


@pytest.fixture
def head(tiny_qwen3):
    config = parse_config({"engine": {"model": tiny_qwen3}, "data_parallel": {
        "size": 3, "size_local": 1, "address": "127.0.0.1", "rpc_port": free_port(), "cluster_token": TOKEN}})
    handshake = HeadHandshake(config, registration(config, 0, 1, {}), SHARED)
    handshake.start()
    handshake.address = f"tcp://127.0.0.1:{config.data_parallel.rpc_port}"
    try:
        yield handshake
    finally:
        handshake.stop("test over")


class Node:
    """A raw DEALER that speaks the handshake."""

    def __init__(self, context: zmq.Context, head: HeadHandshake):
        self.head = head
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        connect_securely(self.socket, head.address, TOKEN)  # a token holder misbehaving
        self.socket.connect(head.address)

    def register(self, **changes):
        message = msgspec.structs.replace(self.head.own, hostname="node-b", **changes)
        self.socket.send(encoder.encode(message))
        return self.next()

    def next(self, timeout_s: float = 5):
        """The next message that is not a heartbeat."""
        while self.socket.poll(int(timeout_s * 1000)):
            message = from_head_decoder.decode(self.socket.recv())
            if not isinstance(message, Heartbeat):
                return message
        raise AssertionError("the head did not answer")


@pytest.mark.parametrize("token", ["", "wrong", TOKEN + "x", TOKEN[:-1]])
def test_a_wrong_or_missing_token_is_rejected_without_addresses(head, context, token):
    reply = Node(context, head).register(start_rank=1, token=token)
    assert isinstance(reply, NodeRejected)
    assert "wrong cluster token" in reply.reason and "--cluster-token" in reply.reason
    assert "7001" not in reply.reason and not head.nodes


@pytest.mark.parametrize(("changes", "reason"), [
    ({"start_rank": -1}, "not within 0..2"),
    ({"start_rank": 1, "size_local": 0}, "not within 0..2"),
    ({"start_rank": 1, "size_local": 10**12}, "not within 0..2"),  # must not build a set of 10**12 ranks
    ({"start_rank": 2, "size_local": 2}, "not within 0..2"),
    ({"start_rank": 0}, "rank(s) [0] are already run by"),
    ({"start_rank": 1, "engine_addresses": {0: "tcp://10.9.9.9:1"}}, "engine addresses for rank(s) [0]"),
])
def test_a_registration_claiming_the_wrong_ranks_is_rejected(head, context, changes, reason):
    reply = Node(context, head).register(token=TOKEN, **changes)
    assert isinstance(reply, NodeRejected) and reason in reply.reason, reply
    assert not head.nodes


def test_the_right_token_joins_and_the_barrier_still_holds(head, context):
    bad = context.socket(zmq.DEALER)
    connect_securely(bad, head.address, TOKEN)
    bad.connect(head.address)
    bad.send_multipart([b"one", b"two"])  # the head's thread must survive this
    outsider = Node(context, head)
    outsider.socket.send(encoder.encode(NodeReady(2)))  # ready before joining: ignored
    node = Node(context, head)
    accepted = node.register(start_rank=1, token=TOKEN, engine_addresses={1: "ipc:///tmp/b-1"})
    assert accepted == SHARED
    head.mark_local_ready({0: "ipc:///tmp/a-0"})
    node.socket.send(encoder.encode(NodeReady(1)))
    assert not head.cluster_ready.wait(1.5), "rank 2 never came up, yet the cluster is ready"
    late = Node(context, head)
    assert late.register(start_rank=2, token=TOKEN, engine_addresses={2: "ipc:///tmp/c-2"}) == SHARED
    late.socket.send(encoder.encode(NodeReady(2)))
    ready = node.next()
    assert ready == ClusterReady({0: "ipc:///tmp/a-0", 1: "ipc:///tmp/b-1", 2: "ipc:///tmp/c-2"})
    assert isinstance(node.socket.poll(2500) and from_head_decoder.decode(node.socket.recv()), Heartbeat)
    head.stop("bye")
    assert node.next() == Shutdown("bye")
    bad.close(linger=0)


@pytest.mark.parametrize("key", [None, "wrong"])
def test_without_the_token_a_peer_cannot_even_deliver_a_message(head, context, key):
    """The transport (CURVE keyed by the token) stops outsiders before the handshake reads anything."""
    outsider = context.socket(zmq.DEALER)
    outsider.setsockopt(zmq.LINGER, 0)
    connect_securely(outsider, head.address, key)
    outsider.connect(head.address)
    outsider.send(encoder.encode(msgspec.structs.replace(head.own, start_rank=1, hostname="outsider")))
    assert not outsider.poll(1500), "an outsider got an answer"
    assert not head.nodes
    assert Node(context, head).register(start_rank=1, token=TOKEN) == SHARED  # insiders still join


def _join(model: str, address: str, token: str | None) -> None:
    config = parse_config({"engine": {"model": model}, "data_parallel": {
        "size": 3, "size_local": 1, "start_rank": 1, "address": "127.0.0.1",
        "rpc_port": int(address.rsplit(":", 1)[1]), "cluster_token": token}})
    link = NodeLink(config)
    try:
        link.join(registration(config, 1, 1, {}), timeout_s=10)
    finally:
        link.close()


@pytest.mark.parametrize("token", ["another", None])
def test_a_node_with_another_token_or_none_is_told_why(head, tiny_qwen3, token, monkeypatch):
    monkeypatch.delenv("HYBRIDLB_CLUSTER_TOKEN", raising=False)
    with pytest.raises(ClusterError, match="cluster token differs"):
        _join(tiny_qwen3, head.address, token)


class BusyCurveHead(threading.Thread):
    """What a keyed head's libzmq does when it is slow to read (seen under CI's load): it has
    sent its signature, then reads the peer's whole greeting at once, finds the mechanism
    wrong and drops the connection before its own mechanism went out, so the tokenless peer
    learns nothing but "handshake failed, no detail" on every retry. A peer that sends only
    the greeting's opening (as ``speaks_curve`` does) gets the rest: CURVE."""

    def __init__(self):
        super().__init__(daemon=True)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"

    def run(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.listener.accept()
                with conn:
                    conn.sendall(b"\xff" + bytes(8) + b"\x7f\x03")  # signature and major version
                    time.sleep(0.2)  # busy
                    conn.settimeout(0.5)
                    received = conn.recv(64)
                    if len(received) < 64:
                        conn.sendall(b"\x00" + b"CURVE".ljust(20, b"\0") + b"\x01" + bytes(31))
                        with contextlib.suppress(OSError):
                            conn.recv(64)


def test_a_node_without_a_token_is_told_why_when_the_head_cuts_every_handshake_short(tiny_qwen3, monkeypatch):
    monkeypatch.delenv("HYBRIDLB_CLUSTER_TOKEN", raising=False)
    busy = BusyCurveHead()
    busy.start()
    try:
        with pytest.raises(ClusterError, match="cluster token differs"):
            _join(tiny_qwen3, busy.address, None)
    finally:
        busy.listener.close()


def test_the_greeting_says_which_mechanism_a_socket_demands(context):
    routers = []

    def bound(token: str | None) -> str:
        routers.append(router := context.socket(zmq.ROUTER))
        router.setsockopt(zmq.LINGER, 0)
        serve_securely(router, "tcp://127.0.0.1:1", token)
        return f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"

    assert speaks_curve(bound(TOKEN)) is True
    assert speaks_curve(bound(None)) is False
    assert speaks_curve(f"tcp://127.0.0.1:{free_port()}") is None  # nothing listens
    with socket.create_server(("127.0.0.1", 0)) as closer:  # a proxy with nothing behind it
        threading.Thread(target=lambda: closer.accept()[0].close(), daemon=True).start()
        assert speaks_curve(f"tcp://127.0.0.1:{closer.getsockname()[1]}") is None


def test_a_node_that_is_gone_gives_its_ranks_to_the_next(head, context):
    """Ranks held by a node whose connection closed go to the node that registers them next;
    a node still connected keeps them."""
    first = Node(context, head)
    assert isinstance(first.register(start_rank=1, token=TOKEN), NodeAccepted)
    rival = Node(context, head)
    refused = msgspec.structs.replace(head.own, hostname="node-c", start_rank=1, token=TOKEN)
    rival.socket.send(encoder.encode(refused))
    assert isinstance(rival.next(), NodeRejected)  # node-b is still there
    first.socket.close(linger=0)
    time.sleep(0.5)  # the head sees the connection close
    rival.socket.send(encoder.encode(refused))
    assert isinstance(rival.next(), NodeAccepted)
    assert [n.hostname for n in head.nodes.values()] == ["node-c"]


def test_a_refused_registration_takes_nothing_from_the_node_it_overlaps(head, context):
    """A node gone from rank 1 may be replaced, but only by a registration the head accepts:
    one with a wrong size (or token, or model) is refused and node-b's record stays."""
    first = Node(context, head)
    assert isinstance(first.register(start_rank=1, token=TOKEN), NodeAccepted)
    first.socket.close(linger=0)
    time.sleep(0.5)  # node-b's connection is gone: a valid registration could take rank 1 now
    rival = Node(context, head)
    bad = msgspec.structs.replace(head.own, hostname="node-c", start_rank=1, token=TOKEN, size=5)
    rival.socket.send(encoder.encode(bad))
    assert isinstance(rival.next(), NodeRejected)
    assert [n.hostname for n in head.nodes.values()] == ["node-b"]
