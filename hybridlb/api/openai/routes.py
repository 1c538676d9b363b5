"""Every HTTP route of an API server (``ROUTES``, installed on the app by ``install``). Each
takes what it works with as an explicit dependency: the server's ``ApiContext``
(``hybridlb.api.openai.context``)."""

from __future__ import annotations

import asyncio
import time
from typing import Annotated

import msgspec
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from hybridlb import __version__
from hybridlb.api.dispatch.engine_client import EngineConnection
from hybridlb.api.errors import APIError, error_response
from hybridlb.api.openai.chat_schemas import ChatCompletionRequest
from hybridlb.api.openai.context import ApiContext
from hybridlb.api.openai.jobs import chat_job, completion_job, prepare
from hybridlb.api.openai.lora_routes import RUNTIME_ROUTES
from hybridlb.api.openai.responses import respond
from hybridlb.api.openai.schemas import CompletionRequest
from hybridlb.api.openai.tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize, tokenizer_info


def _context(request: Request) -> ApiContext:
    return request.app.state.context


Context = Annotated[ApiContext, Depends(_context)]


async def completions(body: CompletionRequest, request: Request, ctx: Context):
    ctx.serving(body.model)
    return await respond(request, ctx, await prepare(request, completion_job, ctx, body), body.stream)


async def chat_completions(body: ChatCompletionRequest, request: Request, ctx: Context):
    ctx.serving(body.model)
    return await respond(request, ctx, await prepare(request, chat_job, ctx, body), body.stream)


async def tokenize_route(body: TokenizeRequest, request: Request, ctx: Context):
    ctx.serving(body.model)
    return await prepare(request, tokenize, ctx, body)  # a large body off the event loop, as a prompt's


async def detokenize_route(body: DetokenizeRequest, request: Request, ctx: Context):
    ctx.serving(body.model)
    return await prepare(request, detokenize, ctx, body)


async def tokenizer_info_route(ctx: Context):
    ctx.serving(None)
    return tokenizer_info(ctx)


async def models(ctx: Context):
    limit = ctx.pool.max_model_len if ctx.pool.started else None
    config = ctx.config
    cards = [{"id": served, "object": "model", "created": int(time.time()), "owned_by": "hybridlb",
              "root": config.engine.model, "max_model_len": limit} for served in ctx.served_names]
    cards += ctx.adapters.cards()
    if config.engine.simulate is not None:  # never let a benchmark pass for the model's speed
        for card in cards:
            card["simulated"] = f"SIMULATED engines: {config.engine.simulate.step_ms:g} ms per step, no model"
    return {"object": "list", "data": cards}


async def health(ctx: Context):
    """200 while this server can serve (``degraded`` lists what is down); 503 when it cannot."""
    pool = ctx.pool
    if not pool.started:
        return error_response(APIError(503, f"engines not ready yet: {pool.down_ranks}"))
    if (outage := pool.outage()) is not None:
        return error_response(APIError(503, outage))
    problems = pool.problems()
    return JSONResponse({"status": "degraded" if problems else "ok", "problems": problems,
                         "down_ranks": pool.down_ranks})


async def ping(ctx: Context):
    """/health under the name SageMaker-style probes use."""
    return await health(ctx)


async def ranks(ctx: Context):
    pool, spec = ctx.pool, ctx.spec
    snapshot = pool.snapshot
    return {
        "node": spec.node, "api_server": spec.name, "mode": spec.mode,
        "ranks": [engine.rank for engine in pool.engines],
        "coordinator": spec.coordinator_loads,
        "coordinator_silent_s": pool.coordinator_silent_s,
        "lost_ranks": snapshot.lost_ranks if snapshot else [],
        "problems": pool.problems(),
        "engines": [_engine_view(engine) for engine in pool.engines],
        "cluster": [msgspec.to_builtins(stats) for stats in snapshot.engines] if snapshot else None,
        "wave": {"current": snapshot.current_wave, "running": snapshot.engines_running,
                 "messages": snapshot.wave_messages, "completed": snapshot.waves_completed}
        if snapshot else None,
    }


async def load(ctx: Context):
    pool = ctx.pool
    return {"node": ctx.spec.node, "load": pool.load, "engines": sum(engine.alive for engine in pool.engines)}


async def prometheus(ctx: Context):
    metrics = ctx.metrics
    # Multiprocess rendering reads every process's files: off the event loop.
    body = await asyncio.to_thread(metrics.render) if metrics.multiprocess else metrics.render()
    return Response(body, media_type=CONTENT_TYPE_LATEST)


