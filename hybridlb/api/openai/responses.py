"""/v1/completions and /v1/chat/completions, second half: run a ``Job``'s sequences and
answer, whole or streamed.

A Job becomes one engine request per prompt and candidate. Non-streamed responses are
gathered while watching for the client to disconnect; streamed ones are SSE chunks
ending with ``data: [DONE]``. Either way, a client that goes away aborts its engine
requests. What turns a sequence's text into a response's fields (``_choice``: the text,
its log-probabilities; a tool-call or reasoning parser would split it into
``tool_calls`` / ``reasoning_content`` here) is shared by both shapes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from hybridlb.api.errors import APIError
from hybridlb.api.openai.context import ApiContext
from hybridlb.api.openai.jobs import Job
from hybridlb.params import SamplingParams

log = logging.getLogger(__name__)
_json = msgspec.json.Encoder()
# Characters valid raw in JSON that line splitters following str.splitlines() (httpx's
# aiter_lines, for one) take for line ends, cutting an SSE event in two: sent escaped.
_LINE_BREAKS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))

RANK_HEADER = "x-data-parallel-rank"


def _event(body) -> bytes:
    """One SSE event carrying ``body`` as JSON on a single line, whatever text it holds."""
    data = _json.encode(body)
    for raw, escaped in _LINE_BREAKS:
        if raw in data:
            data = data.replace(raw, escaped)
    return b"data: " + data + b"\n\n"


@dataclass
class Choice:
    """One choice's output so far (a whole response, or the part a stream has not sent yet)."""

    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # TokenLogprobs, or None for a prompt's first token

    def add(self, delta) -> None:
        self.text.append(delta.text)
        self.num_tokens += delta.num_tokens
        self.finish_reason = delta.finish_reason
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs or []


def _pinned_rank(request: Request) -> int | None:
    value = request.headers.get(RANK_HEADER)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise APIError(400, f"X-data-parallel-rank must be an integer, got {value!r}",
                       param="X-data-parallel-rank") from None


async def respond(request: Request, ctx: ApiContext, job: Job, stream: bool) -> Response:
    rank = ctx.pool.resolve_rank(_pinned_rank(request))
    if not any(engine.alive for engine in ctx.pool.engines):
        raise APIError(503, "no engine is available on this node")
    ctx.slots.hold(request.scope, len(job.prompts) * job.candidates)
    # Sequence s is candidate s % candidates of prompt s // candidates.
    streams = [ctx.runner.generate(f"{job.id}-{i}-{c}", ids, _candidate(params, c), rank)
               for i, (ids, params) in enumerate(zip(job.prompts, job.params, strict=True))
               for c in range(job.candidates)]
    if stream:
        # The headers wait for the first item: a request refused before it produced anything
        # (429 with Retry-After, 503) gets that status, which clients and SDKs retry on.
        merged = _merged(job, streams)
        first = await anext(merged, None)
        if first is not None and isinstance(first[1], APIError):
            await merged.aclose()
            raise first[1]
        return StreamingResponse(_sse(ctx, job, _then(first, merged)), media_type="text/event-stream")
    result = await _unless_disconnected(request, _collect(ctx, job, streams))
    return JSONResponse(result) if result is not None else Response(status_code=499)


def _candidate(params: SamplingParams, index: int) -> SamplingParams:
    """The params of a prompt's ``index``-th sequence: a seeded request's others draw from seed + index."""
    if index == 0 or params.seed is None:
        return params
    return msgspec.structs.replace(params, seed=params.seed + index)


def _best(job: Job, results: list[Choice]) -> list[Choice]:
    """Per prompt, its n sequences: all of them, or with best_of the n of highest log-probability."""
    kept = []
    for start in range(0, len(results), job.candidates):
        group = results[start : start + job.candidates]
        if job.candidates > job.n:
            group = sorted(group, key=lambda c: -sum(lp.logprob for lp in c.logprobs if lp is not None))[: job.n]
        kept += group
    return kept


