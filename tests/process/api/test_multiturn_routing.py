"""Multi-turn chats under cache-aware routing (DP=2 hybrid), over real HTTP: a chat's next
turn goes to the rank holding its history while the ranks' loads are close, moves when that
rank is much busier, and finds its history whichever of the node's API servers takes it."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from hybridlb.testing.servers import start_server
from tests.process.api.test_load import metric, wait_idle

QUERIES = "vllm:prefix_cache_queries_total"
FLAGS = ("--data-parallel-size", "2", "--lb-policy", "cache_aware", "--max-model-len", "1024", "--kv-cache-gib", "0.1")


def _tokens(seed: int, length: int) -> list[int]:
    return [(seed * 131 + 7 * k) % 900 + 10 for k in range(length)]


def _counters(url: str, name: str) -> list[float]:
    return [metric(url, name, rank) for rank in (0, 1)]


def _settled(url: str, name: str, expected_total: float, timeout_s: float = 10) -> list[float]:
    """The per-rank counter ``name`` once its ranks' sum reaches ``expected_total`` (stats arrive a
    heartbeat late, through whichever API server answers)."""
    deadline = time.monotonic() + timeout_s
    while True:
        values = _counters(url, name)
        if sum(values) >= expected_total or time.monotonic() > deadline:
            return values
        time.sleep(0.1)


@pytest.fixture(scope="module")
def dp2(tiny_qwen3):
    server = start_server(tiny_qwen3, *FLAGS)
    yield server
    assert server.stop() == 0


async def _turn_beside(url: str, model: str, prompt: list[int], busy_rank: int, busy: int) -> int:
    """Send ``prompt`` while ``busy`` long requests pinned to ``busy_rank`` are generating;
    return the rank that served it."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        started = asyncio.Event()
        running = 0

        async def hog(i: int) -> None:
            nonlocal running
            body = {"model": model, "prompt": _tokens(500 + i, 8), "max_tokens": 1000, "ignore_eos": True,
                    "stream": True}
            headers = {"X-data-parallel-rank": str(busy_rank)}
            async with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
                async for _ in response.aiter_lines():
                    running += 1
                    if running == busy:
                        started.set()
                    await asyncio.sleep(3600)  # hold it open until cancelled (the request is aborted)

        initial = await asyncio.to_thread(_counters, url, QUERIES)
        hogs = [asyncio.create_task(hog(i)) for i in range(busy)]
        try:
            if busy:
                await asyncio.wait_for(started.wait(), 30)
            # The rank whose cache the prompt was looked up in served it (the hogs were, before).
            before = await asyncio.to_thread(_settled, url, QUERIES, sum(initial) + 8 * busy)
            body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            after = await asyncio.to_thread(_settled, url, QUERIES, sum(before) + len(prompt))
        finally:
            for task in hogs:
                task.cancel()
            await asyncio.gather(*hogs, return_exceptions=True)
    served = [rank for rank in (0, 1) if after[rank] - before[rank] == len(prompt)]
    assert len(served) == 1 and sum(after) - sum(before) == len(prompt), (before, after)
    return served[0]


def test_a_chat_stays_on_the_rank_holding_its_history_until_that_rank_is_far_busier(dp2):
    history = _tokens(1, 512)
    home = asyncio.run(_turn_beside(dp2.url, dp2.model, history, busy_rank=0, busy=0))
    other = 1 - home
    wait_idle(dp2.url)
    # One request more on the home rank: the 512 cached tokens outweigh it.
    history += _tokens(2, 64)
    assert asyncio.run(_turn_beside(dp2.url, dp2.model, history, busy_rank=home, busy=1)) == home
    wait_idle(dp2.url)
    # Eight more: every step of theirs would wait for this turn's prefill elsewhere, but here each
    # step of this one waits for eight others; the idle rank recomputes the history sooner.
    history += _tokens(3, 64)
    assert asyncio.run(_turn_beside(dp2.url, dp2.model, history, busy_rank=home, busy=8)) == other


def test_every_api_server_of_a_node_knows_what_each_rank_holds(tiny_qwen3):
    """Two API servers share the node's port; each turn comes on a new connection, so the
    kernel hands about half of them to the API server that did not send the chat's history.
    Every turn after the first still finds all of its history cached."""
    server = start_server(tiny_qwen3, *FLAGS, "--api-servers-per-node", "2")
    try:
        chats = [_tokens(10 + c, 256) for c in range(6)]
        queries = _counters(server.url, QUERIES)
        hits = _counters(server.url, "vllm:prefix_cache_hits_total")
        sent = expected_hits = 0
        for turn in range(4):
            for c, history in enumerate(chats):
                if turn:
                    expected_hits += len(history)  # a multiple of the block size: all of it reusable
                    history += _tokens(100 * turn + c, 64)
                body = {"model": server.model, "prompt": history, "max_tokens": 2, "temperature": 0}
                response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60,
                                      headers={"Connection": "close"})
                assert response.status_code == 200, response.text
                sent += len(history)
        done = _settled(server.url, QUERIES, sum(queries) + sent)
        assert sum(done) - sum(queries) == sent
        now = _counters(server.url, "vllm:prefix_cache_hits_total")
        assert sum(now) - sum(hits) == expected_hits
    finally:
        assert server.stop() == 0
