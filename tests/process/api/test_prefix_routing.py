"""Cache-aware routing over a node's two ranks (DP=2 hybrid), driven over real HTTP: a
prompt goes where its prefix is cached, unless that rank is too busy."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from hybridlb.testing.servers import start_server
from tests.process.api.test_load import metric, wait_idle


@pytest.fixture(scope="module")
def dp2(tiny_qwen3):
    server = start_server(tiny_qwen3, "--data-parallel-size", "2", "--lb-policy", "cache_aware", "--max-model-len",
                          "1024", "--kv-cache-gib", "0.1")
    yield server
    assert server.stop() == 0


def _prefix(seed: int, length: int = 512) -> list[int]:
    return [(seed * 131 + 7 * k) % 900 + 10 for k in range(length)]


def _served(url: str) -> list[float]:
    return [metric(url, "vllm:request_success_total", rank) for rank in (0, 1)]


def _cache(url: str) -> tuple[float, float]:
    queries = sum(metric(url, "vllm:prefix_cache_queries_total", rank) for rank in (0, 1))
    hits = sum(metric(url, "vllm:prefix_cache_hits_total", rank) for rank in (0, 1))
    return queries, hits


def _complete(url: str, model: str, prompt: list[int], max_tokens: int = 4) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text


def test_each_prefix_stays_on_one_rank_and_hits_its_cache(dp2):
    prefixes = [_prefix(seed) for seed in range(4)]
    owner: dict[int, set[int]] = {p: set() for p in range(4)}
    busy_before = [e["busy_s"] for e in httpx.get(f"{dp2.url}/ranks").json()["engines"]]
    served_before = _served(dp2.url)
    for turn in range(6):
        if turn == 1:
            after_first = _cache(dp2.url)
        for p in (0, 1, 2, 3) if turn % 2 == 0 else (1, 0, 3, 2):  # interleaved: A B C D B A D C ...
            prefix = prefixes[p]
            before = _served(dp2.url)
            _complete(dp2.url, dp2.model, [*prefix, *[900 + 10 * turn + p] * 8], max_tokens=24)
            after = _served(dp2.url)
            owner[p] |= {rank for rank in (0, 1) if after[rank] > before[rank]}
    assert all(len(ranks) == 1 for ranks in owner.values()), owner
    assert sorted(r for ranks in owner.values() for r in ranks) == [0, 0, 1, 1]  # two prefixes per rank
    queries, hits = (now - then for now, then in zip(_cache(dp2.url), after_first, strict=True))
    assert hits / queries >= 0.9, (hits, queries)
    view = httpx.get(f"{dp2.url}/ranks").json()["engines"]
    # The work splits evenly (each rank owns two prefixes: 12 requests of the same length each) and
    # each rank's busy time shows it; a ratio of wall times would be noise on a loaded machine.
    assert [now - then for now, then in zip(_served(dp2.url), served_before, strict=True)] == [12, 12]
    assert all(e["busy_s"] > b for e, b in zip(view, busy_before, strict=True)), (view, busy_before)
    assert all(e["cached_blocks"] > 0 and e["prefix_hit_rate"] > 0 for e in view)


def test_one_hot_prefix_spreads_over_both_ranks(dp2):
    hot = _prefix(99)
    wait_idle(dp2.url)
    before = _served(dp2.url)

    async def burst():
        async with httpx.AsyncClient(base_url=dp2.url, timeout=120) as client:
            async def one(i: int):
                body = {"model": dp2.model, "prompt": hot + [920 + i] * 8, "max_tokens": 48, "temperature": 0,
                        "ignore_eos": True}
                return (await client.post("/v1/completions", json=body)).status_code
            return await asyncio.gather(*(one(i) for i in range(24)))

    assert asyncio.run(burst()) == [200] * 24
    served = [now - then for now, then in zip(_served(dp2.url), before, strict=True)]
    assert min(served) >= 6, served  # not all piled onto the rank that cached it first


def test_pinned_requests_bypass_the_cache(dp2):
    prefix = _prefix(7)
    _complete(dp2.url, dp2.model, [*prefix, 5])
    before = _served(dp2.url)
    cached_on = None
    for rank in (0, 1):
        body = {"model": dp2.model, "prompt": [*prefix, 6], "max_tokens": 2, "temperature": 0}
        response = httpx.post(f"{dp2.url}/v1/completions", json=body, headers={"X-data-parallel-rank": str(rank)})
        assert response.status_code == 200
        cached_on = rank
    assert [now - then for now, then in zip(_served(dp2.url), before, strict=True)] == [1, 1]
    assert cached_on == 1
