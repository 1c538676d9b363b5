"""Many streaming completions in a background thread, each ending complete or with an error."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


@dataclass
class Outcome:
    """What one client saw: ``complete`` (a finish_reason, then [DONE]) or ``error``."""

    url: str
    chunks: int = 0
    kind: str | None = None  # None while still streaming
    finish_reason: str | None = None
    detail: str = ""
    ended_at: float | None = None
    events: list[str] = field(default_factory=list)
    text: str = ""  # what it streamed


class Streams:
    """``count`` streaming completions at once over ``urls`` (round robin)."""

    def __init__(self, urls: list[str], model: str, count: int, max_tokens: int = 400, timeout_s: float = 120):
        self.model, self.max_tokens, self.timeout_s = model, max_tokens, timeout_s
        self.outcomes = [Outcome(urls[i % len(urls)]) for i in range(count)]
        self.thread = threading.Thread(target=asyncio.run, args=(self._main(),), daemon=True)
        self.thread.start()

    async def _main(self) -> None:
        limits = httpx.Limits(max_connections=len(self.outcomes))
        async with httpx.AsyncClient(timeout=self.timeout_s, limits=limits) as client:
            await asyncio.gather(*(self._one(client, outcome, i) for i, outcome in enumerate(self.outcomes)))

    async def _one(self, client: httpx.AsyncClient, outcome: Outcome, i: int) -> None:
        body = {"model": self.model, "prompt": f"Story number {i}:", "max_tokens": self.max_tokens,
                "stream": True, "ignore_eos": True, "temperature": 0}
        try:
            async with client.stream("POST", f"{outcome.url}/v1/completions", json=body) as response:
                if response.status_code != 200:
                    outcome.kind, outcome.detail = "error", f"HTTP {response.status_code}: {await response.aread()}"
                    return
                async for line in response.aiter_lines():
                    self._line(outcome, line)
            if outcome.kind is None:
                outcome.kind = "complete" if outcome.finish_reason else "error"
                outcome.detail = outcome.detail or "the stream ended without a finish_reason or an error"
        except httpx.HTTPError as exc:  # connection reset: the API server died
            outcome.kind, outcome.detail = "error", f"{type(exc).__name__}: {exc}"
        finally:
            outcome.ended_at = time.monotonic()

    @staticmethod
    def _line(outcome: Outcome, line: str) -> None:
        if not line.startswith("data: ") or line == "data: [DONE]":
            return
        event = json.loads(line[6:])
        if "error" in event:
            outcome.kind, outcome.detail = "error", event["error"]["message"]
            return
        outcome.chunks += 1
        outcome.text += event["choices"][0].get("text") or ""
        outcome.finish_reason = event["choices"][0].get("finish_reason") or outcome.finish_reason

    def wait_streaming(self, min_chunks: int = 3, timeout_s: float = 60) -> None:
        """Until every client has received ``min_chunks`` chunks (so a kill lands mid-stream)."""
        deadline = time.monotonic() + timeout_s
        while any(o.chunks < min_chunks and o.kind is None for o in self.outcomes):
            assert time.monotonic() < deadline, [o.chunks for o in self.outcomes]
            time.sleep(0.05)
        assert all(o.kind is None for o in self.outcomes), "a stream ended before the fault"

    def join(self, timeout_s: float) -> list[Outcome]:
        self.thread.join(timeout_s)
        hanging = [o for o in self.outcomes if o.kind is None]
        assert not hanging, f"{len(hanging)} clients still waiting after {timeout_s} s"
        return self.outcomes

    def count(self, kind: str) -> int:
        return sum(o.kind == kind for o in self.outcomes)


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every descendant (all found before anything is killed)."""

    def descendants(p: int) -> list[int]:
        children = []
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                children += [int(c) for c in (task / "children").read_text().split()]
            except FileNotFoundError:
                continue
        return [d for c in children for d in (c, *descendants(c))]

    for victim in [pid, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)


def run_streams(url: str, path: str, bodies: list[dict], kill=None, started: int = 8) -> list[tuple[str, str | None]]:
    """Stream every body to ``url`` + ``path`` (completions or chat) at once; with ``kill``, call it
    once every stream has ``started`` chunks (all under way, none near its end). Each stream's
    (text, finish_reason); an error event or a non-200 answer fails the test."""
    progress = [0] * len(bodies)

    async def one(client: httpx.AsyncClient, i: int) -> tuple[str, str | None]:
        text, reason = [], None
        async with client.stream("POST", f"{url}{path}", json=bodies[i]) as response:
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                assert "error" not in event, event
                for choice in event["choices"]:
                    text.append((choice["delta"].get("content") if "delta" in choice else choice.get("text")) or "")
                    reason = choice.get("finish_reason") or reason
                    progress[i] += 1
        return "".join(text), reason

    async def main() -> list[tuple[str, str | None]]:
        limits = httpx.Limits(max_connections=len(bodies))
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            tasks = [asyncio.create_task(one(client, i)) for i in range(len(bodies))]
            if kill is not None:
                while min(progress) < started:
                    await asyncio.sleep(0.05)
                kill()
            return await asyncio.gather(*tasks)

    return asyncio.run(main())
