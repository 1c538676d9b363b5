"""The multi-port node supervisor on its own (unit tier: fake rank servers, no engines): what
its probe endpoints answer while ranks restart or are left dead, and that its port, open to
the cluster, cannot be starved by idle connections."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from hybridlb.launch.supervisor import Supervisor


class FakeRank(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # the name http.server calls
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_) -> None:
        pass


class FakeRanks(dict):
    """Rank → the URL of a server answering 200 to everything, until ``kill(rank)``."""

    def __init__(self, count: int):
        self.servers = [ThreadingHTTPServer(("127.0.0.1", 0), FakeRank) for _ in range(count)]
        for server in self.servers:
            threading.Thread(target=server.serve_forever, daemon=True).start()
        super().__init__({rank: f"http://127.0.0.1:{s.server_address[1]}" for rank, s in enumerate(self.servers)})

    def kill(self, rank: int) -> None:
        server = self.servers[rank]
        if server.socket.fileno() != -1:
            server.shutdown()
            server.server_close()


@pytest.fixture
def ranks() -> Iterator[FakeRanks]:
    fakes = FakeRanks(2)
    yield fakes
    for rank in fakes:
        fakes.kill(rank)


@pytest.fixture
def supervisor(ranks) -> Iterator[tuple[Supervisor, str]]:
    node = Supervisor("127.0.0.1", 0, ranks, interval_s=0.05, timeout_s=0.5)
    node.start()
    assert node.wait_ready(10)
    yield node, f"http://127.0.0.1:{node.address[1]}"
    node.stop()


def _get(url: str) -> tuple[int, dict]:
    response = httpx.get(url, timeout=3)
    return response.status_code, response.json()


def test_a_restarting_rank_keeps_the_pod_ready_and_live_and_a_rank_left_dead_fails_liveness(supervisor, ranks):
    node, url = supervisor
    ranks.kill(1)
    node.mark_restarting(1, "api:0.1 exited with code -9")
    status, view = _get(f"{url}/readyz")
    assert status == 200 and view["status"] == "degraded"
    assert view["ranks"]["1"]["up"] is False and view["ranks"]["1"]["restarts"] == 1
    assert view["ranks"]["1"]["problem"]  # the launcher's word, then the probes' (refused)
    assert _get(f"{url}/health")[0] == 200
    node.mark_failed(1, "api:0.1 died 4 times within 60 s")
    status, view = _get(f"{url}/health")
    assert status == 503 and view["live"] is False and "rank 1: api:0.1 died 4 times" in view["liveness_problem"]
    assert _get(f"{url}/readyz")[0] == 200  # rank 0 still serves until the pod is restarted
    ranks.kill(0)
    node.mark_failed(0, "engine 0 died 4 times within 60 s")
    assert _get(f"{url}/readyz")[0] == 503 and _get(f"{url}/ready")[0] == 503


def test_readiness_waits_for_every_rank_once_and_ends_at_shutdown(ranks):
    node = Supervisor("127.0.0.1", 0, {**ranks, 2: "http://127.0.0.1:9"}, interval_s=0.05, timeout_s=0.5)
    node.start()
    try:
        url = f"http://127.0.0.1:{node.address[1]}"
        time.sleep(0.3)  # two of three ranks up: still starting
        status, view = _get(f"{url}/readyz")
        assert status == 503 and view["status"] == "starting"
        assert _get(f"{url}/health")[0] == 200  # a slow start is not a dead pod
        node.begin_shutdown()
        assert _get(f"{url}/readyz")[1]["status"] == "shutting down"
    finally:
        node.stop()


def test_a_wedged_prober_fails_liveness(supervisor):
    node, url = supervisor
    release = threading.Event()
    node._probe = lambda child: release.wait(30)  # a probe round that never ends
    try:
        deadline = time.monotonic() + 10
        while (status := _get(f"{url}/health"))[0] == 200:
            assert time.monotonic() < deadline, "liveness held with the prober stuck"
            time.sleep(0.1)
        assert status[0] == 503 and "has not finished a round" in status[1]["liveness_problem"]
    finally:
        release.set()


def test_idle_half_written_connections_hold_no_threads_and_a_probe_is_still_answered(supervisor):
    """500 connections that send half a request line and wait: the thread count stays put, a
    real probe is answered at once, and the idle ones are closed within seconds."""
    node, url = supervisor
    threads = threading.active_count()
    idle = []
    for _ in range(500):
        sock = socket.create_connection(node.address, timeout=5)
        sock.sendall(b"GET /rea")
        idle.append(sock)
    try:
        time.sleep(0.5)
        assert threading.active_count() <= threads + 2
        started = time.monotonic()
        assert _get(f"{url}/readyz")[0] == 200
        assert time.monotonic() - started < 2
        assert all(_closed_within(sock, 5) for sock in idle), "an idle connection was held open"
    finally:
        for sock in idle:
            sock.close()


def _closed_within(sock: socket.socket, timeout_s: float) -> bool:
    sock.settimeout(timeout_s)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:  # closed with our half request unread
        return True
    except TimeoutError:
        return False


def test_a_probe_that_answered_before_its_rank_was_left_dead_does_not_bring_it_back(monkeypatch):
    """A probe in flight when the launcher leaves the rank dead: its 200 predates the death."""
    from hybridlb.launch import supervisor as module

    node = Supervisor("127.0.0.1", 0, {0: "http://127.0.0.1:9"}, interval_s=0.05, timeout_s=0.5)
    try:
        monkeypatch.setattr(module, "probe_health", lambda url, timeout: (node.mark_failed(0, "engine 0 died"), 200)[1])
        node._probe(node.children[0])
        assert not node.children[0].healthy and node.liveness_problem()
    finally:
        node.stop()
