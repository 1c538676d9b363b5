"""A running dense cluster grows by a node that joins with the next ranks and shrinks when its
last ones leave (the head's handshake in-process, driven by raw DEALER sockets): the head's
size and what it tells the coordinator follow; a node with a gap, overlapping ranks, or a
cluster that cannot grow (MoE, one API server for all ranks) gets a refusal naming the fix."""

from __future__ import annotations

import contextlib

import msgspec
import zmq

from hybridlb.config import parse_config
from hybridlb.launch.handshake import HeadHandshake, registration
from hybridlb.protocol import (
    Heartbeat,
    NodeAccepted,
    NodeLeaving,
    NodeReady,
    NodeRejected,
    encoder,
    from_head_decoder,
)
from hybridlb.testing.ports import free_port
from hybridlb.testing.waiting import until

SHARED = NodeAccepted("tcp://127.0.0.1:7001", "tcp://127.0.0.1:7002", None)


@contextlib.contextmanager
def _head(model: str, grows: bool):
    config = parse_config({"engine": {"model": model}, "data_parallel": {
        "size": 2, "size_local": 1, "address": "127.0.0.1", "rpc_port": free_port()}})
    sizes: list[int] = []
    handshake = HeadHandshake(config, registration(config, 0, 1, {}), SHARED, sizes.append if grows else None)
    handshake.address = f"tcp://127.0.0.1:{config.data_parallel.rpc_port}"
    handshake.start()
    handshake.mark_local_ready({0: "ipc:///nowhere/engine-0"})
    try:
        yield handshake, sizes
    finally:
        handshake.stop("test over")


class Node:
    def __init__(self, context: zmq.Context, head: HeadHandshake, name: str):
        self.head, self.name = head, name
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(head.address)

    def register(self, start_rank: int, size_local: int, size: int):
        self.start_rank = start_rank
        message = msgspec.structs.replace(self.head.own, hostname=self.name, start_rank=start_rank,
                                          size_local=size_local, size=size)
        self.socket.send(encoder.encode(message))
        while self.socket.poll(5000):
            answer = from_head_decoder.decode(self.socket.recv())
            if not isinstance(answer, Heartbeat):
                return answer
        raise AssertionError("the head did not answer")

    def ready(self) -> None:
        self.socket.send(encoder.encode(NodeReady(self.start_rank)))

    def leave(self, head_size: int) -> None:
        self.socket.send(encoder.encode(NodeLeaving(self.start_rank)))
        until(lambda: self.head.size == head_size, 5, f"the head at {head_size} ranks", 0.02)


def test_a_node_with_the_next_ranks_grows_the_cluster_and_its_leaving_shrinks_it(tiny_qwen3, context):
    with _head(tiny_qwen3, grows=True) as (head, sizes):
        b, c = Node(context, head, "node-b"), Node(context, head, "node-c")
        assert isinstance(b.register(1, 1, 2), NodeAccepted) and sizes == []
        early = c.register(2, 2, 4)  # before the barrier: a cluster still starting does not grow
        assert isinstance(early, NodeRejected) and "once the cluster is up" in early.reason, early
        b.ready()
        until(head.cluster_ready.is_set, 5, "the barrier")
        assert isinstance(c.register(2, 2, 4), NodeAccepted)  # ranks 2..3, the size its last rank makes
        assert head.size == 4 and sizes == [4]
        c.leave(head_size=2)
        assert sizes == [4, 2]
        assert isinstance(c.register(2, 2, 4), NodeAccepted) and sizes == [4, 2, 4]  # and back
        # a node of the first two ranks restarting with the flags it started with: within the cluster, taken
        b2 = Node(context, head, "node-b")
        assert isinstance(b2.register(1, 1, 2), NodeAccepted) and head.size == 4
        b2.leave(head_size=4)  # not the last ranks: its ranks are gone, the size stays
        assert sizes == [4, 2, 4]


def test_a_gap_an_overlap_or_a_wrong_size_is_refused_with_the_fix(tiny_qwen3, context):
    with _head(tiny_qwen3, grows=True) as (head, sizes):
        b = Node(context, head, "node-b")
        b.register(1, 1, 2)
        b.ready()
        until(head.cluster_ready.is_set, 5, "the barrier")
        node = Node(context, head, "node-d")
        gap = node.register(3, 1, 4)
        assert isinstance(gap, NodeRejected) and "starts at rank 2" in gap.reason, gap
        overlap = node.register(0, 1, 2)  # the head's rank
        assert isinstance(overlap, NodeRejected) and "already run by" in overlap.reason, overlap
        short = node.register(2, 1, 5)  # ranks 2..2 but says 5
        assert isinstance(short, NodeRejected) and "size" in short.reason, short
        assert head.size == 2 and sizes == []


def test_a_cluster_that_cannot_grow_refuses_a_larger_size(tiny_qwen3, context):
    with _head(tiny_qwen3, grows=False) as (head, _):
        answer = Node(context, head, "node-c").register(2, 2, 4)
        assert isinstance(answer, NodeRejected), answer
        assert "says data-parallel size 4 but the head runs 2; use the same --data-parallel-size" in answer.reason
        assert head.size == 2


def test_before_the_barrier_a_node_that_leaves_shrinks_nothing_and_may_come_back(tiny_qwen3, context):
    """A node whose start fails stops in order: the cluster still starting keeps its size and waits for it."""
    with _head(tiny_qwen3, grows=True) as (head, sizes):
        b = Node(context, head, "node-b")
        assert isinstance(b.register(1, 1, 2), NodeAccepted)
        b.socket.send(encoder.encode(NodeLeaving(1)))
        until(lambda: not head.nodes, 5, "the head dropping node-b")
        assert head.size == 2 and sizes == [] and not head.cluster_ready.is_set()
        assert isinstance(b.register(1, 1, 2), NodeAccepted)
        b.ready()
        until(head.cluster_ready.is_set, 5, "the barrier with node-b back")
        assert sizes == []
