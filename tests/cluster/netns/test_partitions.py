"""Network partitions between hosts (tests/cluster/netns): a node's link cut mid-stream, then restored.

A cut host is alive but silent, its connections half-open: nothing tells its peers it is gone
but the silence itself. Dense ranks are independent, so their clients must not notice; a MoE
expert-parallel group cannot step without every rank, so its requests must fail within
``--dp-timeout`` (never hang) and the group must form again once the nodes are restarted, as
their supervisor would.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time

import httpx
import pytest

from hybridlb.testing.servers import Server, completion
from tests.cluster.dp.test_clusters import served_per_engine
from tests.cluster.netns.proxy import SlowLink
from tests.cluster.netns.test_serve_hosts import expected, texts, two_nodes

pytestmark = pytest.mark.slow
SIMULATED = ("--simulate-step-ms", "20")  # dense cases: the network is under test, not the model


class Stream(threading.Thread):
    """One streaming completion in the background: its events, how it ended, and when."""

    def __init__(self, url: str, model: str, max_tokens: int):
        super().__init__(daemon=True)
        self.url, self.model, self.max_tokens = url, model, max_tokens
        self.tokens, self.error, self.done_after = 0, None, None
        self.started = time.monotonic()
        self.start()

    def run(self) -> None:
        body = {"model": self.model, "prompt": "partition", "max_tokens": self.max_tokens, "ignore_eos": True,
                "stream": True, "temperature": 0}
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body,
                              timeout=httpx.Timeout(90, connect=5)) as response:
                for line in response.iter_lines():
                    if line.startswith('data: {"error"'):
                        self.error = line
                    elif line.startswith("data: {"):
                        self.tokens += 1
        except httpx.HTTPError as exc:
            self.error = f"{type(exc).__name__}: {exc}"  # a cut connection: what must not happen
        self.done_after = time.monotonic() - self.started


def poll(check, timeout_s: float, every_s: float = 0.25):
    """Call ``check()`` until it returns something true; return it and the seconds it took."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        try:
            if result := check():
                return result, time.monotonic() - started
        except httpx.HTTPError:  # a host just healed may not answer at once (ARP)
            pass
        time.sleep(every_s)
    raise AssertionError(f"not within {timeout_s} s")


def lost_ranks(server: Server) -> list[int]:
    return httpx.get(f"{server.url}/ranks", timeout=3).json()["lost_ranks"]


def test_dense_cut_node_is_reported_lost_its_peers_serve_on_and_it_heals(network, tiny_qwen3):
    b = network.hosts[1]
    head, worker = two_nodes(network, tiny_qwen3, 29600, *SIMULATED)
    try:
        streams = [Stream(head.url, tiny_qwen3, 300) for _ in range(2)]  # ~6 s each
        cut_streams = [Stream(worker.url, tiny_qwen3, 300) for _ in range(2)]
        time.sleep(1)
        network.cut(b)
        _, detected_s = poll(lambda: lost_ranks(head) == [2, 3], 10)
        for stream in streams:  # the head's clients never notice
            stream.join(30)
            assert (stream.tokens, stream.error) == (300, None)
        completion(head.url, tiny_qwen3, "during the cut")
        network.heal(b)
        _, healed_s = poll(lambda: lost_ranks(head) == [], 15)
        for stream in cut_streams:  # a short cut: TCP carries the worker's streams through it
            stream.join(60)
            assert (stream.tokens, stream.error) == (300, None)
        completion(worker.url, tiny_qwen3, "after the cut")
        print(f"\ndense partition: lost after {detected_s:.1f} s, healed {healed_s:.1f} s after the link came back")
        assert detected_s < 6
    finally:
        network.heal(b)
        for server in (worker, head):
            server.stop()


def streams_across_cut(network, host, url: str, model: str) -> tuple[list[Stream], float]:
    """Two long streams from ``url``, then ``host``'s link cut mid-stream: the streams once
    ended (or after 30 s), and when the cut was (``time.monotonic``)."""
    streams = [Stream(url, model, 480) for _ in range(2)]
    time.sleep(1)
    cut = time.monotonic()
    network.cut(host)
    for stream in streams:
        stream.join(30)
    return streams, cut


