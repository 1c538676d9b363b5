"""/v1/completions and /v1/chat/completions, first half: a request body becomes a ``Job``
— validated, its chat template rendered, tokenized, its sampling params checked.

Anything a request asks of the engines beyond sampling (a grammar its output must match,
a LoRA adapter) is checked here, before any engine sees the request, and rides in the
Job's ``SamplingParams``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import Request

from hybridlb.api.context import ApiContext
from hybridlb.api.errors import APIError
from hybridlb.api.schemas import MAX_PROMPTS, ChatCompletionRequest, CompletionRequest, SamplingRequest
from hybridlb.protocol import SamplingParams

INLINE_BODY_BYTES = 16 * 2**10  # smaller bodies are tokenized on the event loop (a thread hop costs more)
_preparer = ThreadPoolExecutor(1, thread_name_prefix="prepare")  # one at a time: the GIL serializes them anyway


@dataclass
class Job:
    """Everything one HTTP request resolved to before generation starts."""

    kind: str  # "text_completion" or "chat.completion"
    id: str
    model: str
    prompts: list[list[int]]
    params: list[SamplingParams]
    include_usage: bool
    logprobs: bool = False  # whether choices show log-probabilities
    echo: list[str] | None = None  # completions with echo: each prompt's text, shown before its output
    n: int = 1  # choices per prompt
    candidates: int = 1  # sequences generated per prompt (best_of); the n most likely are returned
    created: int = field(default_factory=lambda: int(time.time()))


def _token_ids(ctx: ApiContext, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        ids = ctx.tokenizer.encode(prompt)
    else:
        vocab = ctx.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        ids = list(prompt)
    if not ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    return ids


def _params(ctx: ApiContext, body: SamplingRequest, ids: list[int], requested: int | None) -> SamplingParams:
    limit = ctx.pool.max_model_len
    room = limit - len(ids)
    if room < 1 or (requested is not None and requested > room):
        wanted = f" plus max_tokens={requested}" if requested is not None else ""
        raise APIError(400, f"the prompt has {len(ids)} tokens{wanted}, more than max_model_len={limit}; "
                            "shorten the prompt or lower max_tokens", param="max_tokens")
    return body.sampling_params(requested, ctx.sampling_defaults)


def completion_job(ctx: ApiContext, body: CompletionRequest) -> Job:
    body.check_supported()
    texts = body.prompts()
    if len(texts) * body.candidates > MAX_PROMPTS:
        raise APIError(400, f"prompts x {'best_of' if body.best_of else 'n'} is {len(texts) * body.candidates}; "
                            f"at most {MAX_PROMPTS} sequences in one request", param="n")
    prompts = [_token_ids(ctx, p) for p in texts]
    params = [_params(ctx, body, ids, body.max_tokens) for ids in prompts]
    echo = [t if isinstance(t, str) else ctx.tokenizer.decode(t) for t in texts] if body.echo else None
    name = body.model or ctx.served_names[0]
    return Job("text_completion", f"cmpl-{uuid.uuid4().hex}", name, prompts, params, body.include_usage,
               body.wants_logprobs, echo, body.choices, body.candidates)


def chat_job(ctx: ApiContext, body: ChatCompletionRequest) -> Job:
    body.check_supported()
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        text = ctx.tokenizer.apply_chat_template(messages, **body.template_arguments())
    except Exception as exc:
        raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from None
    ids = ctx.tokenizer.encode(text, add_special_tokens=False)
    params = _params(ctx, body, ids, body.requested_max_tokens)
    name = body.model or ctx.served_names[0]
    return Job("chat.completion", f"chatcmpl-{uuid.uuid4().hex}", name, [ids], [params], body.include_usage,
               body.wants_logprobs, n=body.choices, candidates=body.candidates)


async def prepare(request: Request, make_job, ctx: ApiContext, body) -> Job:
    """``make_job(ctx, body)``: tokenizing and templating a large body runs off the event
    loop, so other requests' tokens keep streaming meanwhile."""
    size = request.headers.get("content-length", "")
    if size.isdigit() and int(size) <= INLINE_BODY_BYTES:
        return make_job(ctx, body)
    return await asyncio.get_running_loop().run_in_executor(_preparer, make_job, ctx, body)


