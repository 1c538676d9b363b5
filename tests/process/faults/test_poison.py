"""One bad request costs one request: against a live dense DP=2 node with victim streams
running, each request that once took every engine of a node down — out-of-vocabulary stop
ids with min_tokens, a LoRA adapter truncated after it was registered (lazy and eager), a
3 MB bad word — now gets a 4xx alone. Every victim stream completes with the text it gives
without the fault, every engine keeps its process id, and /health stays ok."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from hybridlb.testing.adapters import write_adapter
from hybridlb.testing.servers import Server, start_servers
from tests.process.faults.streams import Streams

VICTIMS = 8
VICTIM_TOKENS = 200


def _engines(server: Server) -> dict[str, int]:
    return {title: pid for title, pid in server.children().items() if title.startswith("hybridlb:engine")}


def _clean_texts(server: Server, count: int) -> list[str]:
    """Each victim prompt's greedy text with nothing else running (Streams' prompts)."""
    streams = Streams([server.url], server.model, count, max_tokens=VICTIM_TOKENS)
    outcomes = streams.join(120)
    assert all(o.kind == "complete" for o in outcomes), [o.detail for o in outcomes]
    return [o.text for o in outcomes]


async def _send_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=120) as client:
        return await asyncio.gather(*(client.post(f"{url}/v1/completions", json=body) for body in bodies))


def _under_victims(server: Server, clean: list[str], bodies: list[dict]) -> list[httpx.Response]:
    """Send ``bodies`` at once while victim streams run; the victims must end as they would alone."""
    engines = _engines(server)
    streams = Streams([server.url], server.model, len(clean), max_tokens=VICTIM_TOKENS)
    streams.wait_streaming(min_chunks=2)
    responses = asyncio.run(_send_all(server.url, bodies))
    outcomes = streams.join(120)
    assert [o.kind for o in outcomes] == ["complete"] * len(clean), [o.detail for o in outcomes]
    assert [o.text for o in outcomes] == clean
    time.sleep(1.5)  # an engine that dies is seen within the heartbeat
    assert _engines(server) == engines, server.output[-3000:]
    health = httpx.get(f"{server.url}/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text
    return responses


def _truncate(adapter: Path) -> None:
    """Cut the end off an adapter's weights: its header still reads (as registration checked it),
    its tensors do not."""
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-16])


def _restarted(server: Server, pid: int) -> bool:
    """Engine 0 runs as a new process and its API server sees every engine up again."""
    if _engines(server).get("hybridlb:engine:0", pid) == pid:
        return False
    return httpx.get(f"{server.url}/health", timeout=10).json()["status"] == "ok"


@pytest.fixture(scope="module")
def adapters(tiny_qwen3, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    for i, name in enumerate(("good", "truncated")):
        write_adapter(root / name, tiny_qwen3, ["q_proj", "v_proj"], seed=i)
    return root


@pytest.fixture(scope="module")
def node(tiny_qwen3, adapters):
    """DP=2 with the default restart_policy (none): an engine that dies stays dead."""
    server = start_servers(Server(tiny_qwen3, "--data-parallel-size", "2", "--enable-lora", "--lora-modules",
                                  f"good={adapters / 'good'}", f"truncated={adapters / 'truncated'}",
                                  "--max-loras", "2"))[0]
    server.clean = _clean_texts(server, VICTIMS)
    yield server
    server.stop()


def test_out_of_vocabulary_stop_ids_with_min_tokens_are_a_400(node):
    body = {"model": node.model, "prompt": "x", "min_tokens": 1, "stop_token_ids": [1_000_000_000], "max_tokens": 8}
    responses = _under_victims(node, node.clean, [body] * 4)
    assert [r.status_code for r in responses] == [400] * 4
    assert all("stop_token_ids" in r.json()["error"]["message"] for r in responses)


def test_a_3_mb_bad_word_is_a_400_and_the_engine_connections_stay_up(node):
    body = {"model": node.model, "prompt": "x", "bad_words": ["ab" * (3 * 2**19)], "max_tokens": 8}
    streams_first = 16
    clean = _clean_texts(node, streams_first)
    responses = _under_victims(node, clean, [body])
    assert responses[0].status_code == 400 and "bad_words" in responses[0].text


def test_a_lora_adapter_truncated_after_registration_fails_only_its_requests(node, adapters):
    _truncate(adapters / "truncated")
    body = {"model": "truncated", "prompt": "x", "max_tokens": 8}
    responses = _under_victims(node, node.clean, [body] * 4)
    assert [r.status_code for r in responses] == [400] * 4, [r.text for r in responses]
    assert all("truncated" in r.json()["error"]["message"] for r in responses)
    good = httpx.post(f"{node.url}/v1/completions", json={**body, "model": "good"}, timeout=60)
    assert good.status_code == 200, good.text


def test_an_eager_adapter_truncated_before_an_engine_restarts_does_not_crash_loop_it(tiny_qwen3, tmp_path):
    adapter = write_adapter(tmp_path / "eager", tiny_qwen3, ["q_proj", "v_proj"])
    server = start_servers(Server(tiny_qwen3, "--data-parallel-size", "2", "--enable-lora", "--lora-modules",
                                  f"eager={adapter}", "--lora-load", "eager", "--restart-policy", "restart"))[0]
    try:
        _truncate(adapter)
        victim = _engines(server)["hybridlb:engine:0"]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 90
        while not _restarted(server, victim):
            assert time.monotonic() < deadline, server.output[-3000:]
            time.sleep(0.5)
        restarted = _engines(server)["hybridlb:engine:0"]
        time.sleep(5)  # a crash loop would have restarted it again by now
        assert _engines(server)["hybridlb:engine:0"] == restarted, server.output[-3000:]
        answers = [httpx.post(f"{server.url}/v1/completions", json={"model": "eager", "prompt": "x", "max_tokens": 4},
                              headers={"X-data-parallel-rank": str(rank)}, timeout=60) for rank in (0, 1)]
        # Rank 1 read the adapter before the file broke and holds it; restarted rank 0 cannot read it.
        assert [a.status_code for a in answers] == [400, 200], [a.text for a in answers]
        assert _engines(server)["hybridlb:engine:0"] == restarted
        assert httpx.get(f"{server.url}/health", timeout=10).json()["status"] == "ok"
    finally:
        server.stop()


def test_a_grammar_its_own_allowed_ids_leave_no_token_is_a_400(node):
    """The two masks together allow nothing: the request's fault, named as such (it was a 500)."""
    body = {"model": node.model, "prompt": "x", "guided_choice": ["0"], "allowed_token_ids": [0], "max_tokens": 4}
    responses = _under_victims(node, node.clean, [body, {**body, "stream": True}])
    assert [r.status_code for r in responses[:1]] == [400], responses[0].text
    assert "allowed_token_ids" in responses[0].json()["error"]["message"]
    assert '"code":400' in responses[1].text.replace(" ", "") or "allowed_token_ids" in responses[1].text


