"""Many concurrent streams, and clients that hang up mid-stream."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time

import httpx


def metric(url: str, name: str, engine: int = 0) -> float:
    """Sum of every series of ``name`` for ``engine`` (e.g. over finished_reason)."""
    text = httpx.get(f"{url}/metrics").text
    values = re.findall(rf'^{re.escape(name)}{{[^}}]*engine="{engine}"[^}}]*}} (\S+)$', text, re.M)
    assert values, f"{name} missing from /metrics"
    return sum(float(v) for v in values)


def wait_idle(url: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (metric(url, "vllm:num_requests_running") == 0 and metric(url, "vllm:num_requests_waiting") == 0
                and metric(url, "vllm:kv_cache_usage_perc") == 0):
            return
        time.sleep(0.2)
    raise AssertionError("the engine still holds requests or KV blocks")


def test_200_concurrent_streams_all_succeed(server):
    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, str | None, str]:
        body = {"model": server.model, "prompt": f"Request number {i}:", "max_tokens": 12, "temperature": 0,
                "stream": True, "ignore_eos": True}
        reasons, text = [], ""
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    choice = httpx.Response(200, content=line[6:]).json()["choices"][0]
                    text += choice["text"]
                    reasons.append(choice["finish_reason"])
        return response.status_code, [r for r in reasons if r], text

    async def main():
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(200)))

    before = metric(server.url, 'vllm:request_success_total')
    results = asyncio.run(main())
    assert [status for status, _, _ in results] == [200] * 200
    assert all(reasons == ["length"] for _, reasons, _ in results)
    assert metric(server.url, 'vllm:request_success_total') - before == 200
    wait_idle(server.url)


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    async def hang_up(streaming: bool):
        body = {"model": server.model, "prompt": "Keep talking", "max_tokens": 480, "temperature": 0,
                "stream": streaming, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            if streaming:
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            break  # read one chunk, then hang up
            else:
                with contextlib.suppress(httpx.ReadTimeout):
                    await client.post("/v1/completions", json=body, timeout=0.3)

    async def main():
        await asyncio.gather(*(hang_up(streaming=i % 2 == 0) for i in range(6)))

    completed_before = metric(server.url, "vllm:request_success_total")
    asyncio.run(main())
    wait_idle(server.url)
    # 480 tokens each would take several seconds: had they not been aborted, they would
    # have been counted as completed by now.
    time.sleep(1)
    assert metric(server.url, "vllm:request_success_total") == completed_before
