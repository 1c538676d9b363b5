"""The node supervisor of multi-port mode (vLLM's ``--data-parallel-multi-port-external-lb``,
llm-d's pod shape since mid-2026).

In multi-port mode each local rank has an API server of its own on ``port + i``, so an
upstream picker can choose the rank; the supervisor answers for the whole node on one port
(``lb.supervisor_port``), where the pod's probes point:

* ``GET /health``, ``/ready``, ``/readyz``: 200 only while every rank's API server answered its
  last probe of ``/health`` with 200 (a rank counts as down after ``failure_threshold`` failed
  probes in a row, and as up again after one good one) and no shutdown has begun; else 503.
  The body lists every rank: its port, whether it is up, its process id and the last problem.
  A rank whose process the launcher saw die is down at once (``mark_down``), without waiting
  for the probes to fail.

It probes every rank each ``interval_s`` seconds, each probe with ``timeout_s``. It runs in
the node's launcher process (``hybridlb serve``) or a Ray actor (``hybridlb up``), as threads.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

log = logging.getLogger(__name__)
PROBE_PATHS = frozenset({"/health", "/ready", "/readyz"})


@dataclass
class Child:
    """One rank's API server as the supervisor sees it."""

    rank: int
    url: str  # where to probe it: http://host:port
    healthy: bool = False  # never up until a probe says so
    failures: int = 0  # failed probes in a row
    problem: str = "not probed yet"


class Supervisor:
    def __init__(self, host: str, port: int, children: dict[int, str], interval_s: float = 5.0,
                 timeout_s: float = 5.0, failure_threshold: int = 3, pid_of: Callable[[int], int | None] | None = None):
        """``children``: rank → the URL of its API server. ``pid_of(rank)``: that server's process id, if known."""
        self.children = {rank: Child(rank, url) for rank, url in sorted(children.items())}
        self.interval_s, self.timeout_s, self.failure_threshold = interval_s, timeout_s, failure_threshold
        self.pid_of = pid_of or (lambda rank: None)
        self.shutting_down = False
        self._stop = threading.Event()
        self._http = ThreadingHTTPServer((host, port), _handler(self))
        self._http.daemon_threads = True
        self.address = self._http.server_address[:2]
        self._threads = [threading.Thread(target=self._http.serve_forever, name="supervisor-http", daemon=True),
                         threading.Thread(target=self._probe_forever, name="supervisor-probe", daemon=True)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def wait_ready(self, timeout_s: float) -> bool:
        """Probe every rank now and until all are up (or ``timeout_s``); whether they are."""
        deadline = time.monotonic() + timeout_s
        while not self.ready and time.monotonic() < deadline:
            for child in self.children.values():
                if not child.healthy:
                    self._probe(child)
            if not self.ready:
                time.sleep(0.1)
        return self.ready

    def mark_down(self, rank: int, why: str) -> None:
        """The launcher saw this rank's server (or engine) die: down now, not after the failed probes."""
        child = self.children[rank]
        child.healthy, child.failures, child.problem = False, self.failure_threshold, why

    def begin_shutdown(self) -> None:
        """From now on every probe answers 503 (the node is stopping)."""
        self.shutting_down = True

    def stop(self) -> None:
        self.begin_shutdown()
        self._stop.set()
        self._http.shutdown()
        self._http.server_close()

    @property
    def ready(self) -> bool:
        return not self.shutting_down and all(child.healthy for child in self.children.values())

    def view(self) -> dict:
        """What the probe endpoints answer, for people and tools."""
        status = "shutting down" if self.shutting_down else "ready" if self.ready else "not ready"
        return {"status": status, "ranks": {str(c.rank): {"url": c.url, "up": c.healthy, "pid": self.pid_of(c.rank),
                                                            "problem": None if c.healthy else c.problem}
                                             for c in self.children.values()}}

    # -- probing ----------------------------------------------------------------------------
    def _probe_forever(self) -> None:
        with ThreadPoolExecutor(len(self.children), thread_name_prefix="supervisor-probe") as pool:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    list(pool.map(self._probe, self.children.values()))
                except Exception:  # never let the probes stop: a stopped prober would freeze the node's state
                    log.exception("supervisor: probing failed")
                self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))

    def _probe(self, child: Child) -> None:
        try:
            response = httpx.get(f"{child.url}/health", timeout=self.timeout_s)
            problem = None if response.status_code == 200 else f"/health answered {response.status_code}"
        except httpx.HTTPError as exc:
            problem = f"{type(exc).__name__}: {exc}"
        if problem is None:
            if not child.healthy:
                log.info("rank %d (%s) is up", child.rank, child.url)
            child.healthy, child.failures, child.problem = True, 0, ""
            return
        child.failures += 1
        child.problem = problem
        if child.healthy and child.failures >= self.failure_threshold:
            log.warning("rank %d (%s) is down: %s", child.rank, child.url, problem)
            child.healthy = False


def local_url(host: str, port: int) -> str:
    """Where this machine's own server listening on ``host:port`` answers."""
    return f"http://{ {'0.0.0.0': '127.0.0.1', '::': '[::1]', '': '127.0.0.1'}.get(host, host)}:{port}"


def _handler(supervisor: Supervisor) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # the name http.server calls
            path = self.path.split("?", 1)[0]
            if path not in PROBE_PATHS:
                self._send(404, {"error": f"no route GET {path}; the supervisor answers {sorted(PROBE_PATHS)}"})
                return
            self._send(200 if supervisor.ready else 503, supervisor.view())

        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *_) -> None:  # probes every few seconds: no access log
            pass

    return Handler
