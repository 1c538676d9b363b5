"""Under lost, repeated, late and reordered engine messages, a lost request and a stalled
API server, every client gets a complete response or an error, never a hang or a wrong
text, and the engine's KV pool empties afterwards."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass

import httpx
import pytest

from tests.cluster.chaos.conftest import REQUEST_TIMEOUT_S
from tests.cluster.chaos.wire import Faults

HANG_S = 60  # a request still open this long has hung


@dataclass
class Outcome:
    kind: str  # "complete", "error" or "hung"
    text: str = ""
    tokens: int = 0
    status: int = 200
    detail: str = ""


async def _one(client: httpx.AsyncClient, url: str, model: str, i: int, max_tokens: int, stream: bool) -> Outcome:
    try:
        return await _request(client, url, model, i, max_tokens, stream)
    except httpx.HTTPError as exc:  # the API server went away
        return Outcome("error", detail=f"{type(exc).__name__}: {exc}")


async def _request(client: httpx.AsyncClient, url: str, model: str, i: int, max_tokens: int, stream: bool) -> Outcome:
    body = {"model": model, "prompt": f"Story number {i}:", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    if not stream:
        response = await client.post(f"{url}/v1/completions", json=body)
        if response.status_code != 200:
            return Outcome("error", status=response.status_code, detail=response.json()["error"]["message"])
        result = response.json()
        return Outcome("complete", result["choices"][0]["text"], result["usage"]["completion_tokens"])
    text, finish, done = [], None, False
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            return Outcome("error", status=response.status_code, detail=(await response.aread()).decode())
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    return Outcome("error", "".join(text), status=event["error"].get("code") or 500,
                                   detail=event["error"]["message"])
                text.append(event["choices"][0]["text"])
                finish = event["choices"][0]["finish_reason"] or finish
    if not (done and finish):
        return Outcome("error", "".join(text), detail="the stream ended without a finish or an error")
    return Outcome("complete", "".join(text))


def run_load(bench, count: int = 12, max_tokens: int = 48, during=None) -> list[Outcome]:
    """``count`` requests at once (every other one streamed); ``during`` runs meanwhile."""
    async def main() -> list[Outcome]:
        async with httpx.AsyncClient(timeout=HANG_S + 10, limits=httpx.Limits(max_connections=count)) as client:
            tasks = [asyncio.create_task(_one(client, bench.url, bench.model, i, max_tokens, i % 2 == 0))
                     for i in range(count)]
            if during is not None:
                await asyncio.sleep(0.5)
                await asyncio.to_thread(during)
            done, _ = await asyncio.wait(tasks, timeout=HANG_S)
            return [task.result() if task in done else Outcome("hung") for task in tasks]

    return asyncio.run(main())


def _wait_drained(bench, timeout_s: float = 15.0):
    """Until the engine holds no request and no KV block; its final stats."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = bench.engine_stats()
        if (stats.num_running, stats.num_waiting, stats.kv_usage) == (0, 0, 0.0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.3)


@pytest.fixture(autouse=True)
def settled(bench):
    bench.proxy.set_faults(Faults())
    yield
    bench.proxy.set_faults(Faults())
    stats = _wait_drained(bench)
    assert (stats.num_running, stats.num_waiting, stats.kv_usage) == (0, 0, 0.0), stats


@pytest.fixture(scope="module")
def expected(bench) -> list[str]:
    outcomes = run_load(bench)
    assert [o.kind for o in outcomes] == ["complete"] * len(outcomes), outcomes
    return [o.text for o in outcomes]


def _lost_count(bench, reason: str) -> float:
    for line in bench.metrics().splitlines():
        if line.startswith("hybridlb:lost_requests_total{") and f'reason="{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_repeated_outputs_are_skipped(bench, expected):
    bench.proxy.set_faults(Faults(duplicate=0.3, seed=1))
    outcomes = run_load(bench)
    assert bench.proxy.counts.duplicated > 0
    assert [o.text for o in outcomes] == expected, [o for o in outcomes if o.kind != "complete"]


def test_late_outputs_arrive_whole(bench, expected):
    bench.proxy.set_faults(Faults(delay_s=0.15))
    assert [o.text for o in run_load(bench)] == expected


def test_lost_outputs_fail_their_requests_loudly(bench, expected):
    before = _lost_count(bench, "lost_output")
    bench.proxy.set_faults(Faults(drop=0.05, seed=2))
    outcomes = run_load(bench)
    assert bench.proxy.counts.dropped > 0
    assert "hung" not in [o.kind for o in outcomes]
    failed = [o for o in outcomes if o.kind == "error"]
    assert failed, "a lost message must fail the requests it may have carried"
    assert all("lost" in o.detail for o in failed), failed
    for outcome, text in zip(outcomes, expected, strict=True):  # the others are whole
        assert outcome.kind == "error" or outcome.text == text
    assert _lost_count(bench, "lost_output") > before


def test_reordered_outputs_never_garble_a_text(bench, expected):
    bench.proxy.set_faults(Faults(reorder=0.1, seed=3))
    outcomes = run_load(bench)
    assert bench.proxy.counts.reordered > 0
    for outcome, text in zip(outcomes, expected, strict=True):
        assert outcome.kind == "error" or outcome.text == text, outcome


def test_a_lost_request_times_out_with_504(bench):
    before = _lost_count(bench, "timeout")
    bench.proxy.set_faults(Faults(drop_adds=2))
    started = time.monotonic()
    streamed, whole = run_load(bench, count=2)
    assert whole.kind == "error" and whole.status == 504, whole
    assert streamed.kind == "error" and "api.request_timeout_s" in streamed.detail, streamed
    assert REQUEST_TIMEOUT_S <= time.monotonic() - started < REQUEST_TIMEOUT_S + 5
    assert _lost_count(bench, "timeout") == before + 2


def test_a_stalled_api_server_loses_nothing(direct_bench):
    """The API server stops for 8 s while its engine keeps generating: everything arrives."""
    outcomes = run_load(direct_bench, max_tokens=1500, during=lambda: direct_bench.stall_api(8))
    assert [o.kind for o in outcomes] == ["complete"] * 12, outcomes
    assert all(o.tokens == 1500 for o in outcomes if o.tokens)
    stats = _wait_drained(direct_bench)
    assert (stats.num_running, stats.kv_usage) == (0, 0.0), stats


def test_requests_of_a_dead_api_server_are_aborted(direct_bench):
    """SIGKILL the API server mid-generation: its engine stops generating for it at once.
    (Last: it leaves this bench without an API server.)"""
    threading.Thread(target=run_load, args=(direct_bench, 8, 1900), daemon=True).start()
    deadline = time.monotonic() + 30
    while direct_bench.engine_stats().num_running < 8:
        assert time.monotonic() < deadline, "the requests never started"
    direct_bench.api.kill()
    stats = _wait_drained(direct_bench, timeout_s=5)
    assert (stats.num_running, stats.kv_usage) == (0, 0.0), stats
    assert stats.orphans_aborted == 8