async def scale_elastic_ep(request: Request, ctx: Context):
    """vLLM's resize: ``{"new_data_parallel_size": N, "drain_timeout": S}`` (S default 120), answered
    once the node serves on N ranks; requests keep being served meanwhile (hybridlb.launch.scaling)."""
    try:
        body = msgspec.json.decode(await request.body())
    except msgspec.DecodeError:
        return error_response(APIError(400, "the body is not JSON: send {\"new_data_parallel_size\": N}"))
    size = body.get("new_data_parallel_size") if isinstance(body, dict) else None
    drain = body.get("drain_timeout", 120) if isinstance(body, dict) else None
    if type(size) is not int or size < 1:
        return error_response(APIError(400, "new_data_parallel_size must be a positive integer, the number of ranks "
                                            f"to serve on; got {size!r}", param="new_data_parallel_size"))
    if type(drain) not in (int, float) or not 0 < drain <= 86400:
        return error_response(APIError(400, "drain_timeout must be a positive number of seconds (at most a day): "
                                            f"how long leaving ranks may finish their requests; got {drain!r}",
                                       param="drain_timeout"))
    if ctx.scale is None:
        return error_response(APIError(400, "this server's node cannot be resized from its API server: resizing "
                                            "is supported on one-node clusters of a dense model (`hybridlb serve` "
                                            "or `hybridlb up`)"))
    status, message = await ctx.scale.scale(size, float(drain))
    return JSONResponse({"message": message}) if status == 200 else error_response(APIError(status, message))


async def is_scaling_elastic_ep(ctx: Context):
    return {"is_scaling_elastic_ep": ctx.scale is not None and ctx.scale.scaling}


async def version():
    return {"version": __version__}


# (path, methods, handler), in the order /openapi.json lists them.
ROUTES = (
    ("/v1/completions", ["POST"], completions),
    ("/v1/chat/completions", ["POST"], chat_completions),
    ("/tokenize", ["POST"], tokenize_route),
    ("/detokenize", ["POST"], detokenize_route),
    ("/tokenizer_info", ["GET"], tokenizer_info_route),
    ("/v1/models", ["GET"], models),
    ("/health", ["GET"], health),
    ("/ping", ["GET", "POST"], ping),
    ("/ranks", ["GET"], ranks),
    ("/load", ["GET"], load),
    ("/metrics", ["GET"], prometheus),
    ("/version", ["GET"], version),
    ("/scale_elastic_ep", ["POST"], scale_elastic_ep),
    ("/is_scaling_elastic_ep", ["GET", "POST"], is_scaling_elastic_ep),
)


def install(app: FastAPI, runtime_lora: bool = False) -> None:
    """Add every route to ``app`` (whose ``state.context`` is the ApiContext they take); with
    ``runtime_lora``, vLLM's endpoints that load and unload LoRA adapters too."""
    for path, methods, handler in ROUTES + (RUNTIME_ROUTES if runtime_lora else ()):
        app.add_api_route(path, handler, methods=methods)


def _engine_view(engine: EngineConnection) -> dict:
    """One engine in ``/ranks``: its state, its latest stats and this server's view of it."""
    stats, info = engine.stats, engine.info
    return {
        "rank": engine.rank, "alive": engine.alive, "address": engine.address,
        "num_running": stats.num_running if stats else 0, "num_waiting": stats.num_waiting if stats else 0,
        "kv_usage": stats.kv_usage if stats else 0.0, "dummy_steps": stats.dummy_steps if stats else 0,
        "wave": stats.wave if stats else 0, "wave_running": stats.running if stats else False,
        "collective_s": stats.collective_s if stats else 0.0, "meta_s": stats.meta_s if stats else 0.0,
        "steps": stats.steps if stats else 0, "busy_s": stats.busy_s if stats else 0.0,
        "rss_mib": stats.rss_mib if stats else 0.0,
        "borrowed_steps": stats.borrowed_steps if stats else 0,
        "cached_blocks": stats.cached_blocks if stats else 0,
        "num_kv_blocks": info.num_kv_blocks if info else 0,
        "prefix_hit_rate": round(stats.prefix_hits / stats.prefix_queries, 4)
        if stats and stats.prefix_queries else 0.0,
        "in_flight_here": engine.in_flight, "score": engine.score,
        "dp_group": info.dp_group if info else None,
        "lora_adapters": stats.lora_loaded if stats else [],
    }
