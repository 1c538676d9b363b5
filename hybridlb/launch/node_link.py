"""A non-head node's line to the head (``hybridlb.launch.handshake`` is the head's side): join,
report ready, wait for the barrier, then watch the heartbeats, give up when the head goes
quiet or register again, and say so when this node stops in order."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from typing import TYPE_CHECKING

import zmq
from zmq.utils.monitor import parse_monitor_message

from hybridlb.config import Config
from hybridlb.launch.handshake import (
    HANDSHAKE_FAILED,
    HEAD_SILENCE_S,
    HEAD_START_S,
    PROBE_S,
    REJOIN_INTERVAL_S,
    ClusterError,
)
from hybridlb.protocol import ClusterReady, Heartbeat, NodeLeaving, NodeReady, NodeRejected, Shutdown, encoder
from hybridlb.protocol import from_head_decoder as decoder
from hybridlb.transport import cluster_token, connect_securely, speaks_curve

if TYPE_CHECKING:
    from hybridlb.protocol import NodeAccepted, RegisterNode

log = logging.getLogger(__name__)


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
            message = decoder.decode(self.socket.recv())
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

    def leave(self) -> None:
        """Tell the head this node stops in order (``NodeLeaving``), then close."""
        if self.registration is not None and self.lost is None:
            with contextlib.suppress(zmq.ZMQError):
                self.socket.send(encoder.encode(NodeLeaving(self.registration.start_rank)), zmq.NOBLOCK)
            self.context.destroy(linger=1000)
        self.close()

    def close(self) -> None:
        self.context.destroy(linger=0)
