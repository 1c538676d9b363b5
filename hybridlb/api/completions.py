"""/v1/completions and /v1/chat/completions: validate, tokenize, generate, respond.

A request becomes one engine request per prompt. Non-streamed responses are gathered
while watching for the client to disconnect; streamed ones are SSE chunks ending with
``data: [DONE]``. Either way, a client that goes away aborts its engine requests.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from hybridlb.api.errors import APIError
from hybridlb.api.frontend import Frontend
from hybridlb.api.schemas import ChatCompletionRequest, CompletionRequest, _Sampling
from hybridlb.protocol import SamplingParams

_json = msgspec.json.Encoder()
RANK_HEADER = "x-data-parallel-rank"


@dataclass
class Job:
    """Everything one HTTP request resolved to before generation starts."""

    kind: str  # "text_completion" or "chat.completion"
    id: str
    model: str
    prompts: list[list[int]]
    params: list[SamplingParams]
    include_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))


def _pinned_rank(request: Request) -> int | None:
    value = request.headers.get(RANK_HEADER)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise APIError(400, f"X-data-parallel-rank must be an integer, got {value!r}",
                       param="X-data-parallel-rank") from None


def _token_ids(frontend: Frontend, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        ids = frontend.tokenizer.encode(prompt)
    else:
        vocab = frontend.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        ids = list(prompt)
    if not ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    return ids


def _params(frontend: Frontend, body: _Sampling, ids: list[int], requested: int | None) -> SamplingParams:
    limit = frontend.max_model_len
    room = limit - len(ids)
    if room < 1 or (requested is not None and requested > room):
        wanted = f" plus max_tokens={requested}" if requested is not None else ""
        raise APIError(400, f"the prompt has {len(ids)} tokens{wanted}, more than max_model_len={limit}; "
                            "shorten the prompt or lower max_tokens", param="max_tokens")
    return body.sampling_params(requested, frontend.sampling_defaults)


def completion_job(frontend: Frontend, body: CompletionRequest) -> Job:
    body.check_supported()
    prompts = [_token_ids(frontend, p) for p in body.prompts()]
    params = [_params(frontend, body, ids, body.max_tokens) for ids in prompts]
    return Job("text_completion", f"cmpl-{uuid.uuid4().hex}", body.model, prompts, params, body.include_usage)


def chat_job(frontend: Frontend, body: ChatCompletionRequest) -> Job:
    body.check_supported()
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        text = frontend.tokenizer.apply_chat_template(messages, **body.template_arguments())
    except Exception as exc:
        raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from None
    ids = frontend.tokenizer.encode(text, add_special_tokens=False)
    params = _params(frontend, body, ids, body.requested_max_tokens)
    return Job("chat.completion", f"chatcmpl-{uuid.uuid4().hex}", body.model, [ids], [params], body.include_usage)


async def respond(request: Request, frontend: Frontend, job: Job, stream: bool) -> Response:
    rank = _pinned_rank(request)
    frontend.check_rank(rank)
    if not any(engine.alive for engine in frontend.engines):
        raise APIError(503, "no engine is available on this node")
    streams = [frontend.generate(f"{job.id}-{i}", ids, params, rank)
               for i, (ids, params) in enumerate(zip(job.prompts, job.params, strict=True))]
    if stream:
        return StreamingResponse(_sse(job, streams), media_type="text/event-stream")
    result = await _unless_disconnected(request, _collect(job, streams))
    return JSONResponse(result) if result is not None else Response(status_code=499)


async def _collect(job: Job, streams: list[AsyncIterator]) -> dict:
    async def one(index: int, stream: AsyncIterator) -> tuple[str, int, str]:
        text, tokens, reason = [], 0, None
        async for delta in stream:
            text.append(delta.text)
            tokens += delta.num_tokens
            reason = delta.finish_reason
        return "".join(text), tokens, reason

    tasks = [asyncio.ensure_future(one(i, s)) for i, s in enumerate(streams)]
    try:
        results = await asyncio.gather(*tasks)
    finally:  # on failure or cancellation, stop every prompt's generation, not just one
        for task in tasks:
            task.cancel()
    choices = []
    for index, (text, _, reason) in enumerate(results):
        if job.kind == "chat.completion":
            choices.append({"index": index, "message": {"role": "assistant", "content": text},
                            "logprobs": None, "finish_reason": reason})
        else:
            choices.append({"index": index, "text": text, "logprobs": None, "finish_reason": reason})
    completion = sum(tokens for _, tokens, _ in results)
    return {"id": job.id, "object": job.kind, "created": job.created, "model": job.model,
            "choices": choices, "usage": _usage(job, completion)}


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


def _chunk(job: Job, index: int, text: str | None, reason: str | None, first: bool) -> bytes:
    if job.kind == "chat.completion":
        delta = {"role": "assistant", "content": text or ""} if first else {"content": text} if text else {}
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": reason}
        kind = "text_completion"
    body = {"id": job.id, "object": kind, "created": job.created, "model": job.model, "choices": [choice]}
    return b"data: " + _json.encode(body) + b"\n\n"


async def _sse(job: Job, streams: list[AsyncIterator]) -> AsyncIterator[bytes]:
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator) -> None:
        try:
            async for delta in stream:
                await queue.put((index, delta))
        except APIError as exc:
            await queue.put((index, exc))
        finally:
            await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        if job.kind == "chat.completion":
            yield _chunk(job, 0, "", None, first=True)
        open_streams, completion = len(streams), 0
        while open_streams:
            index, item = await queue.get()
            if item is None:
                open_streams -= 1
            elif isinstance(item, APIError):
                yield b"data: " + _json.encode(item.body()) + b"\n\n"
            elif item.text or item.finish_reason:
                completion += item.num_tokens
                yield _chunk(job, index, item.text, item.finish_reason, first=False)
            else:
                completion += item.num_tokens
        if job.include_usage:
            usage = {"id": job.id, "object": f"{job.kind}.chunk" if job.kind == "chat.completion" else job.kind,
                     "created": job.created, "model": job.model, "choices": [], "usage": _usage(job, completion)}
            yield b"data: " + _json.encode(usage) + b"\n\n"
        yield b"data: [DONE]\n\n"
    finally:
        for task in tasks:
            task.cancel()
