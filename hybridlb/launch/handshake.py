"""The rpc-port handshake between the head node and the others (no Ray).

The head's launcher runs ``HeadHandshake`` (a thread owning the ROUTER socket): it
checks each registering node against its own fingerprints, runs the readiness barrier
(``ClusterReady`` once every rank is up), sends heartbeats, and grows or shrinks a dense
cluster as nodes with the next ranks join or its last ones leave. Every other node's
launcher uses ``NodeLink`` (``hybridlb.launch.node_link``). Messages: ``hybridlb.protocol``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import queue
import socket
import threading
import time

import zmq

from hybridlb.checkpoint.path import resolve
from hybridlb.config import Config
from hybridlb.protocol import (
    HANDSHAKE_LIMIT,
    ClusterReady,
    Heartbeat,
    NodeAccepted,
    NodeLeaving,
    NodeReady,
    NodeRejected,
    RegisterNode,
    Shutdown,
    decode_routed,
    encoder,
    to_head_decoder,
)
from hybridlb.transport import cluster_token, serve_securely

log = logging.getLogger(__name__)
HEARTBEAT_S = 1.0
REFUSAL_LOG_S = 10.0
PROBE_S = 1.0  # a node without a token asks the head's greeting for its mechanism at most this often
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
HEAD_SILENCE_S = 5.0
REJOIN_INTERVAL_S = 2.0  # a node that lost the head registers again this often until one answers
HEAD_START_S = 900.0  # how long a returned head may take to bring its own ranks up (the barrier)


class ClusterError(RuntimeError):
    """This node cannot join or stay in the cluster; the message says why."""


def fingerprints(config: Config) -> tuple[str, str]:
    """(model, config) fingerprints every node must share with the head."""
    model = resolve(config.engine.model).fingerprint()
    shared = config.engine.model_dump(exclude={"model", "make_if_missing", "torch_threads", "share_cores"})
    shared.update(served=config.served_model_name, mode=config.lb.mode)  # the size is checked on its own
    digest = hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()[:16]
    return model, digest


def registration(config: Config, start_rank: int, size_local: int, engine_addresses: dict[int, str]) -> RegisterNode:
    model, digest = fingerprints(config)
    token = cluster_token(config.data_parallel.cluster_token) or ""
    return RegisterNode(start_rank, size_local, config.data_parallel.size, model, digest, token,
                        engine_addresses, socket.gethostname())


class HeadHandshake(threading.Thread):
    def __init__(self, config: Config, own: RegisterNode, accepted: NodeAccepted, on_resize=None):
        """``on_resize(size)``: the cluster may grow by nodes that join with the next ranks and
        shrink by the last ones leaving (dense, every node serving its own ranks); called from
        this thread with the new size, before the joining node hears it was accepted."""
        super().__init__(name="hybridlb-handshake", daemon=True)
        dp = config.data_parallel
        self.own, self.accepted, self.on_resize = own, accepted, on_resize
        self.size = own.size  # ranks in the cluster now (``on_resize``)
        self.context = zmq.Context()
        self.router = self.context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.MAXMSGSIZE, HANDSHAKE_LIMIT)
        # A send to a node that is gone fails (so a restarted node may take its ranks over),
        # and one that answers no ping for HEAD_SILENCE_S counts as gone.
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        self.router.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(HEAD_SILENCE_S * 1000))
        address = f"tcp://{dp.address}:{dp.rpc_port}"
        serve_securely(self.router, address, own.token or None)
        self.refusals = self.router.get_monitor_socket(HANDSHAKE_FAILED)
        self.last_refusal_log = 0.0
        self.router.bind(address)
        if not own.token and (warning := dp.open_handshake_warning()) is not None:
            log.warning("%s", warning)
        self.nodes: dict[bytes, RegisterNode] = {}
        self.ready_ranks: set[int] = set()
        self.engine_addresses: dict[int, str] = {}
        self.cluster_ready = threading.Event()
        self.commands: queue.Queue = queue.Queue()

    # -- called from the launcher's thread -------------------------------------------
    def mark_local_ready(self, engine_addresses: dict[int, str]) -> None:
        self.commands.put(("ready", engine_addresses))

    def stop(self, reason: str) -> None:
        self.commands.put(("stop", reason))
        self.join(3)

    # -- the thread ----------------------------------------------------------------------
    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.refusals, zmq.POLLIN)
        last_beat = 0.0
        while True:
            ready = dict(poller.poll(200))
            if self.router in ready:
                self._receive(self.router.recv_multipart())
            if self.refusals in ready:
                self._refused()
            if not self._run_commands():
                break
            if time.monotonic() - last_beat >= HEARTBEAT_S:
                self._broadcast(Heartbeat())
                last_beat = time.monotonic()
        self.context.destroy(linger=200)

    def _refused(self) -> None:
        """A peer failed the secure (CURVE) handshake: it lacks this cluster's token."""
        self.refusals.recv_multipart()
        now = time.monotonic()
        if now - self.last_refusal_log >= REFUSAL_LOG_S:  # a stray peer retries every 100 ms
            log.warning("refused a connection that failed the secure handshake: wrong or missing cluster token")
            self.last_refusal_log = now

    def _run_commands(self) -> bool:
        while True:
            try:
                command, value = self.commands.get_nowait()
            except queue.Empty:
                return True
            if command == "stop":
                self._broadcast(Shutdown(value))
                return False
            self.engine_addresses.update(value)
            self.ready_ranks.update(value)
            self._check_barrier()

    def _receive(self, frames: list[bytes]) -> None:
        if (routed := decode_routed(frames, to_head_decoder, log, "handshake message")) is None:
            return
        identity, message = routed
        if isinstance(message, RegisterNode):
            replaced = self._replaced_by(identity, message)
            problem = self._problem(identity, message, replaced)
            if problem:  # checked first: a registration refused takes nothing from the nodes it overlaps
                log.error("rejected node %r (start rank %d): %s", message.hostname, message.start_rank, problem)
                self._send(identity, NodeRejected(problem))
                return
            for old in replaced:
                log.info("node %r rejoined with ranks %d..%d; its old registration is gone", message.hostname,
                         message.start_rank, message.start_rank + message.size_local - 1)
                del self.nodes[old]
            self.nodes[identity] = message
            last = message.start_rank + message.size_local - 1
            log.info("node %r joined with ranks %d..%d", message.hostname, message.start_rank, last)
            if last >= self.size:
                self._resize(last + 1, f"node {message.hostname!r} adds ranks {message.start_rank}..{last}")
            self._send(identity, self.accepted)
        elif isinstance(message, NodeLeaving):
            self._leaving(identity)
        elif isinstance(message, NodeReady) and identity not in self.nodes:
            log.warning("dropped a NodeReady from a node that has not joined")
        elif isinstance(message, NodeReady):
            node = self.nodes[identity]
            self.engine_addresses.update(node.engine_addresses)
            self.ready_ranks.update(range(node.start_rank, node.start_rank + node.size_local))
            if self.cluster_ready.is_set():  # a node that rejoined a running cluster
                self._send(identity, ClusterReady(self.engine_addresses))
            self._check_barrier()

    def _replaced_by(self, identity: bytes, node: RegisterNode) -> list[bytes]:
        """Registrations ``node`` takes over: the same ranks from the same host (a restarted
        node whose old connection is not closed yet), or overlapping ones of a node that is gone."""
        first, last = node.start_rank, node.start_rank + node.size_local - 1  # intervals: never a set of them
        replaced = []
        for other_id, other in self.nodes.items():
            other_last = other.start_rank + other.size_local - 1
            if other_id == identity or max(first, other.start_rank) > min(last, other_last):
                continue
            same = other.hostname == node.hostname and (other.start_rank, other_last) == (first, last)
            if same or not self._send(other_id, Heartbeat()):
                replaced.append(other_id)
        return replaced

    def _problem(self, identity: bytes, node: RegisterNode, replaced: list[bytes] = ()) -> str | None:
        own = self.own
        if own.token and not hmac.compare_digest(node.token.encode(), own.token.encode()):
            return "wrong cluster token; give every node the same --cluster-token / HYBRIDLB_CLUSTER_TOKEN"
        last = node.start_rank + node.size_local - 1
        up = self.on_resize is not None and self.cluster_ready.is_set()  # a running cluster that may grow
        grows = up and node.start_rank == self.size and node.size == last + 1
        if node.size != self.size and not (up and (grows or last < self.size)):
            more = (f" (once the cluster is up, a node that adds ranks to it starts at rank {self.size} and says the "
                    "size its last rank makes)") if self.on_resize is not None else ""
            return (f"this node says data-parallel size {node.size} but the head runs {self.size}; "
                    f"use the same --data-parallel-size{more}")
        if node.model_fingerprint != own.model_fingerprint:
            return ("the model differs from the head's (config.json does not match); "
                    "serve the same checkpoint everywhere")
        if node.config_hash != own.config_hash:
            return ("engine settings differ from the head's (dtype, max_model_len, block size, model name, ...); "
                    "use the same config on every node")
        if node.start_rank < 0 or node.size_local < 1 or (last >= self.size and not grows):
            return f"ranks {node.start_rank}..{last} are not within 0..{self.size - 1} (data-parallel size {self.size})"
        ranks = set(range(node.start_rank, last + 1))
        if outside := sorted(set(node.engine_addresses) - ranks):
            return f"engine addresses for rank(s) {outside[:8]} that this node does not run"
        for other_id, other in [(b"head", own), *self.nodes.items()]:
            if other_id == identity or other_id in replaced:
                continue
            taken = ranks & set(range(other.start_rank, other.start_rank + other.size_local))
            if taken:
                return (f"rank(s) {sorted(taken)} are already run by {other.hostname or 'the head'}; "
                        "pick another --data-parallel-start-rank")
        return None

    def _leaving(self, identity: bytes) -> None:
        """A node stops in order: its ranks leave; a running cluster shrinks when they were its last
        (before the barrier nothing shrinks: the node may register again, and the start waits for it)."""
        node = self.nodes.pop(identity, None)
        if node is None:
            log.warning("dropped a NodeLeaving from a node that has not joined")
            return
        ranks = range(node.start_rank, node.start_rank + node.size_local)
        self.ready_ranks.difference_update(ranks)
        for rank in ranks:
            self.engine_addresses.pop(rank, None)
        if self.on_resize is not None and self.cluster_ready.is_set() and ranks.stop == self.size:
            self._resize(node.start_rank, f"node {node.hostname!r} left with ranks {ranks.start}..{ranks.stop - 1}")
        else:
            log.info("node %r left; ranks %d..%d are gone until a node takes them", node.hostname, ranks.start,
                     ranks.stop - 1)

    def _resize(self, size: int, why: str) -> None:
        log.info("%s: the cluster has %d ranks now (it had %d)", why, size, self.size)
        self.size = size
        try:
            self.on_resize(size)
        except Exception:  # the coordinator's count is advisory: the join goes on
            log.exception("could not tell the coordinator the cluster's new size")

    def _check_barrier(self) -> None:
        if not self.cluster_ready.is_set() and len(self.ready_ranks) >= self.size:
            log.info("all %d ranks are up: the cluster is ready", self.size)
            self.cluster_ready.set()
            self._broadcast(ClusterReady(self.engine_addresses))

    def _broadcast(self, message) -> None:
        for identity in self.nodes:
            self._send(identity, message)

    def _send(self, identity: bytes, message) -> bool:
        """Send; False if that node is gone (or not reading)."""
        try:
            self.router.send_multipart([identity, encoder.encode(message)], zmq.NOBLOCK)
            return True
        except zmq.ZMQError as exc:
            if exc.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                raise
            return False
