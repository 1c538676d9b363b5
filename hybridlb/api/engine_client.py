"""An API server's asyncio connection to one engine.

The DEALER socket carries requests out and outputs back (``hybridlb.protocol``). A
socket monitor watches the connection: when the engine process dies (or, across
nodes, stops answering ZMTP heartbeats) every in-flight request of that engine fails
at once instead of hanging, and the engine counts as down until it says ``EngineReady``
again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from hybridlb.api.balance import load_score
from hybridlb.api.prefix_index import PrefixIndex
from hybridlb.protocol import (
    AbortRequests,
    AddRequest,
    EngineOutputs,
    EngineReady,
    EngineStats,
    Hello,
    RequestOutput,
    SamplingParams,
    describe,
    encoder,
    from_engine_decoder,
    is_newer,
)
from hybridlb.transport import connect_securely

log = logging.getLogger(__name__)
_HEARTBEAT_MS = 1000
_HEARTBEAT_TIMEOUT_MS = 5000


class EngineUnavailable(RuntimeError):
    """The engine is not (or no longer) ready; requests on it fail with 503."""


class EngineConnection:
    def __init__(self, rank: int, address: str, client_id: str, context: zmq.asyncio.Context, on_stats=None,
                 token: str | None = None):
        self.rank = rank
        self.address = address
        self.client_id = client_id
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, client_id.encode())
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_MS)
        self.socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)
        self.monitor = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        connect_securely(self.socket, address, token)
        self.socket.connect(address)
        self.streams: dict[str, asyncio.Queue] = {}
        self.info: EngineReady | None = None
        self.alive = False
        self.stats: EngineStats | None = None
        self.prefix: PrefixIndex | None = None  # what this server sent that the engine may still cache
        self.on_stats = on_stats
        self._ready = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._send(Hello(self.client_id))
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._watch())]

    async def wait_ready(self, timeout_s: float) -> EngineReady:
        await asyncio.wait_for(self._ready.wait(), timeout_s)
        return self.info

    @property
    def in_flight(self) -> int:
        return len(self.streams)

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            wave: int = 0) -> asyncio.Queue:
        """Send a request; its outputs (or an EngineUnavailable) arrive on the returned queue."""
        if not self.alive:
            raise EngineUnavailable(f"engine {self.rank} is not available")
        queue: asyncio.Queue = asyncio.Queue()
        self.streams[request_id] = queue
        self._send(AddRequest(request_id, prompt_token_ids, params, wave))
        return queue

    def release(self, request_id: str, abort: bool) -> None:
        """Forget a request's stream; ``abort`` also stops it in the engine."""
        self.streams.pop(request_id, None)
        if abort and self.alive:
            self._send(AbortRequests([request_id]))

    def _send(self, message) -> None:
        self.socket.send(encoder.encode(message), copy=False)

    async def _read(self) -> None:
        while True:
            frames = await self.socket.recv_multipart(copy=False)
            if len(frames) != 1:
                log.warning("engine %d sent a message of %d frames (expected one); dropped", self.rank, len(frames))
                continue
            try:
                message = from_engine_decoder.decode(frames[0].buffer)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("engine %d sent a malformed message: %s", self.rank, describe(exc))
                continue
            if isinstance(message, EngineOutputs):
                self._dispatch(message.outputs)
                if message.stats is not None:
                    self.update_stats(message.stats)
                if message.evicted and self.prefix is not None:
                    self.prefix.forget(message.evicted)
            elif isinstance(message, EngineReady):
                self.info, self.alive = message, True
                # A (re)started engine's cache starts empty.
                self.prefix = PrefixIndex(message.num_kv_blocks) if message.prefix_caching else None
                self._ready.set()
                log.info("engine %d ready at %s", self.rank, self.address)

    def update_stats(self, stats: EngineStats) -> None:
        """Take ``stats`` if newer than what we have (direct from the engine or via the coordinator)."""
        if not is_newer(stats, self.stats):
            return
        self.stats = stats
        if self.on_stats:
            self.on_stats(stats)

    @property
    def score(self) -> int:
        """Load for balancing (``balance.load_score``)."""
        waiting, running = (self.stats.num_waiting, self.stats.num_running) if self.stats else (0, 0)
        return load_score(waiting, running, len(self.streams))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            queue = self.streams.get(output.request_id)
            if queue is not None:  # else: already released (stop string, disconnect)
                queue.put_nowait(output)

    async def _watch(self) -> None:
        while True:
            event = parse_monitor_message(await self.monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED and self.alive:
                self._mark_down(f"engine {self.rank} disconnected")
            elif event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED and self.info is not None and not self.alive:
                self._send(Hello(self.client_id))  # a restarted engine: register again

    def _mark_down(self, reason: str) -> None:
        log.error("%s; failing its %d in-flight requests", reason, len(self.streams))
        self.alive = False
        self._ready.clear()
        failure = EngineUnavailable(reason)
        for queue in self.streams.values():
            queue.put_nowait(failure)
        self.streams.clear()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.socket.disable_monitor()
        self.monitor.close(linger=0)
        self.socket.close(linger=0)
