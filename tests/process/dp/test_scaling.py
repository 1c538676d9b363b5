"""Elastic data parallelism on one `hybridlb serve` node (``hybridlb.launch.scaling``): DP=1 → 2 → 1
through vLLM's ``POST /scale_elastic_ep`` while greedy streams run — none fails, each gives the
text of the unscaled run, the new rank serves, the leaving rank's streams move on and its
process is gone."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import openai
import pytest

from hybridlb.testing.servers import Server, start_servers

MAX_TOKENS = 400  # ~1.5 s for the 8 on two ranks here (greedy texts of longer ones part between batch shapes)
PROMPTS = [f"Stream {i}: once upon a time" for i in range(8)]


async def _streams(url: str, model: str) -> list[str]:
    """The 8 prompts' greedy texts, streamed at once through the openai SDK."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

    async def one(prompt: str) -> str:
        parts = []
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            parts.append(chunk.choices[0].text)
        return "".join(parts)

    try:
        return await asyncio.gather(*(one(prompt) for prompt in PROMPTS))
    finally:
        await client.close()


def _scale_during_streams(server: Server, body: dict, slow: bool) -> tuple[list[str], httpx.Response]:
    """Start the streams, resize once they are under way; (their texts, the resize's answer).
    ``slow``: the resize takes seconds (a new engine starts), so meanwhile a second resize is
    refused and /is_scaling_elastic_ep says one runs (a shrink that migrates at once may be over
    in a few milliseconds)."""
    async def run():
        streams = asyncio.create_task(_streams(server.url, server.model))
        await asyncio.sleep(0.3)  # under way on every rank, far from done: a shrink must move some
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            resize = asyncio.create_task(client.post("/scale_elastic_ep", json=body))
            await asyncio.sleep(0.1)
            second = await client.post("/scale_elastic_ep", json=body)
            scaling = (await client.get("/is_scaling_elastic_ep")).json()
            answer = await resize
        if slow:
            assert second.status_code == 409 and "already running" in second.json()["error"]["message"], second.text
            assert scaling == {"is_scaling_elastic_ep": True}
        return await streams, answer
    return asyncio.run(run())


