"""Resizing a running ``hybridlb serve`` node: elastic data parallelism, in vLLM's spelling
(``POST /scale_elastic_ep {"new_data_parallel_size": N, "drain_timeout": S}`` on an API server).

The launcher (``hybridlb:serve``) listens on a Unix socket in the node's private runtime
directory (``ScaleControl``); each of its API servers connects to it when it starts
(``hybridlb.api.dispatch.scaling.ScaleLink``) and hands it the scale requests its clients send.
One resize runs at a time, while the node serves on:

* **Growing** from n to m ranks: the launcher starts engines n..m-1 (each with the node's cores
  split m ways; running ranks keep their threads), waits until each says it is ready, tells the
  coordinator the cluster has m ranks, and has every API server connect to them; the answer
  goes out once every API server sends them traffic.
* **Shrinking**: every API server stops sending new requests to ranks m..n-1, lets their
  in-flight requests finish for up to ``drain_timeout`` seconds, moves what is still running to
  the remaining ranks (a migration: the stream goes on from its tokens, no gap) and drops them;
  then the launcher stops their engines and tells the coordinator.

An API server that restarts later gets the current rank set. What is refused, with the
reason: a cluster of several nodes, MoE expert parallelism, multi-port nodes, more ranks than
the node has cores, a second resize while one runs. Orders and answers are JSON documents
over the socket (``multiprocessing.connection``, authenticated with a key drawn per run).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import queue
import secrets
import threading
from multiprocessing.connection import Connection, Listener

import msgspec
import zmq

from hybridlb.engine.core_share import CoreShare, shared_cores
from hybridlb.engine.dp_context import DPContext
from hybridlb.engine.spawn import (
    EngineStartError,
    default_torch_threads,
    engine_cores,
    start_engine,
    stop_engines,
    wait_until_ready,
)
from hybridlb.protocol import RankCount, encoder
from hybridlb.transport import connect_securely

log = logging.getLogger("hybridlb.serve")
START_TIMEOUT_S = 600.0  # a new rank's start (model load) before the resize fails
ORDER_GRACE_S = 60.0  # an API server's answer to an order, beyond its drain timeout


def resizable(plan) -> bool:
    """Whether a node of ``plan`` can be resized (``ScaleControl.refusal`` says why not)."""
    return not plan.multi_node and not plan.lockstep and plan.mode != "multi_port"


def capacity() -> int:
    """The most ranks a node may grow to: one per CPU core."""
    return os.cpu_count() or 1


def growth_room(plan) -> int:
    """Slots the node's shared-cores table keeps for ranks a resize may add (0: none): an engine
    stepping alone takes the cores of the ranks not stepping, so a grown node splits its cores
    among its ranks instead of oversubscribing them (``hybridlb.engine.core_share``)."""
    return capacity() if resizable(plan) else 0


class MainThreadCalls:
    """Work a resize hands to the node's main thread: processes started there. Linux sends a
    child its parent-death signal (``lifecycle.die_with_parent``) when the *thread* that forked
    it exits, so an engine started on a resize's own thread would be stopped with it."""

    def __init__(self):
        self.calls: queue.Queue = queue.Queue()
        # The main thread's wait wakes when this is readable: a call, or a stop (``wake`` is signal-safe).
        self.readable, self._writable = os.pipe()
        os.set_blocking(self._writable, False)
        os.set_blocking(self.readable, False)

    def call(self, fn, timeout_s: float = 60.0):
        """``fn()``'s result, run on the main thread at its next turn (``run_pending``)."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self.calls.put((fn, done))
        self.wake()
        return done.result(timeout_s)

    def wake(self) -> None:
        with contextlib.suppress(OSError):  # full (a wake is pending anyway) or closed (stopped)
            os.write(self._writable, b"!")

    def close(self) -> None:
        for fd in (self.readable, self._writable):
            with contextlib.suppress(OSError):
                os.close(fd)

    def run_pending(self) -> None:
        with contextlib.suppress(OSError):  # nothing to read, or closed
            os.read(self.readable, 4096)
        while True:
            try:
                fn, done = self.calls.get_nowait()
            except queue.Empty:
                return
            try:
                done.set_result(fn())
            except BaseException as exc:
                done.set_exception(exc)


class ScaleError(Exception):
    """A resize refused or failed: ``status`` is the HTTP status its client gets."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class _Link:
    """One API server's connection, with the orders sent on it that await its answer."""

    def __init__(self, connection: Connection):
        self.connection = connection
        self.lock = threading.Lock()
        self.answers: dict[int, threading.Event] = {}
        self.alive = True

    def send(self, message: dict) -> None:
        with self.lock:
            self.connection.send_bytes(msgspec.json.encode(message))


