"""An API server's asyncio connection to one engine.

The DEALER socket carries requests out and outputs back (``hybridlb.protocol``). A
socket monitor watches the connection: when the engine process dies (or, across
nodes, stops answering ZMTP heartbeats) every in-flight request of that engine fails
at once instead of hanging, and the engine counts as down until it says ``EngineReady``
again.

Nothing fails silently: the engine numbers its messages to us, so a lost one (a gap in
``seq``) fails and aborts this connection's requests at once; an exception in the reader
or the monitor fails them too and registers again (the engine then aborts whatever of
ours it still runs); and ``Frontend`` gives up on a request the engine has said nothing
about for ``api.request_timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from hybridlb import lifecycle
from hybridlb.api.dispatch.balance import RankView, load_score
from hybridlb.api.dispatch.evacuation import Evacuation
from hybridlb.api.dispatch.lora import HeldAdapters
from hybridlb.api.dispatch.prefix_index import PrefixIndex
from hybridlb.params import LoRARequest, SamplingParams
from hybridlb.protocol import (
    AbortRequests,
    AddRequest,
    EngineOutputs,
    EngineReady,
    EngineStats,
    Hello,
    LoadAdapters,
    RequestOutput,
    encoder,
    engine_input_limit,
    error_text,
    from_engine_decoder,
    is_newer,
)
from hybridlb.transport import connect_securely

log = logging.getLogger(__name__)
_HEARTBEAT_MS = 1000
_HEARTBEAT_TIMEOUT_MS = 5000
# An engine on this host (IPC): libzmq's own I/O thread answers pings however busy the engine's
# loop is, so only a frozen or hung process misses them; find it sooner than across a network.
_LOCAL_HEARTBEAT_MS = 500
_LOCAL_HEARTBEAT_TIMEOUT_MS = 2000
STALL_STEPS = 3.0  # an engine silent for this many of its longest steps is stuck (stall_limit_s)
STALL_GRACE_S = 0.5  # a watchdog tick this late means the API server itself was not running


MESSAGE_MARGIN_BYTES = 64 * 2**10  # kept below the engine's frame limit (engine_input_limit)


class MessageTooLarge(ValueError):
    """A request whose AddRequest would exceed the engine's frame limit: libzmq would drop the
    whole connection (every request of this server on that engine) rather than the one message."""


class EngineUnavailable(RuntimeError):
    """The engine is not (or no longer) ready; requests on it move on or fail with 503."""

    def __init__(self, message: str, reason: str = "engine_down", evacuation: Evacuation | None = None):
        super().__init__(message)
        self.reason = reason  # for hybridlb:lost_requests_total
        self.evacuation = evacuation  # one failure of requests in flight: each settles how it ended

    def settle(self, outcome: str, request_id: str) -> None:
        """Say how a request this failure took off its engine ended (``Evacuation.settle``)."""
        if self.evacuation is not None:
            self.evacuation.settle(outcome, request_id)


class EngineConnection:
    def __init__(self, rank: int, address: str, client_id: str, context: zmq.asyncio.Context, on_stats=None,
                 token: str | None = None, on_lost=None, stall_s: float = 0.0):
        self.rank = rank
        self.stall_s = stall_s  # api.engine_stall_s: silent this long with requests in flight is stuck
        self.last_heard = time.monotonic()
        self.address = address
        self.client_id = client_id
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, client_id.encode())
        self.socket.setsockopt(zmq.LINGER, 0)
        local = address.startswith("ipc://")
        self.socket.setsockopt(zmq.HEARTBEAT_IVL, _LOCAL_HEARTBEAT_MS if local else _HEARTBEAT_MS)
        self.socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, _LOCAL_HEARTBEAT_TIMEOUT_MS if local else _HEARTBEAT_TIMEOUT_MS)
        # Outputs queue here while the event loop is busy; the engine never drops them either.
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.monitor = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        connect_securely(self.socket, address, token)
        self.socket.connect(address)
        self.streams: dict[str, asyncio.Queue] = {}
        # request id -> its prompt tokens the engine still has to prefill (as estimated when
        # sent), until its first output: the queue a new prompt's first token waits behind
        self.prefilling: dict[str, int] = {}
        # request id -> how many more tokens it may generate (its max_tokens, else up to the
        # model length), counted down as they arrive: how long it will keep the rank busy
        self.budgets: dict[str, int] = {}
        self.held = HeldAdapters()  # the LoRA adapters the rank holds, as far as this server knows
        self.info: EngineReady | None = None
        self.alive = False
        self.draining = False  # leaving the node (a resize): takes no new request
        self.stats: EngineStats | None = None
        self._epoch_heard = time.monotonic()  # when the epoch of ``stats`` last spoke (is_newer)
        self.prefix: PrefixIndex | None = None  # what this server sent that the engine may still cache
        self.on_stats = on_stats
        self.on_lost = on_lost  # (rank, reason, count): requests whose clients its failures cost, for metrics
        self.on_ready: Callable[[EngineConnection], None] | None = None  # each time the engine is (again) ready
        self.seq = 0  # the last EngineOutputs number taken since EngineReady
        self._ready = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._send(Hello(self.client_id))
        loops = [("reader", self._read), ("connection watch", self._watch)]
        if self.stall_s:
            loops.append(("stall watch", self._watch_stall))
        self._tasks = [asyncio.create_task(lifecycle.supervised(f"engine {self.rank}'s {what}", loop))
                       for what, loop in loops]

    async def wait_ready(self, timeout_s: float) -> EngineReady:
        await asyncio.wait_for(self._ready.wait(), timeout_s)
        return self.info

    @property
    def in_flight(self) -> int:
        return len(self.streams)

    @property
    def queue_full(self) -> bool:
        """By its latest stats, the engine would refuse a new request (engine.max_queued_requests)."""
        limit = self.info.max_queued_requests if self.info is not None else 0
        return bool(limit) and self.stats is not None and self.stats.num_waiting >= limit

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            wave: int = 0, cached_tokens: int = 0, resumed: list[int] | None = None) -> asyncio.Queue:
        """Send a request; its outputs (or an EngineUnavailable) arrive on the returned queue.
        ``cached_tokens``: how much of the prompt the engine is expected to find cached;
        ``resumed``: a migrated request's output so far (AddRequest.resumed)."""
        resumed = resumed or []
        if not self.alive:
            raise EngineUnavailable(f"engine {self.rank} is not available")
        frame = encoder.encode(AddRequest(request_id, prompt_token_ids, params, wave, resumed))
        if len(frame) > (limit := engine_input_limit(self.info.max_model_len) - MESSAGE_MARGIN_BYTES):
            raise MessageTooLarge(f"this request takes {len(frame)} bytes on its way to an engine, more than the "
                                  f"{limit} an engine takes; shorten its prompt, stop strings, bad_words, "
                                  "allowed_token_ids or grammar")
        queue: asyncio.Queue = asyncio.Queue()
        self.streams[request_id] = queue
        self.prefilling[request_id] = max(0, len(prompt_token_ids) + len(resumed) - cached_tokens)
        self.budgets[request_id] = self.output_budget(len(prompt_token_ids), params, len(resumed))
        self.socket.send(frame, copy=False)
        self.held.record(params.lora)
        return queue

    def release(self, request_id: str, abort: bool) -> None:
        """Forget a request's stream; ``abort`` also stops it in the engine (queued while the
        engine is unreachable: if it comes back without having restarted, it still runs it)."""
        self.streams.pop(request_id, None)
        self.prefilling.pop(request_id, None)
        self.budgets.pop(request_id, None)
        if abort:
            self._send(AbortRequests([request_id]))

    def load_adapters(self, adapters: list[LoRARequest]) -> None:
        """Have the engine read these LoRA adapters now (engine.lora.load eager)."""
        if self.alive and adapters:
            self._send(LoadAdapters(adapters))

    def _send(self, message) -> None:
        if not self.socket.closed:  # closed: a rank retired by a resize, whose last requests moved on
            self.socket.send(encoder.encode(message), copy=False)

    async def _read(self) -> None:
        while True:
            frames = await self.socket.recv_multipart(copy=False)
            self.last_heard = time.monotonic()
            try:
                self._take(frames)
            except Exception:  # a bug in handling: fail what we cannot vouch for, then start over
                log.exception("engine %d: could not handle its message", self.rank)
                self._resync("an error in the API server while handling its output", "reader_error")

    def _take(self, frames) -> None:
        if len(frames) != 1:
            log.warning("engine %d sent a message of %d frames (expected one); dropped", self.rank, len(frames))
            return
        try:
            message = from_engine_decoder.decode(frames[0].buffer)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("engine %d sent a malformed message: %s", self.rank, error_text(exc))
            return
        if isinstance(message, EngineOutputs):
            if not self._in_sequence(message.seq):
                return
            self._dispatch(message.outputs)
            if message.stats is not None:
                self.update_stats(message.stats)
            if self.prefix is not None:
                if message.stored:
                    self.prefix.record(message.stored)
                if message.evicted:
                    self.prefix.forget(message.evicted)
        elif isinstance(message, EngineReady):
            self.info, self.alive, self.seq = message, True, 0
            # A (re)started engine's cache starts empty.
            self.prefix = PrefixIndex(message.num_kv_blocks) if message.prefix_caching else None
            self._ready.set()
            log.info("engine %d ready at %s", self.rank, self.address)
            if self.on_ready is not None:
                self.on_ready(self)

    def _in_sequence(self, seq: int) -> bool:
        """Check an EngineOutputs number: False for a duplicate (skip it); a gap fails every
        request of this connection, since any of them may have lost its finish."""
        if not self.alive:  # outputs from before we (re)registered: their requests are failed already
            return False
        if seq <= self.seq:
            log.warning("engine %d: skipped a repeated message (%d after %d)", self.rank, seq, self.seq)
            return False
        if seq > self.seq + 1:
            lost = seq - self.seq - 1
            self.fail_all(f"engine {self.rank}: {lost} output messages were lost on the way", "lost_output")
        self.seq = seq
        return True

    def fail_all(self, reason: str, kind: str, log_level: int = logging.ERROR) -> None:
        """Take every in-flight request off this connection (each moves on or fails: its
        runner decides and counts it, see ``Evacuation``) and abort them in the engine."""
        moves = kind != "shutdown"  # this server stopping: nowhere to go
        if self.streams:
            what = "moving its %d in-flight requests to other engines (failing any that cannot move)" if moves \
                else "failing its %d in-flight requests"
            log.log(log_level, "%s: " + what, reason, len(self.streams))
        failure = EngineUnavailable(reason, kind, Evacuation(self.rank, kind, len(self.streams), self.on_lost, moves))
        ids = list(self.streams)
        for queue in self.streams.values():
            queue.put_nowait(failure)
        self.streams.clear()
        self.prefilling.clear()
        self.budgets.clear()
        if ids and self.alive:
            self._send(AbortRequests(ids))

    def _resync(self, reason: str, kind: str) -> None:
        """Start over with the engine: fail our requests, register again (the engine aborts
        whatever of ours it still runs and answers EngineReady)."""
        self.fail_all(f"engine {self.rank}: {reason}", kind)
        self.alive = False
        self._ready.clear()
        self._send(Hello(self.client_id))

    def update_stats(self, stats: EngineStats) -> None:
        """Take ``stats`` if newer than what we have (direct from the engine or via the coordinator)."""
        now = time.monotonic()
        if not is_newer(stats, self.stats, now - self._epoch_heard):
            if self.stats is not None and stats.epoch == self.stats.epoch:
                self._epoch_heard = now
            return
        self._epoch_heard = now
        self.stats = stats
        if self.on_stats:
            self.on_stats(stats)

    @property
    def _reported(self) -> tuple[int, int]:
        """(waiting, running) by the engine's latest stats."""
        return (self.stats.num_waiting, self.stats.num_running) if self.stats else (0, 0)

    @property
    def score(self) -> int:
        """Load for balancing (``balance.load_score``)."""
        return load_score(*self._reported, len(self.streams))

    @property
    def requests(self) -> int:
        """Requests on the rank: its stats' waiting + running, or this server's in flight if more."""
        return max(sum(self._reported), len(self.streams))

    def adapters(self) -> set[str]:
        """The LoRA adapters the rank holds or soon will (``HeldAdapters``)."""
        return self.held.names(self.stats.lora_loaded if self.stats is not None else [])

    def output_budget(self, prompt_tokens: int, params: SamplingParams, done: int = 0) -> int:
        """How many tokens a request may still generate here: its ``max_tokens`` less the
        ``done`` a migrated one already has, bounded by the model length."""
        room = (self.info.max_model_len if self.info is not None else 1 << 20) - prompt_tokens - done
        wanted = params.max_tokens - done if params.max_tokens is not None else room
        return max(1, min(wanted, room))

    def decode_load(self, budget: int) -> float:
        """The requests on the rank a new one generating up to ``budget`` tokens would decode
        beside, each weighted by the share of those steps it is still there for
        (``balance.RankView.decode_load``): this server's own by their remaining budgets,
        requests only the stats show (other API servers') as there for all of them."""
        own = sum(min(max(0, left), budget) for left in self.budgets.values()) / max(1, budget)
        return own + max(0, sum(self._reported) - len(self.budgets))

    def cache_view(self, hashes: list[int], budget: int = 1) -> RankView:
        """What ``cache_aware`` weighs for this rank, for a prompt with block ``hashes`` that
        may generate ``budget`` tokens."""
        return RankView(requests=self.requests,
                        prefill_tokens=sum(self.prefilling.values()),
                        cached_tokens=self.cached_tokens(hashes),
                        pressure=len(self.prefix) / self.prefix.capacity if self.prefix is not None else 0.0,
                        decode_load=self.decode_load(budget))

    def cached_tokens(self, hashes: list[int]) -> int:
        """How many leading prompt tokens (of block ``hashes``) this server believes the rank caches."""
        if self.prefix is None or self.info is None or not hashes:
            return 0
        return self.prefix.matched(hashes) * self.info.block_size

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            self.prefilling.pop(output.request_id, None)  # its first output: prefilled
            if output.request_id in self.budgets:
                self.budgets[output.request_id] -= len(output.new_token_ids)
            queue = self.streams.get(output.request_id)
            if queue is not None:  # else: already released (stop string, disconnect)
                queue.put_nowait(output)

    async def _watch(self) -> None:
        while True:
            event = parse_monitor_message(await self.monitor.recv_multipart())
            try:
                if event["event"] == zmq.EVENT_DISCONNECTED and self.alive:
                    self._mark_down(f"engine {self.rank} disconnected")
                elif event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED and self.info is not None and not self.alive:
                    self._send(Hello(self.client_id))  # a restarted engine: register again
            except Exception:
                log.exception("engine %d: could not handle a connection event", self.rank)
                self._resync("an error in the API server while watching the connection", "reader_error")

    async def _watch_stall(self) -> None:
        """An engine whose loop is stuck (its I/O thread may still answer ZMTP pings) sends no
        output and no heartbeat: with requests in flight for ``stall_s``, fail them (they move
        to another engine) and ask it to register again; it counts as down until it answers."""
        period = min(1.0, self.stall_s / 4)  # the limit only grows from stall_s
        while True:
            started = time.monotonic()
            await asyncio.sleep(period)
            now = time.monotonic()
            if now - started > period + STALL_GRACE_S or self.socket.get(zmq.EVENTS) & zmq.POLLIN:
                continue  # this process was stalled, or the engine's news is waiting unread: not its fault
            silent = now - self.last_heard
            if self.alive and self.streams and silent > self.stall_limit_s:
                try:
                    self._resync(f"sent nothing for {silent:.0f} s with requests in flight (api.engine_stall_s, "
                                 f"{STALL_STEPS:g}x its longest step): its loop is stuck", "stuck")
                except Exception:
                    log.exception("engine %d: could not fail its stuck requests", self.rank)

    @property
    def stall_limit_s(self) -> float:
        """How long the engine may stay silent with requests in flight: api.engine_stall_s, or
        STALL_STEPS times the longest step it says it may take (a step is silent throughout)."""
        longest = self.stats.longest_step_s if self.stats is not None else 0.0
        return max(self.stall_s, STALL_STEPS * longest)

    def _mark_down(self, reason: str, log_level: int = logging.ERROR) -> None:
        self.fail_all(reason, "engine_down", log_level)
        self.alive = False
        self._ready.clear()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.socket.disable_monitor()
        self.monitor.close(linger=0)
        self.socket.close(linger=0)
