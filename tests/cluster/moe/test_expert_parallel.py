"""MoE with experts sharded over the data-parallel ranks: lockstep, waves, failures."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from hybridlb import LLM, SamplingParams
from hybridlb.checkpoint.tokenizer import Tokenizer
from hybridlb.engine.client import EngineClient
from hybridlb.testing.ports import free_port_range
from hybridlb.testing.servers import Server, start_servers
from tests.cluster.dp.test_clusters import _dp_flags, burst, served_per_engine
from tests.conftest import PROMPTS, hf_greedy

GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}


def ep_server(model: str, size: int, *extra: str) -> Server:
    return Server(model, *_dp_flags(size, size, 0, free_port_range(8)), "--enable-expert-parallel", *extra)


def greedy_per_rank(server: Server, size: int) -> list[str]:
    """Each prompt pinned to a rank in turn, so every rank serves some."""
    texts = []
    for i, prompt in enumerate(PROMPTS):
        response = httpx.post(f"{server.url}/v1/completions", headers={"X-data-parallel-rank": str(i % size)},
                              json={"model": server.model, "prompt": prompt, **GREEDY}, timeout=120)
        assert response.status_code == 200, response.text
        texts.append(response.json()["choices"][0]["text"])
    return texts


def ranks_view(server: Server) -> dict:
    return httpx.get(f"{server.url}/ranks").json()


def wait_paused(server: Server, timeout_s: float = 5) -> dict:
    """Until every engine reports its wave not running (and the coordinator agrees)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        view = ranks_view(server)
        if not any(e["wave_running"] for e in view["engines"]) and view["wave"] and not view["wave"]["running"]:
            return view
        time.sleep(0.1)
    raise AssertionError(f"engines still running a wave after {timeout_s} s: {ranks_view(server)}")


@pytest.mark.parametrize(("arch", "size"), [("qwen3_moe", 2), ("mixtral", 2), ("qwen3_moe", 4), ("mixtral", 4)])
def test_greedy_tokens_with_sharded_experts_equal_one_rank(checkpoints, arch, size):
    model = checkpoints(arch)
    single = LLM(model, max_model_len=512, num_kv_blocks=64, dtype="float32").generate(
        PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in single] == hf_greedy(model, [o.prompt_token_ids for o in single], 12)
    (server,) = start_servers(ep_server(model, size))
    try:
        assert greedy_per_rank(server, size) == [o.text for o in single]
        view = ranks_view(server)
        assert all(engine["dp_group"] for engine in view["engines"])
        assert sum(engine["dummy_steps"] for engine in view["engines"]) > 0, "idle ranks stepped along"
    finally:
        assert server.stop() == 0


@pytest.fixture(scope="module")
def ep2(checkpoints):
    (server,) = start_servers(ep_server(checkpoints("qwen3_moe"), 2))
    yield server
    server.stop()


def test_one_request_on_one_rank_runs_a_wave_and_the_wave_ends(ep2):
    before = wait_paused(ep2)
    response = httpx.post(f"{ep2.url}/v1/completions", headers={"X-data-parallel-rank": "1"},
                          json={"model": ep2.model, "prompt": "Only rank one", **GREEDY}, timeout=60)
    assert response.status_code == 200
    after = wait_paused(ep2)
    assert after["wave"]["current"] > before["wave"]["current"]
    assert {e["wave"] for e in after["engines"]} == {after["wave"]["current"]}
    idle = next(e for e in after["engines"] if e["rank"] == 0)
    assert idle["dummy_steps"] > next(e for e in before["engines"] if e["rank"] == 0)["dummy_steps"]
    # the next request starts a new wave on every rank
    response = httpx.post(f"{ep2.url}/v1/completions", headers={"X-data-parallel-rank": "0"},
                          json={"model": ep2.model, "prompt": "Now rank zero", **GREEDY}, timeout=60)
    assert response.status_code == 200
    again = wait_paused(ep2)
    assert again["wave"]["current"] > after["wave"]["current"]
    assert {e["wave"] for e in again["engines"]} == {again["wave"]["current"]}


