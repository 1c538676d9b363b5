"""The rpc-port handshake between the head node and the others (no Ray).

The head's launcher runs ``HeadHandshake`` (a thread owning the ROUTER socket): it
checks each registering node against its own fingerprints, runs the readiness barrier
(``ClusterReady`` once every rank is up) and sends heartbeats. Every other node's
launcher uses ``NodeLink``: join, report ready, wait for the barrier, then watch the
heartbeats and give up when the head goes quiet. Messages: ``hybridlb.protocol``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import queue
import socket
import threading
import time
import uuid

import zmq
from zmq.utils.monitor import parse_monitor_message

from hybridlb.checkpoint.path import resolve
from hybridlb.config import Config
from hybridlb.protocol import (
    HANDSHAKE_LIMIT,
    ClusterReady,
    Heartbeat,
    NodeAccepted,
    NodeReady,
    NodeRejected,
    RegisterNode,
    Shutdown,
    decode_routed,
    encoder,
    from_head_decoder,
    to_head_decoder,
)
from hybridlb.transport import cluster_token, connect_securely, serve_securely, speaks_curve

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
    shared.update(served=config.served_model_name, size=config.data_parallel.size, mode=config.lb.mode)
    digest = hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()[:16]
    return model, digest


def registration(config: Config, start_rank: int, size_local: int, engine_addresses: dict[int, str]) -> RegisterNode:
    model, digest = fingerprints(config)
    token = cluster_token(config.data_parallel.cluster_token) or ""
    return RegisterNode(start_rank, size_local, config.data_parallel.size, model, digest, token,
                        engine_addresses, socket.gethostname())


class HeadHandshake(threading.Thread):
    def __init__(self, config: Config, own: RegisterNode, accepted: NodeAccepted):
        super().__init__(name="hybridlb-handshake", daemon=True)
        dp = config.data_parallel
        self.own, self.accepted = own, accepted
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
            log.info("node %r joined with ranks %d..%d", message.hostname, message.start_rank,
                     message.start_rank + message.size_local - 1)
            self._send(identity, self.accepted)
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
        if node.size != own.size:
            return (f"this node says data-parallel size {node.size} but the head runs {own.size}; "
                    "use the same --data-parallel-size")
        if node.model_fingerprint != own.model_fingerprint:
            return ("the model differs from the head's (config.json does not match); "
                    "serve the same checkpoint everywhere")
        if node.config_hash != own.config_hash:
            return ("engine settings differ from the head's (dtype, max_model_len, block size, model name, ...); "
                    "use the same config on every node")
        last = node.start_rank + node.size_local - 1
        if node.start_rank < 0 or node.size_local < 1 or last >= own.size:
            return f"ranks {node.start_rank}..{last} are not within 0..{own.size - 1} (data-parallel size {own.size})"
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

    def _check_barrier(self) -> None:
        if not self.cluster_ready.is_set() and len(self.ready_ranks) == self.own.size:
            log.info("all %d ranks are up: the cluster is ready", self.own.size)
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


class NodeLink:
    """A non-head node's line to the head."""

    def __init__(self, config: Config):
        dp = config.data_parallel
        self.head = f"tcp://{dp.address}:{dp.rpc_port}"
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        # One identity for this process's life: after a reconnect the head still knows who we are.
        identity = f"node-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.socket.setsockopt(zmq.IDENTITY, identity.encode())
        self.keyed = cluster_token(dp.cluster_token) is not None
        connect_securely(self.socket, self.head, cluster_token(dp.cluster_token))
        self.transport = self.socket.get_monitor_socket(HANDSHAKE_FAILED)
        self.next_probe = 0.0
        self.socket.connect(self.head)
        self.last_heard = time.monotonic()
        self.lost: str | None = None
        self.registration: RegisterNode | None = None
        self._watcher: threading.Thread | None = None

    def _recv(self, timeout_s: float):
        """Next message from the head, or None after ``timeout_s``; heartbeats refresh liveness."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not self.socket.poll(int(min(left, 0.5) * 1000) + 1):
                if time.monotonic() - self.last_heard > HEAD_SILENCE_S:
                    raise ClusterError(f"lost the head node at {self.head}: no heartbeat for {HEAD_SILENCE_S:.0f} s")
                continue
            message = from_head_decoder.decode(self.socket.recv())
            self.last_heard = time.monotonic()
            if isinstance(message, Shutdown):
                raise ClusterError(f"the head node stopped ({message.reason})")
            if not isinstance(message, Heartbeat):
                return message
        return None

    def join(self, registration: RegisterNode, timeout_s: float = 120) -> NodeAccepted:
        self.registration = registration
        self.socket.send(encoder.encode(registration))
        self.last_heard = time.monotonic() + timeout_s  # the head may not be up yet
        deadline, reply = self.last_heard, None
        while reply is None and time.monotonic() < deadline:
            if self._refused():
                raise ClusterError(f"the head node at {self.head} refused this node's secure connection: the "
                                   "cluster token differs from the head's (or only one of them has one); give every "
                                   "node the same --cluster-token / HYBRIDLB_CLUSTER_TOKEN")
            reply = self._recv(min(0.5, deadline - time.monotonic()))
        if reply is None:
            raise ClusterError(f"no answer from the head node at {self.head} within {timeout_s:.0f} s")
        if isinstance(reply, NodeRejected):
            raise ClusterError(f"the head node at {self.head} rejected this node: {reply.reason}")
        self.last_heard = time.monotonic()
        return reply

    def _refused(self) -> bool:
        """Whether the head refused our secure handshake. With a token, any failed handshake
        says so (a wrong key ends in one cut short with no detail). Without one, a protocol
        error does (the head speaks CURVE), but a handshake cut short with no detail is what
        a busy head gives as well as a proxy whose head is not up yet: then ask the head's
        greeting which mechanism it speaks (at most every PROBE_S)."""
        refused = cut_short = False
        while self.transport.poll(0):
            event = parse_monitor_message(self.transport.recv_multipart())["event"]
            refused |= self.keyed or event != zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            cut_short = True
        if cut_short and not refused and time.monotonic() >= self.next_probe:
            self.next_probe = time.monotonic() + PROBE_S
            refused = speaks_curve(self.head) is True
        return refused

    def wait_cluster_ready(self, start_rank: int, timeout_s: float) -> ClusterReady:
        self.socket.send(encoder.encode(NodeReady(start_rank)))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            message = self._recv(deadline - time.monotonic())
            if isinstance(message, ClusterReady):
                return message
        raise ClusterError(f"the cluster was not ready within {timeout_s:.0f} s (some node never came up)")

    def watch(self, on_lost, on_back=None) -> None:
        """From now on, call ``on_lost(reason)`` when the head goes quiet or stops. Without
        ``on_back`` that ends the watch. With it, register again every ``REJOIN_INTERVAL_S``
        until a head answers (the same one once a cut link heals, or a restarted one), then
        call ``on_back(accepted)``: if it returns true, report ready again, wait for the
        cluster's barrier and watch on; if false, stop here."""

        def loop() -> None:
            while True:
                try:
                    self._recv(3600)
                except ClusterError as exc:
                    self.lost = str(exc)
                    on_lost(self.lost)
                    if on_back is None or not self._rejoin(on_back):
                        return
                    self.lost = None
                except zmq.ZMQError:  # closed by this node's own shutdown
                    return
                except Exception:  # a bug handling one message: say so, keep watching
                    log.exception("could not handle a message from the head; watching on")

        self._watcher = threading.Thread(target=loop, name="hybridlb-head-watch", daemon=True)
        self._watcher.start()

    def _rejoin(self, on_back) -> bool:
        """Register again until a head takes this node (see ``watch``); whether it rejoined."""
        said = None
        while True:
            time.sleep(REJOIN_INTERVAL_S)
            try:
                accepted = self.join(self.registration, REJOIN_INTERVAL_S)
            except ClusterError as exc:  # no head yet, or it refuses us (once: it may still hold our old link)
                if str(exc) != said and not str(exc).startswith("no answer"):
                    log.warning("%s; registering again every %.0f s", exc, REJOIN_INTERVAL_S)
                said = str(exc)
                continue
            if not on_back(accepted):
                return False
            try:
                self.wait_cluster_ready(self.registration.start_rank, HEAD_START_S)
            except ClusterError as exc:
                log.warning("the head took this node back but the cluster did not come up: %s; trying again", exc)
                continue
            return True

    def close(self) -> None:
        self.context.destroy(linger=0)
