"""The coordinator: one process per cluster (``hybridlb:coordinator``), on the head node.

Protocol (the sockets are documented in ``hybridlb.protocol``):

* Engines PUSH ``EngineStats`` to its PULL socket whenever their load changes, and at
  least every second; the coordinator keeps the newest (``epoch``, ``seq``) per rank. A
  rank silent for ``LOST_AFTER_S`` (its engine or its whole node died, or the network
  cut it off) is listed in the snapshot's ``lost_ranks`` until it reports again.
* It PUBlishes a ``LoadSnapshot`` of every rank to all API servers at most every 100 ms
  while stats change, and every second regardless (a heartbeat: API servers that hear
  nothing for 3 s report the coordinator lost). An idle cluster costs one wake-up a second.
* It keeps no state that engines cannot rebuild, so a restarted coordinator (same
  addresses) picks up where the old one stopped within a second.
* Dense models: that is all — no waves, no messages to engines (``wave_messages`` stays
  0) — and stats are taken in one batch per publish interval (at 512 engines × 10 Hz:
  11% of a core instead of 28% waking per message).
* MoE with expert parallelism (a ``waves_address`` is given): the coordinator also keeps
  the wave state. ``StartWave(w)`` from a paused engine that got a request: if ``w`` is
  newer than the current wave, or is the current one and it is not running, the wave
  runs and ``StartWave(w)`` goes out to every other engine. ``WaveComplete(w)`` from rank
  0 (no rank had work): the current wave becomes ``w + 1``, not running. Every wave change
  is published to the API servers at once (they stamp new requests with it). While a wave
  runs, ``StartWave`` is repeated every second: a rank that missed it (PUB drops messages
  to a subscriber that is reconnecting) still joins, and the others ignore a wave they
  are already in or past.
"""

from __future__ import annotations

import logging
import time

import msgspec
import zmq

from hybridlb import lifecycle
from hybridlb.protocol import (
    COORDINATOR_LIMIT,
    EngineStats,
    LoadSnapshot,
    RankCount,
    StartWave,
    WaveComplete,
    encoder,
    error_text,
    is_newer,
    to_coordinator_decoder,
)
from hybridlb.transport import serve_securely

log = logging.getLogger(__name__)
PUBLISH_INTERVAL_S = 0.1
HEARTBEAT_INTERVAL_S = 1.0
LOST_AFTER_S = 3.0  # three missed engine heartbeats


