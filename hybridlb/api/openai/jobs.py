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

import msgspec
from fastapi import Request

from hybridlb.api.errors import APIError
from hybridlb.api.openai import structured
from hybridlb.api.openai.chat_output import ChatOutput
from hybridlb.api.openai.chat_schemas import ChatCompletionRequest
from hybridlb.api.openai.chat_tools import chat_tools
from hybridlb.api.openai.context import ApiContext
from hybridlb.api.openai.reasoning import reasoning_ended, reasoning_opened
from hybridlb.api.openai.schemas import MAX_PROMPTS, CompletionRequest, SamplingRequest
from hybridlb.params import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, Constraint, SamplingParams

MAX_BAD_WORD_CHARS = 1024  # like a stop string's limit; checked before tokenizing
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
    chat: ChatOutput | None = None  # chat: how the text becomes the message (reasoning, tool calls, echo)
    continuous_usage: bool = False  # streamed: usage so far in every chunk
    created: int = field(default_factory=lambda: int(time.time()))


def _token_ids(ctx: ApiContext, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
    if isinstance(prompt, str):
        ids = ctx.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    else:
        vocab = ctx.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        ids = list(prompt)
    if not ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    return ids


def _truncated(ctx: ApiContext, body: SamplingRequest, ids: list[int]) -> list[int]:
    """truncate_prompt_tokens: the prompt's last k tokens (-1: as many as max_model_len allows)."""
    keep = body.truncate_prompt_tokens
    if keep is None:
        return ids
    if keep == -1:
        keep = ctx.pool.max_model_len
    if keep == 0:
        raise APIError(400, "truncate_prompt_tokens must be -1 or at least 1", param="truncate_prompt_tokens")
    return ids[-keep:]


def _params(ctx: ApiContext, body: SamplingRequest, ids: list[int], requested: int | None,
            constraint: Constraint | None) -> SamplingParams:
    limit = ctx.pool.max_model_len
    room = limit - len(ids)
    if room < 1 or (requested is not None and requested > room):
        wanted = f" plus max_tokens={requested}" if requested is not None else ""
        raise APIError(400, f"the prompt has {len(ids)} tokens{wanted}, more than max_model_len={limit}; "
                            "shorten the prompt or lower max_tokens", param="max_tokens")
    params = body.sampling_params(requested, ctx.sampling_defaults)
    extra: dict = {}
    if (lora := ctx.adapters.get(body.model)) is not None:
        extra["lora"] = lora
    if constraint is not None:
        extra["constraint"] = constraint
    if body.bad_words:
        extra["bad_words"] = _bad_words(ctx, body.bad_words)
    params = msgspec.structs.replace(params, **extra) if extra else params
    if (problem := params.out_of_vocab(ctx.pool.vocab_size)) is not None:
        raise APIError(400, problem[1], param=problem[0])
    return params


def _bad_words(ctx: ApiContext, words: list[str]) -> list[list[int]]:
    """Each bad word's token sequences: as written and after a space (mid-sentence), as vLLM bans them."""
    if len(words) > MAX_BAD_WORDS // 2 or any(len(word) > MAX_BAD_WORD_CHARS for word in words):
        raise APIError(400, f"at most {MAX_BAD_WORDS // 2} bad_words of up to {MAX_BAD_WORD_CHARS} characters each",
                       param="bad_words")
    sequences: list[list[int]] = []
    for word in words:
        for text in (word, " " + word.lstrip()):
            ids = ctx.tokenizer.encode(text, add_special_tokens=False)
            if len(ids) > MAX_BAD_WORD_TOKENS:
                raise APIError(400, f"bad word {word[:40]!r}... is {len(ids)} tokens; a bad word may be at most "
                                    f"{MAX_BAD_WORD_TOKENS}", param="bad_words")
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences


def _job_id(prefix: str, body: SamplingRequest) -> str:
    return f"{prefix}-{body.request_id}" if body.request_id else f"{prefix}-{uuid.uuid4().hex}"


def completion_job(ctx: ApiContext, body: CompletionRequest) -> Job:
    body.check_supported()
    texts = body.prompts()
    if len(texts) * body.candidates > MAX_PROMPTS:
        raise APIError(400, f"prompts x {'best_of' if body.best_of else 'n'} is {len(texts) * body.candidates}; "
                            f"at most {MAX_PROMPTS} sequences in one request", param="n")
    constraint = structured.constraint_for(body, ctx.config.engine.structured_outputs)
    prompts = [_truncated(ctx, body, _token_ids(ctx, p, body.add_special_tokens)) for p in texts]
    params = [_params(ctx, body, ids, body.max_tokens, constraint) for ids in prompts]
    echo = [t if isinstance(t, str) else ctx.tokenizer.decode(t) for t in texts] if body.echo else None
    name = body.model or ctx.served_names[0]
    return Job("text_completion", _job_id("cmpl", body), name, prompts, params, body.include_usage,
               body.wants_logprobs, echo, body.choices, body.candidates, continuous_usage=body.continuous_usage)


def _after_reasoning(ctx: ApiContext, constraint: Constraint, parser: str, opened: bool) -> Constraint:
    """Where a reasoning model's constraint starts. deepseek_r1 (and a prompt that opened
    ``<think>``): after ``</think>``. qwen3: an output that does not open with ``<think>`` is
    content, constrained from its first token; so the first token may be the grammar's or
    ``<think>`` (Constraint.opener) where that is one token, as Qwen3's vocabulary has it.
    Where it is not, the model cannot think in Qwen3's way (a misconfigured parser) and the
    grammar starts at once rather than at a ``</think>`` that would never come."""
    if parser == "deepseek_r1" or opened:
        return msgspec.structs.replace(constraint, after=ctx.reasoning_end_ids)
    opener = ctx.reasoning_start_ids
    if len(opener) != 1:
        return constraint
    return msgspec.structs.replace(constraint, after=ctx.reasoning_end_ids, opener=opener)


def chat_job(ctx: ApiContext, body: ChatCompletionRequest) -> Job:
    body.check_supported()
    api = ctx.config.api
    tools = chat_tools(body, api, ctx.config.engine.structured_outputs)
    constraint = tools.constraint or structured.constraint_for(body, ctx.config.engine.structured_outputs)
    text = _render(ctx, body)
    if constraint is not None and api.reasoning_parser and not reasoning_ended(text):
        constraint = _after_reasoning(ctx, constraint, api.reasoning_parser, reasoning_opened(text))
    ids = _truncated(ctx, body, ctx.tokenizer.encode(text, add_special_tokens=body.add_special_tokens))
    params = _params(ctx, body, ids, body.requested_max_tokens, constraint)
    if tools.parser is not None and not tools.parser.skip_special_tokens:
        params = msgspec.structs.replace(params, skip_special_tokens=False)  # its markers are special tokens
    last = body.messages[-1]
    output = ChatOutput(api.reasoning_parser, type(tools.parser) if tools.parser else None, tools.parser_args,
                        body.include_reasoning, last.text() if body.echo and last.role == "assistant" else "",
                        reasoning_opened(text))
    name = body.model or ctx.served_names[0]
    return Job("chat.completion", _job_id("chatcmpl", body), name, [ids], [params], body.include_usage,
               body.wants_logprobs, n=body.choices, candidates=body.candidates, chat=output,
               continuous_usage=body.continuous_usage)


def _render(ctx: ApiContext, body: ChatCompletionRequest) -> str:
    """The prompt text: the template over the messages; with continue_final_message, cut right
    after the last message's text so the model continues it."""
    try:
        text = ctx.tokenizer.apply_chat_template(body.template_messages(), **body.template_arguments())
    except APIError:
        raise
    except Exception as exc:
        raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from None
    if body.continue_final_message:
        final = body.messages[-1].text()
        at = text.rfind(final)
        if not final or at < 0:
            raise APIError(400, "continue_final_message: the chat template does not show the last message's text "
                                "as written", param="continue_final_message")
        text = text[: at + len(final)]
    return text


async def prepare(request: Request, make_job, ctx: ApiContext, body) -> Job:
    """``make_job(ctx, body)`` (a job, or the /tokenize and /detokenize answers): tokenizing and
    templating a large body runs off the event loop, so other requests' tokens keep streaming
    meanwhile."""
    size = request.headers.get("content-length", "")
    if size.isdigit() and int(size) <= INLINE_BODY_BYTES:
        return make_job(ctx, body)
    return await asyncio.get_running_loop().run_in_executor(_preparer, make_job, ctx, body)


