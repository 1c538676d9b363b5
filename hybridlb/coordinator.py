"""The coordinator: one process per cluster (``hybridlb:coordinator``), on the head node.

Protocol (the sockets are documented in ``hybridlb.protocol``):

* Engines PUSH ``EngineStats`` to its PULL socket whenever their load changes; the
  coordinator keeps the newest (highest ``seq``) per rank.
* It PUBlishes a ``LoadSnapshot`` of every rank to all API servers at most every 100 ms
  while stats change, and every second regardless (a heartbeat API servers can use to
  see the coordinator is alive). An idle cluster costs one wake-up a second.
* Dense models: that is all — no waves, no messages to engines (``wave_messages`` stays
  0). MoE wave coordination adds to this loop.
"""

from __future__ import annotations

import logging
import time

import msgspec
import zmq

from hybridlb import lifecycle
from hybridlb.protocol import EngineStats, LoadSnapshot, encoder, stats_decoder

log = logging.getLogger(__name__)
PUBLISH_INTERVAL_S = 0.1
HEARTBEAT_INTERVAL_S = 1.0


class Coordinator:
    def __init__(self, stats_address: str, loads_address: str, size: int):
        self.size = size
        self.context = zmq.Context()
        self.stats_in = self.context.socket(zmq.PULL)
        self.stats_in.bind(stats_address)
        self.loads_out = self.context.socket(zmq.PUB)
        self.loads_out.setsockopt(zmq.LINGER, 0)
        self.loads_out.bind(loads_address)
        self.latest: dict[int, EngineStats] = {}
        self.changed = False
        self.last_publish = 0.0
        self.stopping = False
        self.snapshot = LoadSnapshot(engines=[])

    def receive(self, payload: bytes) -> None:
        try:
            stats = stats_decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("dropped a malformed stats message (%d bytes): %s", len(payload), exc)
            return
        if not 0 <= stats.rank < self.size:
            log.warning("dropped stats from rank %d, outside 0..%d", stats.rank, self.size - 1)
            return
        current = self.latest.get(stats.rank)
        if current is None or stats.seq > current.seq:
            self.latest[stats.rank] = stats
            self.changed = True

    def due(self, now: float) -> bool:
        since = now - self.last_publish
        return (self.changed and since >= PUBLISH_INTERVAL_S) or since >= HEARTBEAT_INTERVAL_S

    def publish(self, now: float) -> None:
        self.snapshot = LoadSnapshot(engines=[self.latest[r] for r in sorted(self.latest)])
        self.loads_out.send(encoder.encode(self.snapshot))
        self.changed = False
        self.last_publish = now

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.stats_in, zmq.POLLIN)
        while not self.stopping:
            now = time.monotonic()
            wait_s = (PUBLISH_INTERVAL_S if self.changed else HEARTBEAT_INTERVAL_S) - (now - self.last_publish)
            if poller.poll(max(0, int(wait_s * 1000)) + 1):
                while True:  # drain everything queued before publishing
                    try:
                        self.receive(self.stats_in.recv(zmq.NOBLOCK))
                    except zmq.Again:
                        break
            now = time.monotonic()
            if self.due(now):
                self.publish(now)
        self.context.destroy(linger=0)


def run_coordinator(stats_address: str, loads_address: str, size: int) -> None:
    """Entry point of the coordinator process."""
    lifecycle.set_title("hybridlb:coordinator")
    lifecycle.configure_logging("hybridlb:coordinator")
    lifecycle.die_with_parent()
    coordinator = Coordinator(stats_address, loads_address, size)
    lifecycle.on_terminate(lambda: setattr(coordinator, "stopping", True))
    log.info("coordinator for %d ranks: stats in %s, loads out %s", size, stats_address, loads_address)
    coordinator.run()