class ScaleControl:
    """The launcher's end: takes scale requests from the node's API servers and carries them out."""

    def __init__(self, ranks, runtime_dir: str):
        """``ranks``: what starts and stops the node's engines (``ProcessRanks`` for ``serve``,
        ``hybridlb.launch.ray_scaling.RayRanks`` for ``up``); the socket goes in ``runtime_dir``."""
        self.ranks = ranks
        self.address = os.path.join(runtime_dir, "scale.sock")
        self.key = secrets.token_bytes(32)
        self.listener = Listener(self.address, family="AF_UNIX", authkey=self.key)
        self.links: list[_Link] = []
        self.busy = threading.Lock()
        self.size = ranks.count()
        self.orders = 0
        threading.Thread(target=self._accept, name="scale-control", daemon=True).start()

    # -- connections ------------------------------------------------------------------------
    def _accept(self) -> None:
        while True:
            try:
                connection = self.listener.accept()
            except OSError:  # closed: the node stops
                return
            except Exception as exc:  # a peer without the key, or one that hung up mid-handshake
                log.warning("refused a connection to the scale control socket: %s", exc)
                continue
            link = _Link(connection)
            self.links.append(link)
            if resizable(self.ranks.plan):  # every API server fronts all the node's ranks (not multi-port)
                with contextlib.suppress(OSError):  # one restarted with the engines it first had catches up
                    link.send({"op": "sync", "engines": self.ranks.current()})
            threading.Thread(target=self._read, args=(link,), name="scale-link", daemon=True).start()

    def _read(self, link: _Link) -> None:
        try:
            while True:
                message = msgspec.json.decode(link.connection.recv_bytes())
                if message.get("op") == "scale":
                    threading.Thread(target=self._serve, args=(link, message), name="scale", daemon=True).start()
                elif (event := link.answers.get(message.get("id"))) is not None:
                    event.set()
        except (EOFError, OSError, msgspec.DecodeError):
            pass
        finally:  # a stopped or restarted API server: nothing more to wait for from it
            link.alive = False
            for event in link.answers.values():
                event.set()
            if link in self.links:
                self.links.remove(link)

    def _serve(self, link: _Link, message: dict) -> None:
        try:
            status, text = 200, self.scale(int(message["size"]), float(message["drain_timeout"]))
        except ScaleError as exc:
            status, text = exc.status, str(exc)
        except Exception as exc:
            log.exception("the resize failed")
            status, text = 500, f"the resize failed: {exc}"
        with contextlib.suppress(OSError):
            link.send({"op": "done", "id": message["id"], "status": status, "message": text})

    def _broadcast(self, order: dict, timeout_s: float) -> None:
        """Send ``order`` to every API server and wait for each one's answer (or its exit)."""
        self.orders += 1
        order = {**order, "id": self.orders}
        waiting = []
        for link in list(self.links):
            event = link.answers[self.orders] = threading.Event()
            try:
                link.send(order)
            except OSError:
                continue
            waiting.append((link, event))
        for link, event in waiting:
            if not event.wait(timeout_s) and link.alive:
                raise ScaleError(500, f"an API server did not carry out {order['op']} within {timeout_s:.0f} s")
            link.answers.pop(self.orders, None)

    # -- the resize ---------------------------------------------------------------------------
    def refusal(self, size: int) -> str | None:
        plan = self.ranks.plan
        if plan.multi_node:
            return ("resizing is supported on one-node clusters for now; this cluster spans "
                    f"{len(plan.nodes)} nodes")
        if plan.lockstep or self.ranks.config.engine.expert_parallel:
            return "resizing MoE expert parallelism is not supported yet (the experts would have to move)"
        if plan.mode == "multi_port":
            return "resizing a multi-port node is not supported yet (each rank has its own port and API server)"
        if size < 1:
            return f"new_data_parallel_size must be at least 1, not {size}"
        if size > (room := self.ranks.capacity()):
            return f"this node has room for at most {room} ranks ({self.ranks.room_unit}); asked for {size}"
        return None

    def scale(self, size: int, drain_timeout_s: float, trigger: str = "api") -> str:
        if (refusal := self.refusal(size)) is not None:
            raise ScaleError(400, refusal)
        if not self.busy.acquire(blocking=False):
            raise ScaleError(409, "a resize is already running; try again when GET /is_scaling_elastic_ep says false")
        try:
            before = self.size
            self._state(True)
            if size > before:
                self._grow(size)
            elif size < before:
                self._shrink(size, drain_timeout_s)
            log.info("resized from %d to %d ranks", before, size)
            if size != before:
                self._count(trigger, "up" if size > before else "down")
            return f"Scaled to {size} data parallel engines"
        finally:
            self._state(False)
            self.busy.release()

    def _count(self, trigger: str, direction: str) -> None:
        """One API server counts the resize (several sharing /metrics would each count it)."""
        for link in list(self.links):
            try:
                link.send({"op": "resized", "trigger": trigger, "direction": direction})
                return
            except OSError:
                continue

    def _state(self, scaling: bool) -> None:
        for link in list(self.links):
            with contextlib.suppress(OSError):
                link.send({"op": "state", "scaling": scaling})

    def _grow(self, size: int) -> None:
        added = self.ranks.start(range(self.size, size), size)  # ScaleError after rolling back
        self.size = size  # they run: a later failure leaves them in place, for the API servers to pick up
        self.ranks.tell_coordinator(size)
        self.ranks.respec(lambda engines: engines + tuple(added))
        self._broadcast({"op": "add", "engines": added}, START_TIMEOUT_S)

    def _shrink(self, size: int, drain_timeout_s: float) -> None:
        ranks = list(range(size, self.size))
        log.info("shrinking to %d ranks: draining ranks %s (up to %.0f s, then moving what runs)", size, ranks,
                 drain_timeout_s)
        self.ranks.respec(lambda engines: tuple(e for e in engines if e[0] < size))
        self._broadcast({"op": "retire", "ranks": ranks, "drain_timeout": drain_timeout_s},
                        drain_timeout_s + ORDER_GRACE_S)
        self.size = size
        self.ranks.stop(ranks)
        self.ranks.tell_coordinator(size)

    def close(self) -> None:
        self.listener.close()
        for link in list(self.links):
            link.connection.close()