def _engine_of_the_stream(server: Server) -> int:
    """The rank the node's one stream runs on (its API server's in-flight count)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        busy = [e["rank"] for e in httpx.get(f"{server.url}/ranks", timeout=10).json()["engines"]
                if e["in_flight_here"] and e["alive"]]
        if busy:
            return busy[0]
        time.sleep(0.1)
    raise AssertionError("the stream is on no live engine")


def test_a_request_in_flight_on_two_engines_that_died_is_quarantined(tiny_qwen3):
    """Whatever killed them, it is not sent to a third: a request that crashes engines costs two, not the node."""
    server = start_servers(Server(tiny_qwen3, "--data-parallel-size", "3", "--max-model-len", "2048"))[0]
    try:
        streams = Streams([server.url], server.model, 1, max_tokens=2000, timeout_s=120)
        engines = _engines(server)
        for _ in range(2):
            streams.wait_streaming(min_chunks=streams.outcomes[0].chunks + 3)  # streaming (again, after a move)
            os.kill(engines[f"hybridlb:engine:{_engine_of_the_stream(server)}"], signal.SIGKILL)
        (outcome,) = streams.join(60)
        assert outcome.kind == "error" and "quarantined" in outcome.detail, outcome
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert re.search(r"^hybridlb:quarantined_requests_total\{[^}]*\} 1\.0$", metrics, re.M), metrics[-2000:]
        assert httpx.post(f"{server.url}/v1/completions", json={"model": server.model, "prompt": "x", "max_tokens": 4},
                          timeout=60).status_code == 200  # the third engine serves
    finally:
        server.stop()
