"""An API server's end of a resize (``hybridlb.launch.scaling`` holds the whole story).

``ScaleLink`` connects to the launcher's socket when the server starts, hands it the scale
requests of this server's clients (``POST /scale_elastic_ep``) and carries out the launcher's
orders on this server's engine pool: connect to new ranks and send them traffic once they
answer; retire leaving ranks (no new requests, in-flight ones drained, the rest moved).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Client

import msgspec

from hybridlb.api.dispatch.engine_client import EngineConnection
from hybridlb.api.dispatch.pool import EnginePool

log = logging.getLogger(__name__)
READY_TIMEOUT_S = 120.0  # a new rank, already ready for the launcher, to answer this server too
DRAIN_POLL_S = 0.1
LAUNCHER_GONE = (503, "the node's launcher is not answering (it is stopping or gone); the node cannot be resized now")


class ScaleLink:
    def __init__(self, address: str, key: bytes, pool: EnginePool, connect: Callable[[int, str], EngineConnection],
                 on_added: Callable[[EngineConnection], None], on_removed: Callable[[int], None],
                 on_resized: Callable[[str, str], None]):
        """``connect(rank, address)``: a started connection to a new engine; ``on_added`` /
        ``on_removed``: what else follows a rank that came or went; ``on_resized(trigger,
        direction)``: a resize to count (the launcher tells one API server of the node)."""
        self.pool, self.connect, self.on_added, self.on_removed = pool, connect, on_added, on_removed
        self.on_resized = on_resized
        self.connection = Client(address, family="AF_UNIX", authkey=key)
        self.lock = threading.Lock()
        self.loop = asyncio.get_running_loop()
        self.pending: dict[int, asyncio.Future] = {}
        self.ids = itertools.count(1)
        self.scaling = False  # a resize runs on this node (whichever API server it came through)
        self.gone = False  # the launcher's socket closed
        self.tasks: set[asyncio.Task] = set()
        threading.Thread(target=self._read, name="scale-link", daemon=True).start()

    def _send(self, message: dict) -> None:
        with self.lock:
            self.connection.send_bytes(msgspec.json.encode(message))

    def _read(self) -> None:
        try:
            while True:
                message = msgspec.json.decode(self.connection.recv_bytes())
                self.loop.call_soon_threadsafe(self._take, message)
        except (EOFError, OSError, msgspec.DecodeError, RuntimeError):  # the launcher or this loop stopped
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits
                self.loop.call_soon_threadsafe(self._lost)

    def _lost(self) -> None:
        """The launcher's socket closed: no answer will come for the resizes asked for."""
        self.gone = True
        for future in self.pending.values():
            if not future.done():
                future.set_result(LAUNCHER_GONE)
        self.pending.clear()

    def _take(self, message: dict) -> None:
        op = message.get("op")
        if op == "done":
            future = self.pending.pop(message["id"], None)
            if future is not None and not future.done():
                future.set_result((message["status"], message["message"]))
        elif op == "state":
            self.scaling = bool(message["scaling"])
        elif op == "resized":
            self.on_resized(str(message["trigger"]), str(message["direction"]))
        elif op == "sync":
            task = asyncio.create_task(self._sync({int(rank): str(address) for rank, address in message["engines"]}))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        elif op in ("add", "retire"):
            task = asyncio.create_task(self._carry_out(message))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def scale(self, size: int, drain_timeout_s: float) -> tuple[int, str]:
        """Ask the launcher to resize the node to ``size`` ranks: (HTTP status, message)."""
        if self.gone:
            return LAUNCHER_GONE
        request_id = next(self.ids)
        future = self.pending[request_id] = self.loop.create_future()
        try:
            self._send({"op": "scale", "id": request_id, "size": size, "drain_timeout": drain_timeout_s})
        except OSError:
            self.pending.pop(request_id, None)
            return LAUNCHER_GONE
        return await future

    async def _carry_out(self, order: dict) -> None:
        try:
            if order["op"] == "add":
                await self._add([(int(rank), str(address)) for rank, address in order["engines"]])
            else:
                await self._retire([int(rank) for rank in order["ranks"]], float(order["drain_timeout"]))
        except Exception:
            log.exception("could not carry out the launcher's %s order", order["op"])
        self._send({"op": "ack", "id": order["id"]})

    async def _add(self, engines: list[tuple[int, str]]) -> None:
        connections = [self.connect(rank, address) for rank, address in engines if rank not in self.pool.by_rank]
        await asyncio.gather(*(c.wait_ready(READY_TIMEOUT_S) for c in connections))
        for connection in connections:
            self.pool.add(connection)
            self.on_added(connection)
        log.info("ranks %s joined this server's engines (now %s)", [c.rank for c in connections],
                 [e.rank for e in self.pool.engines])

    async def _sync(self, wanted: dict[int, str]) -> None:
        """The launcher's rank set when this server connected: a server restarted with the engines
        it first had (Ray restarts an actor with its first arguments) drops ranks that left and
        connects to ranks that came since."""
        try:
            gone = [rank for rank in self.pool.by_rank if rank not in wanted]
            for engine in self.pool.remove(gone):
                await engine.close()
                self.on_removed(engine.rank)
            if missing := [(rank, address) for rank, address in wanted.items() if rank not in self.pool.by_rank]:
                await self._add(missing)
        except Exception:
            log.exception("could not take the node's current ranks")

    async def _retire(self, ranks: list[int], drain_timeout_s: float) -> None:
        leaving = [self.pool.by_rank[rank] for rank in ranks if rank in self.pool.by_rank]
        for engine in leaving:
            engine.draining = True
        deadline = time.monotonic() + drain_timeout_s
        while any(engine.streams for engine in leaving) and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        for engine in leaving:
            if engine.streams:  # still running at the drain timeout: they go on on the ranks that stay
                engine.fail_all(f"engine {engine.rank} is leaving the node (a resize; its drain timeout of "
                                f"{drain_timeout_s:g} s passed)", "scale_down", logging.WARNING)
        for engine in self.pool.remove(ranks):
            await engine.close()
            self.on_removed(engine.rank)
        log.info("ranks %s left this server's engines (now %s)", ranks, [e.rank for e in self.pool.engines])

    def close(self) -> None:
        self.connection.close()
