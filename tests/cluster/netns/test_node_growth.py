"""A running dense cluster of two hosts (ranks 0-3, hybrid LB) grows by a third host that
joins as ranks 4..5 with the same flags and a new start rank, and shrinks when it leaves with
`--shutdown-timeout`, under load on every node: no request fails, the head's coordinator
follows (its cluster view lists ranks 0..5, then 0..3, and never a departed rank as lost), the
new node's ranks serve, and its streams in flight when it is stopped end whole."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from hybridlb.coordinator import LOST_AFTER_S
from hybridlb.testing.servers import start_servers
from hybridlb.testing.waiting import until
from tests.cluster.netns.test_serve_hosts import dp_flags, serve_on, stop_all, two_nodes

pytestmark = pytest.mark.slow
RPC_PORT = 29570


class Load:
    """Streams sent one after another from a few threads to each URL until ``stop``."""

    def __init__(self, urls: list[str], model: str, per_url: int = 2, max_tokens: int = 64):
        self.model, self.max_tokens = model, max_tokens
        self.done, self.failures = 0, []
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._loop, args=(url,)) for url in urls for _ in range(per_url)]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(60)

    def _loop(self, url: str) -> None:
        while not self.stopping.is_set():
            outcome = stream(url, self.model, self.max_tokens)
            if outcome is None:
                self.done += 1
            else:
                self.failures.append(outcome)


def stream(url: str, model: str, max_tokens: int, started: threading.Event | None = None) -> str | None:
    """None once ``max_tokens`` streamed whole, else what went wrong."""
    body = {"model": model, "prompt": "grow and shrink", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            if response.status_code != 200:
                return f"{response.status_code}: {response.read()[:300]!r}"
            lines = []
            for line in filter(None, response.iter_lines()):
                lines.append(line)
                if started is not None and len(lines) == 3:
                    started.set()
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    if lines[-1] != "data: [DONE]" or any('"error"' in line for line in lines):
        return f"ended with {lines[-3:]}"
    if f'"completion_tokens":{max_tokens}' not in lines[-2].replace(" ", ""):
        return f"cut short: {lines[-2]}"
    return None


def reported(url: str) -> tuple[set[int], list[int]]:
    """The ranks the head's coordinator has stats of, and those it counts as lost."""
    view = httpx.get(f"{url}/ranks", timeout=10).json()
    return {stats["rank"] for stats in view["cluster"] or []}, view["lost_ranks"]


def test_a_third_node_joins_as_ranks_4_and_5_and_leaves_under_load(network, tiny_qwen3):
    c = network.hosts[2]
    head, worker = two_nodes(network, tiny_qwen3, RPC_PORT)
    load = Load([head.url, worker.url], tiny_qwen3)
    third = None
    try:
        load.start()
        third = serve_on(network, c, tiny_qwen3, *dp_flags(network, 6, 2, 4, RPC_PORT), "--shutdown-timeout", "30")
        start_servers(third)
        until(lambda: reported(head.url) == ({0, 1, 2, 3, 4, 5}, []), 30, "the head's coordinator seeing ranks 0..5")
        assert httpx.get(f"{third.url}/ranks", timeout=10).json()["ranks"] == [4, 5]
        assert "adds ranks 4..5: the cluster has 6 ranks now (it had 4)" in head.output
        # Its ranks serve; then it stops with streams in flight, which end whole.
        outcomes: list[str | None] = []
        threads = []
        for _ in range(6):
            started = threading.Event()
            threads.append(threading.Thread(target=lambda s=started: outcomes.append(
                stream(third.url, tiny_qwen3, 400, s))))
            threads[-1].start()
            assert started.wait(30)
        third.process.send_signal(signal.SIGTERM)
        assert any(thread.is_alive() for thread in threads), "every stream ended before the stop"
        for thread in threads:
            thread.join(60)
        assert outcomes == [None] * 6, outcomes
        assert third.process.wait(60) == 0, third.output[-3000:]
        until(lambda: reported(head.url) == ({0, 1, 2, 3}, []), 30, "the head's coordinator back at ranks 0..3")
        assert "left with ranks 4..5: the cluster has 4 ranks now (it had 6)" in head.output
        time.sleep(LOST_AFTER_S + 1)  # past the coordinator's silence limit: a departed rank is not a lost one
        assert reported(head.url) == ({0, 1, 2, 3}, [])
        load.stop()
        assert load.failures == [] and load.done > 10, (load.done, load.failures[:3])
    finally:
        load.stop()
        if third is not None:
            third.stop()
        stop_all(head, worker)
