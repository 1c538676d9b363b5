"""The engine's I/O thread: every socket front ends reach, kept off the busy loop.

It owns the ROUTER socket (see ``hybridlb.protocol``) and, for MoE with expert
parallelism, the SUB socket of the coordinator's wave messages. It decodes what arrives
into the inbox queue, and forwards what the busy loop puts in the outbox (an inproc
socket) to the right front end. A front end a message cannot reach is reported on
``gone``; an exception here puts ``IO_FAILED`` in the inbox, and the engine stops.
"""

from __future__ import annotations

import logging
import queue
import threading

import msgspec
import zmq

from hybridlb.protocol import FRONT_END_SILENCE_S, StartWave, decode_routed, error_text, to_engine_decoder
from hybridlb.transport import connect_securely, serve_securely

log = logging.getLogger(__name__)
IO_FAILED = object()  # put in the inbox when this thread dies


class IOThread(threading.Thread):
    """Moves frames between the ROUTER socket and the busy loop's queues."""

    def __init__(self, context: zmq.Context, address: str, outbox_address: str, inbox: queue.Queue,
                 waves: str | None, rank: int, max_message_bytes: int, token: str | None = None):
        super().__init__(name="engine-io", daemon=True)
        self.router = context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        # Mandatory routing: a send to a front end that is gone fails instead of vanishing,
        # so the busy loop stops sending it stats (``gone``).
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A front end that reconnects (after this engine was frozen, or the link was cut) takes
        # over its identity at once, even before the old connection's end is noticed here;
        # without this its Hello could go to a pipe that is about to close.
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # No limit on what waits for a slow front end (an API server stalled by a GC pause
        # gets every output when it resumes); one that answers no ping is cut off instead.
        self.router.setsockopt(zmq.SNDHWM, 0)
        self.router.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        self.router.setsockopt(zmq.HEARTBEAT_TIMEOUT, FRONT_END_SILENCE_S * 1000)
        self.router.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        serve_securely(self.router, address, token)
        self.router.bind(address)
        self.endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)  # a port 0 resolved
        self.outbox = context.socket(zmq.PULL)
        self.outbox.bind(outbox_address)
        self.waves = None
        if waves is not None:
            self.waves = context.socket(zmq.SUB)
            self.waves.setsockopt(zmq.LINGER, 0)
            self.waves.setsockopt(zmq.SUBSCRIBE, b"")
            connect_securely(self.waves, waves, token)
            self.waves.connect(waves)
        self.inbox, self.rank = inbox, rank
        # Front ends a message could not reach: (identity, why). The busy loop aborts their requests.
        self.gone: queue.SimpleQueue[tuple[bytes, str]] = queue.SimpleQueue()

    def run(self) -> None:
        try:
            self._loop()
        except Exception:  # a bug: without this thread the engine is deaf, so it must not look alive
            log.exception("engine %d: the I/O thread failed; stopping the engine", self.rank)
            self.inbox.put(IO_FAILED)
        finally:
            for sock in (self.router, self.outbox, self.waves):
                if sock is not None:
                    sock.close(linger=0)

    def _loop(self) -> None:
        poller = zmq.Poller()
        for sock in (self.router, self.outbox, self.waves):
            if sock is not None:
                poller.register(sock, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self.outbox in ready:
                frames = self.outbox.recv_multipart()
                if not frames[0]:  # empty identity: stop
                    return
                self._forward(frames)
            if self.router in ready:
                self._receive(self.router.recv_multipart())
            if self.waves is not None and self.waves in ready:
                self._wave(self.waves.recv())

    def _forward(self, frames: list[bytes]) -> None:
        try:
            self.router.send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                self.gone.put((frames[0], "it disconnected"))
            elif exc.errno == zmq.EAGAIN:  # cannot happen without a send limit; never drop silently
                self.gone.put((frames[0], "its queue is full"))
            else:
                raise

    def _wave(self, payload: bytes) -> None:
        try:
            message = to_engine_decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("dropped a malformed wave message: %s", error_text(exc))
            return
        if isinstance(message, StartWave) and message.rank != self.rank:
            self.inbox.put((b"", message))

    def _receive(self, frames: list[bytes]) -> None:
        if (routed := decode_routed(frames, to_engine_decoder, log)) is None:
            return
        identity, message = routed
        if isinstance(message, StartWave):  # only the coordinator starts waves, on its own socket
            log.warning("dropped a StartWave sent by a front end")
            return
        self.inbox.put((identity, message))
