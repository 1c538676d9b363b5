"""Faults at the wire: a ZMQ proxy between one API server and one engine.

The API server connects to the proxy's ROUTER as if it were the engine; for each API
server identity the proxy dials the engine with a DEALER of the same identity and moves
frames both ways, applying ``Faults`` to what the engine sends (``EngineOutputs`` only,
so the readiness handshake always gets through) and to the requests it is sent.
"""

from __future__ import annotations

import heapq
import itertools
import random
import threading
import time
from dataclasses import dataclass

import zmq

from hybridlb.protocol import AddRequest, EngineOutputs, from_engine_decoder, to_engine_decoder


@dataclass
class Faults:
    """Probabilities per message, and a delay for every engine output."""

    drop: float = 0.0  # an EngineOutputs vanishes
    duplicate: float = 0.0  # it arrives twice
    reorder: float = 0.0  # it is held back and arrives after the next one
    delay_s: float = 0.0  # every EngineOutputs arrives this much later (order kept)
    drop_adds: int = 0  # this many of the next AddRequests vanish
    seed: int = 0


@dataclass
class Counts:
    forwarded: int = 0
    dropped: int = 0
    duplicated: int = 0
    reordered: int = 0
    adds_dropped: int = 0


class ChaosProxy(threading.Thread):
    def __init__(self, engine_address: str, front_address: str):
        super().__init__(name="chaos-proxy", daemon=True)
        self.engine_address = engine_address
        self.context = zmq.Context()
        self.front = self.context.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.LINGER, 0)
        self.front.setsockopt(zmq.SNDHWM, 0)
        self.front.bind(front_address)
        self.address = front_address
        self.backs: dict[bytes, zmq.Socket] = {}
        self.faults = Faults()
        self.counts = Counts()
        self._random = random.Random(0)
        self._due: list[tuple[float, int, bytes, bytes]] = []  # (when, order, identity, payload)
        self._order = itertools.count()
        self._held: dict[bytes, bytes] = {}  # identity -> a message held back to swap with the next
        self._halt = threading.Event()

    def set_faults(self, faults: Faults) -> None:
        """Apply ``faults`` from now on (a fresh random sequence from its seed)."""
        self._random = random.Random(faults.seed)
        self.faults, self.counts = faults, Counts()

    def stop(self) -> None:
        self._halt.set()
        self.join(5)

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        while not self._halt.is_set():
            for sock, _ in poller.poll(timeout=self._wait_ms()):
                if sock is self.front:
                    self._inbound(poller, *self.front.recv_multipart())
                else:
                    self._outbound(sock.getsockopt(zmq.IDENTITY), sock.recv())
            self._release_due()
        for sock in [self.front, *self.backs.values()]:
            sock.close(linger=0)
        self.context.term()

    def _wait_ms(self) -> int:
        if not self._due:
            return 20
        return max(0, min(20, int((self._due[0][0] - time.monotonic()) * 1000)))

    def _inbound(self, poller: zmq.Poller, identity: bytes, payload: bytes) -> None:
        back = self.backs.get(identity)
        if back is None:
            back = self.backs[identity] = self.context.socket(zmq.DEALER)
            back.setsockopt(zmq.IDENTITY, identity)
            back.setsockopt(zmq.LINGER, 0)
            back.connect(self.engine_address)
            poller.register(back, zmq.POLLIN)
        message = to_engine_decoder.decode(payload)
        if isinstance(message, AddRequest) and self.counts.adds_dropped < self.faults.drop_adds:
            self.counts.adds_dropped += 1
            return
        back.send(payload)

    def _outbound(self, identity: bytes, payload: bytes) -> None:
        faults, chance = self.faults, self._random.random
        if not isinstance(from_engine_decoder.decode(payload), EngineOutputs):
            self._deliver(identity, payload)
            return
        if chance() < faults.drop:
            self.counts.dropped += 1
            return
        copies = 2 if chance() < faults.duplicate else 1
        self.counts.duplicated += copies - 1
        held = self._held.pop(identity, None)
        if held is None and chance() < faults.reorder:
            self._held[identity] = payload
            self.counts.reordered += 1
            return
        for message in [payload] * copies + ([held] if held is not None else []):
            if faults.delay_s:
                heapq.heappush(self._due, (time.monotonic() + faults.delay_s, next(self._order), identity, message))
            else:
                self._deliver(identity, message)

    def _release_due(self) -> None:
        now = time.monotonic()
        while self._due and self._due[0][0] <= now:
            _, _, identity, payload = heapq.heappop(self._due)
            self._deliver(identity, payload)
        # A message held for reordering goes out on its own if nothing follows it soon.
        for identity in list(self._held):
            if self._random.random() < 0.05:
                self._deliver(identity, self._held.pop(identity))

    def _deliver(self, identity: bytes, payload: bytes) -> None:
        self.counts.forwarded += 1
        self.front.send_multipart([identity, payload])