def test_dense_node_cut_off_from_the_coordinator_keeps_serving(network, tiny_qwen3):
    a = network.hosts[0]
    head, worker = two_nodes(network, tiny_qwen3, 29610, *SIMULATED)
    try:
        network.cut(a)  # the head and its coordinator
        for _ in range(8):  # across the head-silence window (5 s): still served, never refused
            completion(worker.url, tiny_qwen3, "no coordinator", max_tokens=16)
            time.sleep(1)
        assert worker.process.poll() is None
        assert "keep serving" in worker.output
        network.heal(a)
        poll(lambda: lost_ranks(head) == [], 15)
    finally:
        network.heal(a)
        for server in (worker, head):
            server.stop()


def test_moe_cut_node_fails_every_rank_fast_and_the_group_forms_again(network, checkpoints):
    model = checkpoints("qwen3_moe")
    b = network.hosts[1]
    flags = ("--enable-expert-parallel", "--dp-timeout", "8")

    def cluster() -> tuple[Server, Server]:  # the head reports and waits; the worker exits for its supervisor
        return two_nodes(network, model, 29620, *flags, worker_flags=("--restart-policy", "restart"))

    head, worker = cluster()
    try:
        streams, cut = streams_across_cut(network, b, head.url, model)
        for stream in streams:  # errors, not hangs: within the collective timeout and a margin
            assert stream.error is not None and '"error"' in stream.error, stream.error
            assert stream.done_after < 8 + 10
        failed_s = time.monotonic() - cut
        poll(lambda: httpx.get(f"{head.url}/health", timeout=3).status_code == 503, 10)
        network.heal(b)
        # restart policy: the node exits so that its supervisor recreates the group
        assert worker.process.wait(30) == 1
        assert "broke the expert-parallel group" in worker.output or "cannot serve without the head" in worker.output
        assert head.stop() == 0
        restarted = time.monotonic()
        head, worker = cluster()  # the supervisor's part
        assert texts(head.url, model) == texts(worker.url, model) == expected(model)
        print(f"\nMoE partition: streams failed {failed_s:.1f} s after the cut (--dp-timeout 8); "
              f"the group re-formed {time.monotonic() - restarted:.1f} s after the restart")
    finally:
        network.heal(b)
        for server in (worker, head):
            server.stop()


def test_moe_node_cut_off_from_the_head_ends_its_streams_with_errors(network, checkpoints):
    model = checkpoints("qwen3_moe")
    a = network.hosts[0]
    flags = ("--enable-expert-parallel", "--dp-timeout", "8")
    head, worker = two_nodes(network, model, 29630, *flags)
    try:
        streams, cut = streams_across_cut(network, a, worker.url, model)
        for stream in streams:  # the worker stops (it cannot step without the head): no cut connections
            assert stream.error is not None and "shutting down" in stream.error, stream.error
        print(f"\nMoE, head cut off: the worker's streams ended with an error {time.monotonic() - cut:.1f} s later")
        assert worker.process.wait(30) == 1
        assert "cannot serve without the head" in worker.output
    finally:
        network.heal(a)
        for server in (worker, head):
            server.stop()


def _burst(url: str, model: str, count: int) -> list[int]:
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda i: httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": model, "prompt": f"slow link {i}", "max_tokens": 8, "ignore_eos": True}).status_code,
            range(count)))


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_slow_lossy_link_to_the_head_keeps_balancing_and_waves_working(network, tiny_qwen3, checkpoints, moe):
    """The worker reaches the head (handshake, coordinator, wave messages, rendezvous) through
    a link with 50 ms of delay each way and 5 % of chunks stalled for a retransmission."""
    model = checkpoints("qwen3_moe") if moe else tiny_qwen3
    a, b = network.hosts[:2]
    rpc = 29640 + 10 * moe
    flags = ("--enable-expert-parallel",) if moe else ()
    link = SlowLink(network.bridge_address, a.address, [rpc + i for i in range(5)], delay_s=0.05, loss=0.05)
    with network.resolving(b, a.name, network.bridge_address):  # only the worker's view changes
        head, worker = two_nodes(network, model, rpc, *flags)
    try:
        assert _burst(worker.url, model, 40) == [200] * 40
        served = served_per_engine(worker.url)
        assert set(served) == {2, 3} and min(served.values()) >= 40 // 4, served  # both local engines used
        assert texts(worker.url, model) == texts(head.url, model) == expected(model)
        time.sleep(2)  # a few heartbeats over the slow link
        assert lost_ranks(head) == [] and lost_ranks(worker) == []  # slow is not lost
        if moe:
            waves = httpx.get(f"{head.url}/ranks", timeout=5).json()["wave"]
            assert waves["completed"] >= 1, waves
        assert link.chunks > 0 and link.stalls > 0  # the traffic did cross the slow link
    finally:
        for server in (worker, head):
            server.stop()
        link.close()
