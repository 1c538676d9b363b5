"""api.max_body_bytes_in_flight: an API server holds no more request bodies at once than its
budget (a body is held until its response ends); past it a request gets 429 with Retry-After,
whether its size is declared or arrives in chunks, and what a finished request held is given
back. In-process: the request guard in front of a route that holds its body until released."""

from __future__ import annotations

import asyncio

import httpx
from fastapi import FastAPI, Request

from hybridlb.api.dispatch.admission import BodyBudget, Slots
from hybridlb.api.errors import install_error_handlers
from hybridlb.api.guard import RequestGuard

BODY = 1000


def _app(release: asyncio.Event) -> tuple[FastAPI, BodyBudget]:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def hold(request: Request) -> dict:
        size = len(await request.body())
        await release.wait()
        return {"bytes": size}

    budget = BodyBudget(int(2.5 * BODY))
    app.add_middleware(RequestGuard, api_key=None, max_body_bytes=BODY, slots=Slots(0), budget=budget)
    return app, budget


async def _chunks():
    for _ in range(2):
        yield b"x" * (BODY // 2)


def test_bodies_past_the_budget_wait_for_a_retry():
    async def main() -> None:
        release = asyncio.Event()
        app, budget = _app(release)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api") as client:
            held = [asyncio.create_task(client.post("/v1/completions", content=b"x" * BODY)) for _ in range(2)]
            await asyncio.sleep(0.2)
            assert budget.in_use == 2 * BODY
            declared = await client.post("/v1/completions", content=b"x" * BODY)
            chunked = await client.post("/v1/completions", content=_chunks())
            for refused in (declared, chunked):
                assert refused.status_code == 429, refused.text
                assert "max_body_bytes_in_flight" in refused.json()["error"]["message"]
                assert refused.headers.get("retry-after") == "1"
            release.set()
            assert [(await task).json() for task in held] == [{"bytes": BODY}] * 2
            assert budget.in_use == 0
            again = await client.post("/v1/completions", content=_chunks())
            assert again.status_code == 200 and budget.in_use == 0

    asyncio.run(main())
