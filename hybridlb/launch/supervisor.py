"""The node supervisor of multi-port mode (vLLM's ``--data-parallel-multi-port-external-lb``,
llm-d's pod shape since mid-2026).

In multi-port mode each local rank has an API server of its own on ``port + i``, so an
upstream picker can choose the rank (each rank port's own ``/health`` tells it which rank
serves); the supervisor answers for the whole pod on one port (``lb.supervisor_port``), where
the pod's probes point. A rank's restart is that rank's business: it neither takes the
healthy ranks out of the Service nor gets the pod killed.

* ``GET /ready``, ``/readyz`` (readiness): 503 until every rank has been up at the same time
  (the node finished starting), then 200 while at least one rank is up and no shutdown has
  begun. A rank is up once its ``/health`` answers 200; it is down after
  ``failure_threshold`` failed probes in a row, or at once when the launcher saw its process
  die (``mark_restarting``).
* ``GET /health`` (liveness, as vLLM and Kubernetes read it): 200 unless a rank was left dead
  (the launcher gave up restarting it: ``mark_failed``) or the supervisor is wedged (its prober
  has not finished a round in ``WEDGED_ROUNDS`` rounds' time); then 503, and the pod should be
  restarted. A rank being restarted does not touch it.

Every answer has the same JSON body: the node's status, whether it is live (and if not, why),
and each rank's port, whether it is up, its process id, its restarts and its last problem.

It probes every rank each ``interval_s`` seconds, each probe with ``timeout_s``, and logs a
probe at DEBUG: only a rank turning down (WARNING) or up (INFO) reaches the INFO log. It runs in
the node's launcher process (``hybridlb serve``) or a Ray actor (``hybridlb up``), as threads.
Its port is reachable from outside the pod, so its HTTP side is one thread (an asyncio loop):
a connection costs no thread, must send its request within ``READ_TIMEOUT_S``, and at most
``MAX_CONNECTIONS`` are held (a new one closes the oldest): idle or half-written connections
neither pile up threads nor keep a real probe, which asks and is answered at once, waiting.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http import HTTPStatus
from urllib.parse import urlsplit

log = logging.getLogger(__name__)
READINESS_PATHS = frozenset({"/ready", "/readyz"})
LIVENESS_PATHS = frozenset({"/health"})
READ_TIMEOUT_S = 2.0  # a probe's request is one short line and a few headers
MAX_CONNECTIONS = 64
MAX_REQUEST_BYTES = 8192
WEDGED_ROUNDS = 3  # probe rounds' time without a finished round before liveness fails


@dataclass
class Child:
    """One rank's API server as the supervisor sees it."""

    rank: int
    url: str  # where to probe it: http://host:port
    healthy: bool = False  # never up until a probe says so
    failures: int = 0  # failed probes in a row
    problem: str = "not probed yet"
    restarts: int = 0  # times the launcher brought it back
    failed: str | None = None  # why the launcher left it dead; final