class ProcessRanks:
    """The ranks of a ``hybridlb serve`` node (``hybridlb.launch.node.Node``): engine processes the
    launcher starts (on its main thread) and stops, the API servers' specs it restarts them with,
    and the coordinator it starts again with the current size."""

    room_unit = "one per CPU core"

    def __init__(self, node):
        self.node = node
        self.plan, self.config = node.plan, node.config

    def count(self) -> int:
        return len(self.node.engines)

    def capacity(self) -> int:
        return capacity()

    def start(self, ranks: range, size: int) -> list[tuple[int, str]]:
        """Start the engines of ``ranks`` in a cluster of ``size``: their (rank, address) once ready;
        ScaleError (none left running) where one cannot start."""
        node = self.node
        threads = default_torch_threads(node.config.engine, size)
        shared = node.shared
        config = node.config.engine
        sharing = config.share_cores and not config.torch_threads
        for rank in ranks:
            dp = DPContext(rank, size, shared.coordinator_stats, shared.coordinator_waves, shared.rendezvous,
                           node.token, None)
            cores = shared_cores(node.runtime_dir, "cores", rank, capacity(), engine_cores()) if sharing else None
            engine = config.for_rank(rank, None, node.config.served_model_name)
            node.engine_args[rank] = (engine, rank, node.engine_address(rank), threads, dp, cores)
        started = node.main_thread.call(lambda: [start_engine(*node.engine_args[r]) for r in ranks])
        log.info("growing to %d ranks: started engines %s (%d threads each)", size, [e.rank for e in started], threads)
        try:
            wait_until_ready(started, START_TIMEOUT_S, node.token)
        except EngineStartError as exc:
            stop_engines(started)
            for engine in started:
                node.engine_args.pop(engine.rank, None)
            raise ScaleError(500, f"the resize to {size} ranks failed and was rolled back: {exc}") from None
        node.engines.extend(started)  # watched (and restarted by policy) from now on
        return [(engine.rank, engine.address) for engine in started]

    def stop(self, ranks: list[int]) -> None:
        node = self.node
        leaving = [engine for engine in node.engines if engine.rank in ranks]
        shares = []
        for engine in leaving:  # no longer watched: their exit is no death to restart
            node.engines.remove(engine)
            shares.append(node.engine_args.pop(engine.rank)[-1])
        stop_engines(leaving)
        for share in filter(None, shares):  # a killed engine may not have marked itself idle
            CoreShare(share).close()

    def current(self) -> list[tuple[int, str]]:
        """The engines the node's API servers front now."""
        return list(self.node.api_args[0][1].engines) if self.node.api_args else []

    def respec(self, change) -> None:
        """What a restarted API server gets: the node's engines after the resize."""
        node = self.node
        for index, (config, spec, *rest) in enumerate(node.api_args):
            node.api_args[index] = (config, dataclasses.replace(spec, engines=change(spec.engines)), *rest)

    def tell_coordinator(self, size: int) -> None:
        self.node.tell_coordinator(size)


def send_rank_count(stats_address: str, token: str | None, size: int) -> None:
    """Tell the coordinator listening at ``stats_address`` that the cluster now has ``size`` ranks."""
    context = zmq.Context.instance()
    sock = context.socket(zmq.PUSH)
    connect_securely(sock, stats_address, token)
    sock.connect(stats_address)
    sock.send(encoder.encode(RankCount(size)))
    sock.close(linger=2000)