def test_a_request_stamped_with_a_stale_wave_completes(ep2):
    paused = wait_paused(ep2)
    assert paused["wave"]["current"] >= 1
    address = next(e["address"] for e in paused["engines"] if e["rank"] == 1)
    ids = Tokenizer(ep2.model).encode("A stale request")
    client = EngineClient(address)
    try:
        client.hello(10)
        client.add("stale", ids, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), wave=0)
        tokens, reason = [], None
        deadline = time.monotonic() + 20
        while reason is None and time.monotonic() < deadline:
            batch = client.recv(timeout_s=20)
            assert batch is not None, "the stale-wave request hangs"
            for output in batch.outputs:
                if output.request_id == "stale":
                    tokens += output.new_token_ids
                    reason = output.finish_reason
        assert reason == "length" and len(tokens) == 6
    finally:
        client.close()
    wait_paused(ep2)


def ep_two_nodes(model: str) -> tuple[Server, Server]:
    """DP=4 with sharded experts as two `hybridlb serve` nodes of two ranks each."""
    rpc = free_port_range(8)
    head = Server(model, *_dp_flags(4, 2, 0, rpc), "--enable-expert-parallel")
    worker = Server(model, *_dp_flags(4, 2, 2, rpc), "--enable-expert-parallel")
    start_servers(head, worker)
    return head, worker


def test_ep_over_two_nodes_balances_200_requests(checkpoints):
    model = checkpoints("qwen3_moe")
    head, worker = ep_two_nodes(model)
    try:
        assert burst([head.url, worker.url], model, 200) == [200] * 200
        for node, ranks in ((head, {0, 1}), (worker, {2, 3})):
            served = served_per_engine(node.url)
            assert set(served) == ranks and sum(served.values()) == 100
            assert all(count > 100 // 3 for count in served.values()), served
    finally:
        head.stop()
        worker.stop()


def test_killing_one_moe_rank_fails_every_in_flight_request_fast(checkpoints):
    model = checkpoints("qwen3_moe")
    head, worker = ep_two_nodes(model)
    try:
        async def stream(client: httpx.AsyncClient, url: str, rank: int) -> str:
            body = {"model": model, "prompt": "Long story", "max_tokens": 400, "stream": True, "temperature": 0,
                    "ignore_eos": True}
            last = ""
            async with client.stream("POST", f"{url}/v1/completions", json=body,
                                     headers={"X-data-parallel-rank": str(rank)}) as response:
                async for line in response.aiter_lines():
                    last = line or last
                    if '"error"' in line:
                        return "error"
            return last

        async def main():
            async with httpx.AsyncClient(timeout=60) as client:
                tasks = [asyncio.create_task(stream(client, url, rank))
                         for url, rank in ((head.url, 0), (head.url, 1), (worker.url, 2), (worker.url, 3))]
                await asyncio.sleep(1.5)
                os.kill(worker.children()["hybridlb:engine:3"], signal.SIGKILL)
                started = time.monotonic()
                results = await asyncio.gather(*tasks)
                return results, time.monotonic() - started

        results, elapsed = asyncio.run(main())
        assert results == ["error"] * 4, results
        assert elapsed < 10
        for node in (head, worker):
            assert httpx.get(f"{node.url}/health").status_code == 503
    finally:
        head.stop()
        worker.stop()


def test_moe_without_expert_parallel_runs_ranks_independently(checkpoints):
    model = checkpoints("qwen3_moe")
    (server,) = start_servers(Server(model, *_dp_flags(2, 2, 0, free_port_range(8))))
    try:
        assert burst([server.url], model, 20) == [200] * 20
        view = ranks_view(server)
        assert all(e["dp_group"] is False and e["dummy_steps"] == 0 for e in view["engines"])
        assert view["wave"]["messages"] == 0
    finally:
        server.stop()
