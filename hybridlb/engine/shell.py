"""The engine process: ``EngineShell``, a thin ZMQ shell around EngineCore.

Threads:
* the I/O thread (``hybridlb.engine.io_thread``) owns the sockets front ends and the
  coordinator's waves reach; it fills the inbox queue and forwards the outbox.
* the main thread runs the busy loop: drain the inbox (blocking only when there is no
  work, so an idle engine sleeps), step the core (or, in lockstep, the wave), route
  outputs to their senders, publish load stats when they change.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing
import queue
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import zmq

from hybridlb import lifecycle
from hybridlb.config import EngineConfig
from hybridlb.engine.block_manager import Removed
from hybridlb.engine.core import EngineCore, SickEngine, make_core
from hybridlb.engine.core_share import CoreShare, SharedCores
from hybridlb.engine.dp_context import DPContext
from hybridlb.engine.io_thread import IO_FAILED, IOThread
from hybridlb.engine.kv_events import KVEventPublisher
from hybridlb.engine.lockstep import Lockstep
from hybridlb.engine.step_clock import LoopClock
from hybridlb.protocol import (
    AbortRequests,
    AddRequest,
    EngineOutputs,
    Hello,
    LoadAdapters,
    RequestOutput,
    StartWave,
    encoder,
    engine_input_limit,
)
from hybridlb.transport import connect_securely

if TYPE_CHECKING:
    from hybridlb.protocol import EngineReady, EngineStats

log = logging.getLogger(__name__)
_STOP = object()
STATS_HEARTBEAT_S = 1.0  # an idle engine still tells the coordinator and its front ends it is alive this often


class EngineFailed(RuntimeError):
    """The engine cannot go on (its I/O thread died); the process exits 1."""


@dataclass
class _Route:
    """Who gets what this step: outputs per front end identity."""

    by_client: dict[bytes, list[RequestOutput]]

    def add(self, identity: bytes, output: RequestOutput) -> None:
        self.by_client.setdefault(identity, []).append(output)


class EngineShell:
    def __init__(self, core: EngineCore, address: str, cores: SharedCores | None = None):
        """``cores``: the node's cores this engine shares with its siblings (real engines only)."""
        self.core = core
        self.cores = CoreShare(cores) if cores is not None and core.config.simulate is None else None
        dp = core.dp
        self.lockstep = Lockstep(core) if core.expert_parallel is not None else None
        self.context = zmq.Context()
        self.coordinator = None
        if dp.coordinator_stats is not None:
            self.coordinator = self.context.socket(zmq.PUSH)
            self.coordinator.setsockopt(zmq.LINGER, 0)
            self.coordinator.setsockopt(zmq.SNDHWM, 64)  # a coordinator that is gone must not block us
            connect_securely(self.coordinator, dp.coordinator_stats, dp.token)
            self.coordinator.connect(dp.coordinator_stats)
        self.inbox: queue.Queue = queue.Queue()
        outbox_address = f"inproc://outbox-{uuid.uuid4().hex}"
        waves = dp.coordinator_waves if self.lockstep else None
        self.io = IOThread(self.context, address, outbox_address, self.inbox, waves, dp.rank,
                            engine_input_limit(core.max_model_len), dp.token)
        self.outbox = self.context.socket(zmq.PUSH)
        self.outbox.setsockopt(zmq.LINGER, 0)
        self.outbox.connect(outbox_address)
        self.clients: set[bytes] = set()
        self.owners: dict[str, bytes] = {}
        self.sent: dict[bytes, int] = {}  # per front end: EngineOutputs sent since its EngineReady
        self.orphans_aborted = 0
        self.loop = LoopClock()
        self.last_stats: EngineStats | None = None
        self.stats_seq = 0
        self.epoch = time.time_ns()
        self.last_beat = 0.0  # when stats last went to the coordinator
        self.last_client_beat = 0.0  # when every front end last got a message
        self.stopping = False
        self.kv_events = None
        events = core.config.kv_events
        if events is not None and events.enabled and core.prefix_caching:
            self.kv_events = KVEventPublisher(events, self.context, dp.rank, core.block_size,
                                              core.config.device.upper())
        core.enable_cache_events()

    def stop(self) -> None:
        """Signal-safe: ask the busy loop to exit.

        The wake-up goes through another thread because a signal handler may run while
        this thread holds the queue's lock.
        """
        self.stopping = True
        threading.Thread(target=self.inbox.put, args=(_STOP,), daemon=True).start()

    def serve_forever(self) -> None:
        self.io.start()
        try:
            while not self.stopping:
                route = _Route({})
                busy = self._busy
                if self.cores is not None and not busy:
                    self.cores.idle()  # before waiting for work: our cores are free for the node's others
                self._drain(route, block=not busy)
                if self.stopping:
                    break
                if self.cores is not None and self._busy:
                    self.cores.stepping()
                outputs = self._step()
                self.loop.lap("step")
                for output in outputs:
                    self._route_output(route, output)
                self._publish(route)
                self.loop.lap("publish")
        finally:
            with contextlib.suppress(zmq.Again):  # an I/O thread that died reads no more
                self.outbox.send_multipart([b"", b""], zmq.NOBLOCK)
            self.io.join(timeout=2)
            if self.kv_events is not None:
                self.kv_events.close()
            self.context.destroy(linger=0)
            if self.cores is not None:
                self.cores.close()

    @property
    def _busy(self) -> bool:
        return self.core.has_work or (self.lockstep is not None and self.lockstep.running)

    def _step(self) -> list[RequestOutput]:
        if self.lockstep is None:
            return self.core.step() if self.core.has_work else []
        if not self.lockstep.running:
            return []
        outputs, complete = self.lockstep.step()
        if complete is not None:
            self._to_coordinator(complete)
        return outputs

    def _to_coordinator(self, message) -> None:
        if self.coordinator is not None:
            with contextlib.suppress(zmq.Again):
                self.coordinator.send(encoder.encode(message), zmq.NOBLOCK)

    def _drain(self, route: _Route, block: bool) -> None:
        try:
            item = self.inbox.get(block=block, timeout=STATS_HEARTBEAT_S if block else None)
        except queue.Empty:
            return
        finally:
            self.loop.lap("idle")
        try:
            while True:
                if item is _STOP:
                    self.stopping = True
                    return
                if item is IO_FAILED:
                    raise EngineFailed("the I/O thread failed")
                self._handle(route, *item)
                item = self.inbox.get_nowait()
        except queue.Empty:
            pass
        finally:
            self.loop.lap("take")

    def _handle(self, route: _Route, identity: bytes, message) -> None:
        """One inbox message, under its own error boundary: what fails here is that message's
        (a request that cannot be added gets its error output), never the engine's loop."""
        try:
            self._take(route, identity, message)
        except Exception as exc:
            log.exception("engine %d: could not handle a %s message", self.core.rank, type(message).__name__)
            if isinstance(message, AddRequest):  # add_request registers nothing that fails
                route.add(identity, RequestOutput(message.request_id, [], "error", error_kind="invalid", error=(
                    f"engine {self.core.rank} could not take this request: {type(exc).__name__}: {exc}")))

    def _take(self, route: _Route, identity: bytes, message) -> None:
        if isinstance(message, AddRequest):
            error = self.core.add_request(message.request_id, message.prompt_token_ids, message.params,
                                          message.resumed)
            if error is None:
                self.owners[message.request_id] = identity
                if self.lockstep is not None and (wake := self.lockstep.request_arrived(message.wave)):
                    self._to_coordinator(wake)
            else:  # straight back to the sender: a duplicate id must not take over the owner's route
                route.add(identity, error)
        elif isinstance(message, StartWave):
            if self.lockstep is not None:
                self.lockstep.start_wave(message.wave)
        elif isinstance(message, AbortRequests):
            ids = [i for i in message.request_ids if self.owners.get(i) == identity]
            for output in self.core.abort(ids):
                self._route_output(route, output)
        elif isinstance(message, LoadAdapters):
            if self.core.config.lora is not None:
                self.core.load_adapters(message.adapters)
            else:
                log.warning("engine %d: dropped a load_adapters message: it serves no LoRA adapters", self.core.rank)
        elif isinstance(message, Hello):  # a known front end starting over has given up on its requests
            self._abort_owned(identity, "it registered again")
            route.by_client.pop(identity, None)
            self.clients.add(identity)
            self.sent[identity] = 0
            self._send(identity, self._ready())

    def _abort_owned(self, identity: bytes, why: str) -> None:
        """Abort every request of front end ``identity`` (nobody will read their outputs)."""
        ids = [request_id for request_id, owner in self.owners.items() if owner == identity]
        for request_id in ids:
            del self.owners[request_id]
        if ids:
            self.core.abort(ids)
            self.orphans_aborted += len(ids)
            log.warning("engine %d: aborted %d requests of front end %s: %s", self.core.rank, len(ids),
                        identity.decode(errors="replace"), why)

    def _ready(self) -> EngineReady:
        return self.core.ready_message(dp_group=_in_dp_group())

    @property
    def address(self) -> str:
        """Where front ends reach this engine (the bound endpoint: a port 0 resolved)."""
        return self.io.endpoint

    def latest_stats(self) -> EngineStats:
        """The stats last published, or the core's own before any was."""
        return self.last_stats or self.core.stats()

    def _route_output(self, route: _Route, output: RequestOutput) -> None:
        identity = self.owners.get(output.request_id)
        if output.finish_reason is not None:
            self.owners.pop(output.request_id, None)
        if identity is not None:
            route.add(identity, output)

    def _publish(self, route: _Route) -> None:
        while not self.io.gone.empty():
            identity, why = self.io.gone.get()
            self.clients.discard(identity)
            self.sent.pop(identity, None)
            route.by_client.pop(identity, None)
            self._abort_owned(identity, why)
        now = time.monotonic()
        beat = now - self.last_client_beat >= STATS_HEARTBEAT_S
        stats = self._stats_if_changed(fresh=beat)
        stored, evicted = self._cache_events()
        if stats or evicted or stored or beat:  # news for all; a heartbeat lets a front end see a lost last message
            targets = self.clients | route.by_client.keys()
            self.last_client_beat = now
        else:
            targets = route.by_client.keys()
        carried = stats or (self.last_stats if beat else None)  # a heartbeat repeats the latest stats
        for identity in targets:
            seq = self.sent[identity] = self.sent.get(identity, 0) + 1
            outputs = route.by_client.get(identity, [])
            self._send(identity, EngineOutputs(self.core.rank, outputs, carried, evicted, seq, stored))
        if stats or now - self.last_beat >= STATS_HEARTBEAT_S:
            self._to_coordinator(self.last_stats)
            self.last_beat = now

    def _cache_events(self) -> tuple[list[int], list[int]]:
        """Publish this step's KV-cache events (if configured); return the stored and the
        evicted hashes, for every front end's prefix index."""
        events = self.core.take_cache_events()
        if self.kv_events is not None and events:
            self.kv_events.publish(events)
        held: dict[int, bool] = {}  # the last event of each block decides (stored, then evicted: gone)
        for event in events:
            held[event.block_hash] = not isinstance(event, Removed)
        return [h for h, kept in held.items() if kept], [h for h, kept in held.items() if not kept]

    def _stats_if_changed(self, fresh: bool = False) -> EngineStats | None:
        """New stats when the load changed; with ``fresh`` (a heartbeat) also when only what
        rides along did (counters, busy time, memory), so no reader's view is more than a
        heartbeat old."""
        stats = msgspec.structs.replace(self.core.stats(), orphans_aborted=self.orphans_aborted,
                                        borrowed_steps=self.cores.borrowed if self.cores else 0, **self.loop.stats())
        if self.lockstep is not None:
            stats = self.lockstep.annotate(stats)
        last = self.last_stats
        if last is not None and (msgspec.structs.replace(stats, seq=last.seq, epoch=last.epoch) == last if fresh
                                 else _load(last) == _load(stats)):
            return None
        self.stats_seq += 1
        self.last_stats = msgspec.structs.replace(stats, seq=self.stats_seq, epoch=self.epoch)
        return self.last_stats

    def _send(self, identity: bytes, message) -> None:
        self.outbox.send_multipart([identity, encoder.encode(message)])