async def _collect(ctx: ApiContext, job: Job, streams: list[AsyncIterator]) -> dict:
    async def one(index: int, stream: AsyncIterator) -> Choice:
        choice = Choice()
        async for delta in stream:
            if not choice.text:  # the first delta
                _prepend_prompt(job, index // job.candidates, choice, delta)
            choice.add(delta)
        return choice

    tasks = [asyncio.ensure_future(one(i, s)) for i, s in enumerate(streams)]
    try:
        results = await asyncio.gather(*tasks)
    finally:  # on failure or cancellation, stop every prompt's generation, not just one
        for task in tasks:
            task.cancel()
    completion = sum(result.num_tokens for result in results)  # every sequence generated counts
    results = _best(job, results)
    choices = [_choice(ctx, job, index, result, 0) for index, result in enumerate(results)]
    if job.chat is not None:
        for choice in choices:
            choice["message"], choice["finish_reason"] = job.chat.shape().whole(choice.pop("text"),
                                                                                choice["finish_reason"])
    return {"id": job.id, "object": job.kind, "created": job.created, "model": job.model,
            "choices": choices, "usage": _usage(job, completion)}


def _prepend_prompt(job: Job, index: int, choice: Choice, delta) -> None:
    """Completions with echo: the prompt's text (and log-probabilities) come before the output."""
    if job.echo is None:
        return
    choice.text.append(job.echo[index])
    choice.token_ids += job.prompts[index]
    if job.logprobs:
        choice.logprobs += delta.prompt_logprobs or [None] * len(job.prompts[index])


def _choice(ctx: ApiContext, job: Job, index: int, choice: Choice, offset: int) -> dict:
    """The choice object (``text`` holds its text in either API) with its log-probabilities."""
    text = "".join(choice.text)
    logprobs = None
    if job.logprobs and job.kind == "chat.completion":
        logprobs = ctx.logprob_format.chat(choice.logprobs)
    elif job.logprobs:
        logprobs = ctx.logprob_format.completion(choice.token_ids, choice.logprobs, offset)
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": choice.finish_reason}


def _usage_of(job: Job, index: int, completion_tokens: int) -> dict:
    """continuous_usage_stats: one choice's usage so far (its prompt's tokens and its own)."""
    prompt = len(job.prompts[index // job.candidates])
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens}


def _usage(job: Job, completion_tokens: int) -> dict:
    prompt = sum(len(p) for p in job.prompts)
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens}


async def _unless_disconnected(request: Request, work):
    """Run ``work``; if the client disconnects first, cancel it (which aborts the requests)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    return None


def _chunk(job: Job, choice: dict, first: bool, fields: dict | None, usage: dict | None) -> bytes:
    """One choice's chunk; ``fields``: a chat delta's fields (content, reasoning, tool calls)."""
    if job.kind == "chat.completion":
        choice.pop("text")
        choice["delta"] = {"role": "assistant", "content": "", **fields} if first else fields
        kind = "chat.completion.chunk"
    else:
        kind = "text_completion"
    body = {"id": job.id, "object": kind, "created": job.created, "model": job.model, "choices": [choice]}
    if usage is not None:
        body["usage"] = usage
    return _event(body)


async def _then(first, rest: AsyncIterator) -> AsyncIterator:
    """``first`` (when not None), then the rest of ``rest``."""
    try:
        if first is not None:
            yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


async def _sse(ctx: ApiContext, job: Job, merged: AsyncIterator) -> AsyncIterator[bytes]:
    """The SSE body; a failure while writing it ends the stream with an error event, never silently."""
    try:
        async for event in _events(ctx, job, merged):
            yield event
    except Exception as exc:
        log.exception("streaming response %s failed", job.id)
        yield _event(APIError(500, f"internal error: {type(exc).__name__}: {exc}").body())
        yield b"data: [DONE]\n\n"


async def _tagged(job: Job, index: int, stream: AsyncIterator) -> AsyncIterator[tuple[int, object]]:
    """One choice's deltas as ``(index, delta)``; a failure becomes a last ``(index, APIError)``,
    so a choice never ends silently."""
    try:
        async for delta in stream:
            yield index, delta
    except APIError as exc:
        yield index, exc
    except Exception as exc:
        log.exception("streaming request %s failed", job.id)
        yield index, APIError(500, f"internal error: {type(exc).__name__}: {exc}")


async def _merged(job: Job, streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """Every choice's ``_tagged`` items in the order they come. One stream (the usual case) is
    read directly: no task and no queue hop per chunk."""
    if len(streams) == 1:
        try:
            async for item in _tagged(job, 0, streams[0]):
                yield item
        finally:
            await streams[0].aclose()  # its finally (the abort) runs now, not when the garbage collector gets to it
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator) -> None:
        try:
            async for item in _tagged(job, index, stream):
                await queue.put(item)
        finally:
            await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            index, item = await queue.get()
            if item is None:
                open_streams -= 1
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def _events(ctx: ApiContext, job: Job, merged: AsyncIterator) -> AsyncIterator[bytes]:
    """``merged``: every choice's items (``_merged``)."""
    # Per choice: what is not sent yet (tokens whose text is still incomplete), characters
    # sent so far (the completions text_offset), and whether anything was sent.
    count = len(job.prompts) * job.candidates
    pending = [Choice() for _ in range(count)]
    offsets = [0] * count
    started = [False] * count
    shapes = [job.chat.shape() for _ in range(count)] if job.chat is not None else None
    tokens = [0] * count
    completion = 0
    async for index, item in merged:
        if isinstance(item, APIError):
            yield _event(item.body())
            continue
        completion += item.num_tokens
        tokens[index] += item.num_tokens
        choice = pending[index]
        if not started[index] and not choice.text:
            _prepend_prompt(job, index // job.candidates, choice, item)
        choice.add(item)
        text = "".join(choice.text)
        fields = None
        if shapes is not None:  # chat: the text becomes content, reasoning and tool calls (some held back)
            fields = shapes[index].push(text, final=item.finish_reason is not None)
            choice.finish_reason = shapes[index].finish_reason(item.finish_reason)
            choice.text = []
            ready = bool(fields) or item.finish_reason is not None
        else:
            ready = bool(text) or item.finish_reason is not None  # an empty chunk would read as a first token
        if ready:
            body = _choice(ctx, job, index, choice, offsets[index])
            usage = _usage_of(job, index, tokens[index]) if job.continuous_usage else None
            yield _chunk(job, body, not started[index], fields, usage)
            started[index], offsets[index], pending[index] = True, offsets[index] + len(text), Choice()
    if job.include_usage:
        usage = {"id": job.id, "object": f"{job.kind}.chunk" if job.kind == "chat.completion" else job.kind,
                 "created": job.created, "model": job.model, "choices": [], "usage": _usage(job, completion)}
        yield _event(usage)
    yield b"data: [DONE]\n\n"