class Coordinator:
    def __init__(self, stats_address: str, loads_address: str, size: int, waves_address: str | None = None,
                 token: str | None = None):
        """``token``: the cluster token; peers on TCP must know it (``hybridlb.transport``)."""
        self.size = size
        self.context = zmq.Context()
        self.stats_in = self.context.socket(zmq.PULL)
        self.stats_in.setsockopt(zmq.MAXMSGSIZE, COORDINATOR_LIMIT)
        serve_securely(self.stats_in, stats_address, token)
        self.stats_in.bind(stats_address)
        self.loads_out = self.context.socket(zmq.PUB)
        self.loads_out.setsockopt(zmq.LINGER, 0)
        self.loads_out.setsockopt(zmq.MAXMSGSIZE, COORDINATOR_LIMIT)  # what a PUB takes in: subscriptions
        serve_securely(self.loads_out, loads_address, token)
        self.loads_out.bind(loads_address)
        self.waves_out = None
        if waves_address is not None:
            self.waves_out = self.context.socket(zmq.PUB)
            self.waves_out.setsockopt(zmq.LINGER, 0)
            self.waves_out.setsockopt(zmq.MAXMSGSIZE, COORDINATOR_LIMIT)
            serve_securely(self.waves_out, waves_address, token)
            self.waves_out.bind(waves_address)
        self.latest: dict[int, EngineStats] = {}
        self.heard: dict[int, float] = {}  # rank → when its last message arrived
        self.epoch_heard: dict[int, float] = {}  # rank → when the epoch of its latest stats last spoke
        self.started = time.monotonic()
        self.current_wave = 0
        self.running = False
        self.wave_messages = 0
        self.waves_completed = 0
        self.changed = False
        self.last_publish = 0.0
        self.last_wave_repeat = 0.0
        self.stopping = False
        self.snapshot = LoadSnapshot(engines=[])

    def receive(self, payload: bytes) -> None:
        if self.stats_in.get(zmq.RCVMORE):  # the first frame of several: take the rest, drop it all
            frames = 1 + len(self.stats_in.recv_multipart())
            log.warning("dropped a message of %d frames (expected one)", frames)
            return
        try:
            message = to_coordinator_decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("dropped a malformed message (%d bytes): %s", len(payload), error_text(exc))
            return
        if isinstance(message, EngineStats):
            self._stats(message)
        elif isinstance(message, RankCount):
            self.resize(message.size)
        elif self.waves_out is None:
            log.warning("dropped a %s: this cluster has no waves (dense model)", type(message).__name__)
        elif not 0 <= message.wave < 2**62:  # far from overflowing the wire's int64 as it counts up
            log.warning("dropped a %s for wave %d, out of range", type(message).__name__, message.wave)
        elif isinstance(message, StartWave):
            self._start_wave(message)
        else:
            self._wave_complete(message)

    def _stats(self, stats: EngineStats) -> None:
        if not 0 <= stats.rank < self.size:
            log.warning("dropped stats from rank %d, outside 0..%d", stats.rank, self.size - 1)
            return
        now = time.monotonic()
        if now - self.heard.get(stats.rank, self.started) > LOST_AFTER_S:
            self.changed = True  # back from the dead: say so now
        self.heard[stats.rank] = now
        latest = self.latest.get(stats.rank)
        if is_newer(stats, latest, now - self.epoch_heard.get(stats.rank, now)):
            self.latest[stats.rank] = latest = stats
            self.changed = True
        if stats.epoch == latest.epoch:
            self.epoch_heard[stats.rank] = now  # when the epoch we hold last spoke

    def resize(self, size: int) -> None:
        """The cluster's ranks are now 0..size-1 (a resize, ``hybridlb.launch.scaling``): forget
        the ranks above; a new rank counts as lost only after LOST_AFTER_S without a report."""
        if not 1 <= size <= 2**16:
            log.warning("dropped a rank count of %d", size)
            return
        now = time.monotonic()
        for rank in range(self.size, size):
            self.heard.setdefault(rank, now)
        for rank in range(size, self.size):
            for held in (self.latest, self.heard, self.epoch_heard):
                held.pop(rank, None)
        log.info("the cluster has %d ranks (was %d)", size, self.size)
        self.size, self.changed = size, True

    def _start_wave(self, message: StartWave) -> None:
        self.wave_messages += 1
        if message.wave > self.current_wave or (message.wave == self.current_wave and not self.running):
            self.current_wave, self.running = message.wave, True
            if self.waves_out is not None:
                self.waves_out.send(encoder.encode(message))
                self.last_wave_repeat = time.monotonic()
            self.last_publish = 0.0  # publish the change now

    def _wave_complete(self, message: WaveComplete) -> None:
        self.wave_messages += 1
        if message.wave >= self.current_wave:
            self.current_wave, self.running = message.wave + 1, False
            self.waves_completed += 1
            self.last_publish = 0.0

    def lost(self, now: float) -> list[int]:
        """Ranks not heard from for LOST_AFTER_S (never heard counts from the coordinator's start)."""
        return [rank for rank in range(self.size) if now - self.heard.get(rank, self.started) > LOST_AFTER_S]

    def due(self, now: float) -> bool:
        since = now - self.last_publish
        return (self.changed and since >= PUBLISH_INTERVAL_S) or since >= HEARTBEAT_INTERVAL_S

    def publish(self, now: float) -> None:
        self.snapshot = LoadSnapshot(
            engines=[self.latest[r] for r in sorted(self.latest)], current_wave=self.current_wave,
            engines_running=self.running, wave_messages=self.wave_messages, waves_completed=self.waves_completed,
            lost_ranks=self.lost(now),
        )
        self.loads_out.send(encoder.encode(self.snapshot))
        if self.running and self.waves_out is not None and now - self.last_wave_repeat >= HEARTBEAT_INTERVAL_S:
            self.waves_out.send(encoder.encode(StartWave(self.current_wave, -1)))
            self.last_wave_repeat = now
        self.changed = False
        self.last_publish = now

    def stop(self) -> None:
        """Ask ``run`` to return (signal-safe: it only sets a flag the loop checks within a second)."""
        self.stopping = True

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.stats_in, zmq.POLLIN)
        while not self.stopping:
            now = time.monotonic()
            wait_s = (PUBLISH_INTERVAL_S if self.changed else HEARTBEAT_INTERVAL_S) - (now - self.last_publish)
            if poller.poll(max(0, int(wait_s * 1000)) + 1):
                if self.waves_out is None:
                    # Dense: nothing is urgent before the next snapshot may go out, so let stats
                    # queue until then and take them in one wake-up (many engines: far fewer wake-ups).
                    time.sleep(max(0.0, PUBLISH_INTERVAL_S - (time.monotonic() - self.last_publish)))
                while True:  # drain everything queued before publishing
                    try:
                        self.receive(self.stats_in.recv(zmq.NOBLOCK))
                    except zmq.Again:
                        break
            now = time.monotonic()
            if self.due(now):
                self.publish(now)
        self.context.destroy(linger=0)


def run_coordinator(stats_address: str, loads_address: str, size: int, waves_address: str | None = None,
                    token: str | None = None) -> None:
    """Entry point of the coordinator process."""
    lifecycle.set_title("hybridlb:coordinator")
    lifecycle.configure_logging("hybridlb:coordinator")
    lifecycle.die_with_parent()
    lifecycle.leave_interrupts_to_the_launcher()
    coordinator = Coordinator(stats_address, loads_address, size, waves_address, token)
    lifecycle.on_terminate(coordinator.stop)
    log.info("coordinator for %d ranks: stats in %s, loads out %s", size, stats_address, loads_address)
    coordinator.run()