def _in_dp_group() -> bool:
    """Whether this process joined a torch.distributed group (a simulated engine never loads torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized()


def _is_collective_failure(exc: Exception) -> bool:
    """Whether ``exc`` came from torch.distributed (a peer of the expert-parallel group is gone)."""
    torch = sys.modules.get("torch")
    backend_error = getattr(getattr(torch, "distributed", None), "DistError", ()) if torch is not None else ()
    text = str(exc).lower()
    return (bool(backend_error) and isinstance(exc, backend_error)) or any(
        word in text for word in ("gloo", "nccl", "connection closed by peer", "timed out"))


def _load(stats: EngineStats) -> tuple:
    """What makes stats news at once (dummy steps, busy time and counters ride along with the
    next change, or the next heartbeat)."""
    return stats.num_running, stats.num_waiting, stats.kv_usage, stats.wave, stats.running


def prepare_process(config: EngineConfig, torch_threads: int) -> None:
    """What every engine process sets up before loading its model (``serve``'s processes and
    Ray's actors alike): the allocator, and torch's threads (a simulated engine never imports torch)."""
    lifecycle.tune_allocator()
    if config.simulate is None:
        import torch

        torch.set_num_threads(torch_threads)


def run_engine(config: EngineConfig, dp: DPContext, address: str, torch_threads: int,
               errors: multiprocessing.connection.Connection | None = None, cores: SharedCores | None = None) -> None:
    """Entry point of an engine process: load the model, then serve until SIGTERM."""
    title = f"hybridlb:engine:{dp.rank}"
    lifecycle.set_title(title)
    lifecycle.configure_logging(title)
    lifecycle.die_with_parent()
    lifecycle.leave_interrupts_to_the_launcher()
    prepare_process(config, torch_threads)
    try:
        shell = EngineShell(make_core(config, dp), address, cores)
    except Exception as exc:
        log.error("engine %d failed to start: %s", dp.rank, exc)
        if errors is not None:
            errors.send(f"{type(exc).__name__}: {exc}")
        raise SystemExit(1) from None
    lifecycle.on_terminate(shell.stop)
    log.info("engine %d serving at %s (%s; %d KV blocks%s)", dp.rank, address, shell.core.label(),
             shell.core.num_kv_blocks, ", experts sharded, lockstep" if shell.lockstep else "")
    if config.simulate is not None:
        log.warning("engine %d is a %s: its speed says nothing about the model", dp.rank, shell.core.label())
    try:
        shell.serve_forever()
    except (EngineFailed, SickEngine) as exc:
        log.error("engine %d: %s; exiting", dp.rank, exc)
        raise SystemExit(1) from None
    except Exception as exc:  # a lockstep step (a dense step fails just its requests), or a bug in the loop
        if _is_collective_failure(exc):
            log.error("engine %d: the expert-parallel group broke (%s); exiting", dp.rank, exc)
        elif shell.lockstep is not None:
            log.exception("engine %d: a lockstep step failed; the other ranks cannot step without this one, "
                          "so the engine exits", dp.rank)
        else:
            log.exception("engine %d: its loop failed; exiting", dp.rank)
        raise SystemExit(1) from None
    log.info("engine %d stopped", dp.rank)
    gc.freeze()  # the interpreter's last collection would walk every object torch made: half a second