def _metric(server: Server, name: str, rank: int) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    found = re.search(rf'^{name}\{{[^}}]*engine="{rank}"[^}}]*\}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def _resizes(server: Server, trigger: str) -> dict[str, float]:
    """``hybridlb:data_parallel_resizes_total`` by direction, for one trigger."""
    found = {}
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith("hybridlb:data_parallel_resizes_total{") and f'trigger="{trigger}"' in line:
            found[re.search(r'direction="(\w+)"', line).group(1)] = float(line.rsplit(" ", 1)[1])
    return found


def _ranks(server: Server) -> list[int]:
    return httpx.get(f"{server.url}/ranks").json()["ranks"]


@pytest.fixture(scope="module")
def server(tiny_qwen3):
    """One node for the module, two API servers sharing its port (each must follow a resize, whichever
    one took it); each test leaves it at one rank."""
    # float32 throughout (the decode program too): greedy texts then stay the same across batch shapes
    (server,) = start_servers(Server(tiny_qwen3, "--max-model-len", "1024", "--api-server-count", "2",
                                     "--dtype", "float32"))
    yield server
    server.stop()


def test_a_node_grows_and_shrinks_while_streams_run_and_no_text_changes(server):
    expected = asyncio.run(_streams(server.url, server.model))

    texts, answer = _scale_during_streams(server, {"new_data_parallel_size": 2}, slow=True)
    assert answer.status_code == 200 and answer.json() == {"message": "Scaled to 2 data parallel engines"}, answer.text
    assert texts == expected
    assert _ranks(server) == [0, 1] and "hybridlb:engine:1" in server.children()
    assert asyncio.run(_streams(server.url, server.model)) == expected
    assert _metric(server, "vllm:generation_tokens_total", 1) > 0  # the new rank took its share

    texts, answer = _scale_during_streams(server, {"new_data_parallel_size": 1, "drain_timeout": 0.01}, slow=False)
    assert answer.status_code == 200 and answer.json() == {"message": "Scaled to 1 data parallel engines"}, answer.text
    assert texts == expected
    migrated = [line for line in httpx.get(f"{server.url}/metrics").text.splitlines() if "migrated_requests" in line
                or "request_success_total" in line]
    assert _metric(server, "hybridlb:migrated_requests_total", 1) > 0, migrated  # running at the drain timeout: moved
    assert _ranks(server) == [0]
    deadline = time.monotonic() + 10
    while "hybridlb:engine:1" in server.children():
        assert time.monotonic() < deadline, server.children()
        time.sleep(0.2)
    assert _metric(server, "vllm:num_requests_running", 1) == 0
    assert httpx.get(f"{server.url}/is_scaling_elastic_ep").json() == {"is_scaling_elastic_ep": False}
    assert _resizes(server, "api") == {"up": 1.0, "down": 1.0}  # counted once, whichever API server took it
    assert asyncio.run(_streams(server.url, server.model)) == expected


@pytest.mark.parametrize(("body", "status", "says"), [
    ({"new_data_parallel_size": 0}, 400, "positive integer"),
    ({"new_data_parallel_size": "2"}, 400, "positive integer"),
    ({"new_data_parallel_size": 2, "drain_timeout": -1}, 400, "drain_timeout must be a positive number"),
    ({"new_data_parallel_size": 4096}, 400, "room for at most"),
    ({}, 400, "new_data_parallel_size must be"),
])
def test_a_bad_resize_is_refused_with_the_reason_and_the_node_serves_on(server, body, status, says):
    answer = httpx.post(f"{server.url}/scale_elastic_ep", json=body, timeout=60)
    assert answer.status_code == status and says in answer.json()["error"]["message"], answer.text
    assert _ranks(server) == [0]
    assert httpx.post(f"{server.url}/v1/completions", json={"model": server.model, "prompt": "hi", "max_tokens": 2},
                      timeout=60).status_code == 200


def test_the_coordinator_follows_a_resize_and_counts_no_departed_rank_lost(tiny_qwen3):
    """From DP=2 (a coordinator runs): shrunk to 1, the cluster's stats list only rank 0 and no rank
    is lost once a departed one would have been (LOST_AFTER_S); grown to 2 again, rank 1 reports and serves."""
    from hybridlb.coordinator import LOST_AFTER_S

    (server,) = start_servers(Server(tiny_qwen3, "--data-parallel-size", "2"))
    try:
        def cluster() -> tuple[list[int], list[int]]:
            view = httpx.get(f"{server.url}/ranks").json()
            return sorted(stats["rank"] for stats in view["cluster"] or []), view["lost_ranks"]

        answer = httpx.post(f"{server.url}/scale_elastic_ep", json={"new_data_parallel_size": 1}, timeout=300)
        assert answer.status_code == 200, answer.text
        time.sleep(LOST_AFTER_S + 1.5)
        assert cluster() == ([0], []) and _ranks(server) == [0]
        assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
        answer = httpx.post(f"{server.url}/scale_elastic_ep", json={"new_data_parallel_size": 2}, timeout=300)
        assert answer.status_code == 200, answer.text
        deadline = time.monotonic() + 10
        while cluster() != ([0, 1], []):
            assert time.monotonic() < deadline, cluster()
            time.sleep(0.2)
        pinned = httpx.post(f"{server.url}/v1/completions", headers={"X-data-parallel-rank": "1"}, timeout=60,
                            json={"model": server.model, "prompt": "hi", "max_tokens": 2})
        assert pinned.status_code == 200 and _metric(server, "vllm:generation_tokens_total", 1) > 0
    finally:
        server.stop()


def test_autoscaling_grows_the_node_under_load_and_shrinks_it_when_the_load_is_gone(tiny_qwen3, tmp_path):
    """The config's autoscaling section (hybridlb.launch.autoscale): 8 streams against a target of
    2 per rank grow the node to its maximum of 2 ranks; idle, it shrinks back to 1. No stream
    fails, and the texts equal those of a run on the shrunk node."""
    config = tmp_path / "autoscaling.yaml"
    config.write_text("autoscaling: {min_replicas: 1, max_replicas: 2, target_ongoing_requests: 2, "
                      "upscale_delay_s: 0.5, downscale_delay_s: 1.5, drain_timeout_s: 5}\n")
    (server,) = start_servers(Server(tiny_qwen3, "--config", str(config), "--max-model-len", "1024"))
    try:
        async def under_load() -> list[list[str]]:
            """Rounds of the 8 streams until the node has grown (each round's texts)."""
            rounds, grown = [], asyncio.Event()

            async def load():
                while not grown.is_set():
                    rounds.append(await _streams(server.url, server.model))
            streams = asyncio.create_task(load())
            async with httpx.AsyncClient(base_url=server.url) as client:
                deadline = time.monotonic() + 60
                while (await client.get("/ranks")).json()["ranks"] != [0, 1]:
                    assert time.monotonic() < deadline and not streams.done(), server.output[-3000:]
                    await asyncio.sleep(0.1)
            grown.set()
            await streams
            return rounds
        rounds = asyncio.run(under_load())
        texts = rounds[0]
        assert all(found == texts for found in rounds)
        deadline = time.monotonic() + 30
        while _ranks(server) != [0] or "hybridlb:engine:1" in server.children():
            assert time.monotonic() < deadline, server.output[-3000:]
            time.sleep(0.2)
        assert re.search(r"autoscaling: \d+ ongoing requests on 1 ranks \(target 2 per rank\) for \d+ s: resizing "
                         r"to 2", server.output), server.output[-3000:]
        assert _resizes(server, "autoscaling") == {"up": 1.0, "down": 1.0}
        assert asyncio.run(_streams(server.url, server.model)) == texts
    finally:
        server.stop()


def test_a_dead_rank_is_resized_away_and_growing_again_brings_a_live_one(tiny_qwen3):
    """A resize meeting a fault: rank 1 killed (the node degraded), shrinking to 1 leaves a healthy
    node with no lost rank; growing to 2 starts a new rank 1 that serves."""
    import os
    import signal

    from hybridlb.coordinator import LOST_AFTER_S

    (server,) = start_servers(Server(tiny_qwen3, "--data-parallel-size", "2"))
    try:
        os.kill(server.children()["hybridlb:engine:1"], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while httpx.get(f"{server.url}/health").json().get("down_ranks") != [1]:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        answer = httpx.post(f"{server.url}/scale_elastic_ep", json={"new_data_parallel_size": 1}, timeout=300)
        assert answer.status_code == 200, answer.text
        time.sleep(LOST_AFTER_S + 1)
        health, view = httpx.get(f"{server.url}/health").json(), httpx.get(f"{server.url}/ranks").json()
        assert (health["status"], health["problems"], view["ranks"], view["lost_ranks"]) == ("ok", [], [0], [])
        answer = httpx.post(f"{server.url}/scale_elastic_ep", json={"new_data_parallel_size": 2}, timeout=300)
        assert answer.status_code == 200, answer.text
        assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
        pinned = httpx.post(f"{server.url}/v1/completions", headers={"X-data-parallel-rank": "1"}, timeout=60,
                            json={"model": server.model, "prompt": "hi", "max_tokens": 2})
        assert pinned.status_code == 200, pinned.text
    finally:
        server.stop()


def test_a_rank_that_cannot_start_rolls_the_resize_back_and_the_node_serves_on(tiny_qwen3, tmp_path):
    """A resize meeting a fault on the way up: the new rank's engine fails to load its weights (the
    checkpoint broke after the start). The answer is a 500 saying it was rolled back; the node keeps
    its one rank, healthy, serving, with no process of the failed rank left; once the checkpoint is
    whole again, growing works."""
    import shutil

    model = shutil.copytree(tiny_qwen3, tmp_path / "model")
    weights = next(model.glob("*.safetensors"))
    (server,) = start_servers(Server(str(model), "--max-model-len", "1024"))
    try:
        weights.rename(weights.with_suffix(".kept"))  # engine 0's open file stays whole
        weights.write_bytes(b"not a safetensors file")
        answer = httpx.post(f"{server.url}/scale_elastic_ep", json={"new_data_parallel_size": 2}, timeout=300)
        assert answer.status_code == 500 and "rolled back" in answer.json()["error"]["message"], answer.text
        health = httpx.get(f"{server.url}/health").json()
        assert (health["status"], _ranks(server)) == ("ok", [0]), health
        assert httpx.get(f"{server.url}/is_scaling_elastic_ep").json() == {"is_scaling_elastic_ep": False}
        assert "hybridlb:engine:1" not in server.children()
        done = httpx.post(f"{server.url}/v1/completions", json={"model": server.model, "prompt": "hi", "max_tokens": 2},
                          timeout=60)
        assert done.status_code == 200, done.text
        weights.with_suffix(".kept").replace(weights)
        answer = httpx.post(f"{server.url}/scale_elastic_ep", json={"new_data_parallel_size": 2}, timeout=300)
        assert answer.status_code == 200, answer.text
        assert _ranks(server) == [0, 1]
    finally:
        server.stop()