class Supervisor:
    def __init__(self, host: str, port: int, children: dict[int, str], interval_s: float = 5.0,
                 timeout_s: float = 5.0, failure_threshold: int = 3, pid_of: Callable[[int], int | None] | None = None):
        """``children``: rank → the URL of its API server. ``pid_of(rank)``: that server's process id, if known."""
        self.children = {rank: Child(rank, url) for rank, url in sorted(children.items())}
        self.interval_s, self.timeout_s, self.failure_threshold = interval_s, timeout_s, failure_threshold
        self.pid_of = pid_of or (lambda rank: None)
        self.started = False  # every rank was up at once: the node finished starting
        self.shutting_down = False
        self._stop = threading.Event()
        self._last_round = time.monotonic()  # when the prober last finished probing every rank
        self._http = ProbeServer(host, port, self._answer)
        self.address = self._http.address
        self._prober = threading.Thread(target=self._probe_forever, name="supervisor-probe", daemon=True)

    def start(self) -> None:
        self._http.start()
        self._prober.start()

    def wait_ready(self, timeout_s: float) -> bool:
        """Probe every rank now and until all are up at once (or ``timeout_s``); whether they are."""
        deadline = time.monotonic() + timeout_s
        while not self.all_up and time.monotonic() < deadline:
            for child in self.children.values():
                if not child.healthy:
                    self._probe(child)
            if not self.all_up:
                time.sleep(0.1)
        return self.all_up

    def mark_restarting(self, rank: int, why: str) -> None:
        """The launcher saw this rank's server (or engine) die and brings it back: down now, not
        after the failed probes; the node stays ready while another rank serves, and live."""
        child = self.children[rank]
        child.healthy, child.failures, child.problem = False, self.failure_threshold, why
        child.restarts += 1

    def mark_failed(self, rank: int, why: str) -> None:
        """The launcher left this rank dead (its restarts exhausted, or a part it may not restart):
        only restarting the pod brings it back, so liveness fails from now on."""
        child = self.children[rank]
        child.healthy, child.failures, child.problem, child.failed = False, self.failure_threshold, why, why
        log.error("rank %d (%s) is left dead: %s; /health answers 503", rank, child.url, why)

    def begin_shutdown(self) -> None:
        """From now on readiness answers 503 (the node is stopping)."""
        self.shutting_down = True

    def stop(self) -> None:
        self.begin_shutdown()
        self._stop.set()
        self._http.stop()

    @property
    def all_up(self) -> bool:
        return all(child.healthy for child in self.children.values())

    @property
    def ready(self) -> bool:
        """Readiness: started, not stopping, and at least one rank serving."""
        return self.started and not self.shutting_down and any(c.healthy for c in self.children.values())

    def liveness_problem(self) -> str | None:
        """Why the pod should be restarted, or None while it is live."""
        failed = [f"rank {c.rank}: {c.failed}" for c in self.children.values() if c.failed]
        if failed:
            return "left dead by the launcher: " + "; ".join(failed)
        silent_s = time.monotonic() - self._last_round
        if silent_s > WEDGED_ROUNDS * (self.interval_s + self.timeout_s):
            return f"the supervisor's prober has not finished a round for {silent_s:.0f} s"
        return None

    def view(self) -> dict:
        """What the probe endpoints answer, for people and tools."""
        problem = self.liveness_problem()
        return {"status": self._status(), "live": problem is None, "liveness_problem": problem,
                "ranks": {str(c.rank): self._rank_view(c) for c in self.children.values()}}

    def _status(self) -> str:
        if self.shutting_down:
            return "shutting down"
        if not self.started:
            return "starting"
        if self.all_up:
            return "ready"
        return "degraded" if self.ready else "not ready"

    def _rank_view(self, child: Child) -> dict:
        return {"url": child.url, "port": urlsplit(child.url).port, "up": child.healthy,
                "pid": self.pid_of(child.rank), "restarts": child.restarts, "failed": child.failed is not None,
                "problem": None if child.healthy else child.problem}

    def _answer(self, path: str) -> tuple[int, dict]:
        if path in READINESS_PATHS:
            ok = self.ready
        elif path in LIVENESS_PATHS:
            ok = self.liveness_problem() is None
        else:
            return 404, {"error": f"no route GET {path}; the supervisor answers "
                                  f"{sorted(READINESS_PATHS | LIVENESS_PATHS)}"}
        return (200 if ok else 503), self.view()

    # -- probing ----------------------------------------------------------------------------
    def _probe_forever(self) -> None:
        with ThreadPoolExecutor(len(self.children), thread_name_prefix="supervisor-probe") as pool:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    list(pool.map(self._probe, self.children.values()))
                    self._last_round = time.monotonic()
                except Exception:  # never let the probes stop: a stopped prober would freeze the node's state
                    log.exception("supervisor: probing failed")
                self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))

    def _probe(self, child: Child) -> None:
        if child.failed:  # left dead: nothing will answer until the pod restarts
            return
        try:
            status = probe_health(child.url, self.timeout_s)
            problem = None if status == 200 else f"/health answered {status}"
        except (OSError, http.client.HTTPException) as exc:
            problem = f"{type(exc).__name__}: {exc}"
        log.debug("rank %d: GET %s/health: %s", child.rank, child.url, problem or "200")
        if child.failed:  # left dead while the probe was out: its answer predates the death
            return
        if problem is None:
            self._up(child)
            return
        child.failures += 1
        child.problem = problem
        if child.healthy and child.failures >= self.failure_threshold:
            log.warning("rank %d (%s) is down: %s", child.rank, child.url, problem)
            child.healthy = False

    def _up(self, child: Child) -> None:
        if not child.healthy:
            log.info("rank %d (%s) is up", child.rank, child.url)
        child.healthy, child.failures, child.problem = True, 0, ""
        self.started = self.started or self.all_up


class ProbeServer:
    """Plain GET over HTTP/1.1, one request per connection, on one thread of its own:
    ``answer(path)`` gives the status and the JSON body."""

    def __init__(self, host: str, port: int, answer: Callable[[str], tuple[int, dict]]):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.create_server((host, port), family=family, backlog=128)  # binds now: errors here
        self.address = self._socket.getsockname()[:2]
        self._answer = answer
        self._open: dict[asyncio.StreamWriter, None] = {}  # connections held, oldest first
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="supervisor-http", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
        else:
            self._loop.close()
        self._socket.close()

    def _run(self) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        server = loop.run_until_complete(asyncio.start_server(self._serve, sock=self._socket,
                                                              limit=MAX_REQUEST_BYTES))
        try:
            loop.run_forever()
        finally:
            server.close()
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._admit(writer)
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
            writer.write(self._respond_to(head))
            await asyncio.wait_for(writer.drain(), READ_TIMEOUT_S)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, OSError):
            pass  # too slow, cut short or too long: dropped without an answer
        finally:
            self._open.pop(writer, None)
            writer.close()

    def _admit(self, writer: asyncio.StreamWriter) -> None:
        """Hold at most MAX_CONNECTIONS: the oldest, the likeliest to be idle, makes room."""
        if len(self._open) >= MAX_CONNECTIONS:
            oldest = next(iter(self._open))
            del self._open[oldest]
            oldest.close()  # its reader sees the end, so its handler returns
        self._open[writer] = None

    def _respond_to(self, head: bytes) -> bytes:
        method, target, *_ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
        if method != "GET":
            return _response(405, {"error": f"{method} is not allowed; the supervisor answers GET"})
        return _response(*self._answer(target.split("?", 1)[0]))


def _response(status: int, body: dict) -> bytes:
    data = json.dumps(body).encode()
    head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n")
    return head.encode() + data


def probe_health(url: str, timeout_s: float) -> int:
    """GET ``url``/health once; its status. Plain http.client: an HTTP client library logs each
    request at INFO (httpx does), which for a probe every few seconds per rank floods the log."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    try:
        connection.request("GET", "/health")
        return connection.getresponse().status
    finally:
        connection.close()


def local_url(host: str, port: int) -> str:
    """Where this machine's own server listening on ``host:port`` answers."""
    return f"http://{ {'0.0.0.0': '127.0.0.1', '::': '[::1]', '': '127.0.0.1'}.get(host, host)}:{port}"
