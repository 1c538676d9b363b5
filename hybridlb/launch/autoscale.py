"""Autoscaling a one-node ``hybridlb serve`` (the config's ``autoscaling`` section): the launcher
follows the coordinator's load snapshots and resizes the node through ``ScaleControl``.

Each second it counts the ongoing (running plus waiting) requests of every rank and wants
``ceil(ongoing / target_ongoing_requests)`` ranks, within ``min_replicas``..``max_replicas``.
Wanted for ``upscale_delay_s`` without a break, more ranks start; wanted for
``downscale_delay_s``, the highest ranks drain and stop (``drain_timeout_s``). A
resize already running (one asked for through the API) makes it wait for the next second.
Every decision goes to the log with its inputs and is counted in
``hybridlb:data_parallel_resizes_total{trigger="autoscaling"}``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time

import msgspec
import zmq

from hybridlb.config import AutoscalingConfig
from hybridlb.launch.scaling import ScaleControl, ScaleError
from hybridlb.protocol import LoadSnapshot, loads_decoder
from hybridlb.transport import connect_securely

log = logging.getLogger("hybridlb.serve")
INTERVAL_S = 1.0


def wanted_ranks(config: AutoscalingConfig, ongoing: int) -> int:
    """The ranks ``ongoing`` requests call for, within the bounds."""
    wanted = math.ceil(ongoing / config.target_ongoing_requests)
    return min(config.max_replicas, max(config.min_replicas, wanted))


class Decider:
    """When the wanted rank count has held long enough to act on (pure: tested without a node)."""

    def __init__(self, config: AutoscalingConfig):
        self.config = config
        self.since: float | None = None  # since when ``wanted`` has differed from the size, on one side
        self.direction = 0

    def decide(self, size: int, ongoing: int, now: float) -> int | None:
        """The size to resize to now, or None."""
        wanted = wanted_ranks(self.config, ongoing)
        direction = (wanted > size) - (wanted < size)
        if direction != self.direction:
            self.direction, self.since = direction, now
        if direction == 0:
            return None
        delay = self.config.upscale_delay_s if direction > 0 else self.config.downscale_delay_s
        return wanted if now - self.since >= delay else None

    def reset(self, now: float) -> None:
        """A resize happened: the next one waits its whole delay again."""
        self.direction, self.since = 0, now


class Autoscaler:
    """The launcher's thread that applies ``Decider`` to the coordinator's snapshots."""

    def __init__(self, config: AutoscalingConfig, control: ScaleControl, loads_address: str, token: str | None):
        self.config, self.control = config, control
        self.decider = Decider(config)
        self.stopping = threading.Event()
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        connect_securely(self.sub, loads_address, token)
        self.sub.connect(loads_address)
        self.snapshot: LoadSnapshot | None = None
        self.thread = threading.Thread(target=self._run, name="autoscaler", daemon=True)

    def start(self) -> None:
        log.info("autoscaling between %d and %d ranks, %.4g ongoing requests per rank (up after %.4g s, down after "
                 "%.4g s)", self.config.min_replicas, self.config.max_replicas, self.config.target_ongoing_requests,
                 self.config.upscale_delay_s, self.config.downscale_delay_s)
        self.thread.start()

    def _run(self) -> None:
        next_tick = time.monotonic() + INTERVAL_S
        while not self.stopping.is_set():
            if self.sub.poll(max(0, int((next_tick - time.monotonic()) * 1000)) + 1):
                with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                    self.snapshot = loads_decoder.decode(self.sub.recv())
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + INTERVAL_S
                if self.snapshot is not None:
                    self.tick(now)
        self.context.destroy(linger=0)

    def tick(self, now: float) -> None:
        size = self.control.size
        ongoing = sum(s.num_running + s.num_waiting for s in self.snapshot.engines if s.rank < size)
        target = self.decider.decide(size, ongoing, now)
        if target is None:
            return
        log.info("autoscaling: %d ongoing requests on %d ranks (target %.4g per rank) for %.0f s: resizing to %d",
                 ongoing, size, self.config.target_ongoing_requests, now - self.decider.since, target)
        try:
            self.control.scale(target, self.config.drain_timeout_s, trigger="autoscaling")
        except ScaleError as exc:
            log.warning("autoscaling: the resize to %d ranks did not happen: %s", target, exc)
            return
        self.decider.reset(now)

    def stop(self) -> None:
        self.stopping.set()


def start_autoscaler(config, control: ScaleControl, loads_address: str | None, token: str | None) -> Autoscaler | None:
    """The node's autoscaler, started, where ``config`` (the whole Config) has an autoscaling section."""
    if config.autoscaling is None or loads_address is None:
        return None
    autoscaler = Autoscaler(config.autoscaling, control, loads_address, token)
    autoscaler.start()
    return autoscaler
