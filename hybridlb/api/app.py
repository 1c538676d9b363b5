"""The FastAPI application of one API server: its context, its connections to the node's
engines (opened when the server starts), the coordinator's load snapshots, and the routes
(``hybridlb.api.openai.routes``) behind the request guard (``hybridlb.api.guard``)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import uuid
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio
from fastapi import FastAPI

from hybridlb import __version__, lifecycle
from hybridlb.api.dispatch.admission import BodyBudget, Slots
from hybridlb.api.dispatch.engine_client import EngineConnection
from hybridlb.api.dispatch.lora import AdapterRegistry, runtime_updates_allowed
from hybridlb.api.dispatch.metrics import Metrics
from hybridlb.api.dispatch.pool import EnginePool
from hybridlb.api.dispatch.runner import RequestRunner
from hybridlb.api.dispatch.scaling import ScaleLink
from hybridlb.api.errors import install_error_handlers
from hybridlb.api.guard import RequestGuard
from hybridlb.api.openai import routes
from hybridlb.api.openai.context import ApiContext
from hybridlb.api.openai.logprobs import LogprobFormatter
from hybridlb.api.spec import ApiServerSpec
from hybridlb.checkpoint.chat_template import read_template_argument
from hybridlb.checkpoint.generation_config import sampling_defaults
from hybridlb.checkpoint.spec import load_spec
from hybridlb.checkpoint.tokenizer import Tokenizer
from hybridlb.config import Config
from hybridlb.protocol import loads_decoder
from hybridlb.transport import connect_securely

log = logging.getLogger(__name__)


def _without_native_telemetry() -> dict:
    """FastAPI's own OpenTelemetry hooks switched off where the installed FastAPI has them
    (0.16x): asking on every request whether a tracer is configured cost ~5 % of the API
    server's CPU per request, and hybridlb's metrics are its Prometheus ones."""
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False}}


async def _announce_ready(connections: list[EngineConnection], on_ready: Callable[[], None] | None,
                          metrics: Metrics) -> None:
    while True:
        await asyncio.gather(*(c.wait_ready(3600) for c in connections))
        if all(c.alive for c in connections):
            break
    for connection in connections:
        metrics.engine_ready(connection.info)
    log.info("all %d engines ready", len(connections))
    if on_ready is not None:
        on_ready()


async def _follow_coordinator(context: zmq.asyncio.Context, address: str, ctx: ApiContext) -> None:
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    connect_securely(sub, address, ctx.spec.cluster_token)
    sub.connect(address)
    try:
        while True:
            payload = await sub.recv()
            try:
                snapshot = loads_decoder.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("dropped a malformed load snapshot: %s", exc)
                continue
            ctx.pool.on_snapshot(snapshot)
            ctx.metrics.update_waves(snapshot)
    finally:
        sub.close(linger=0)


def _connector(ctx: ApiContext, context: zmq.asyncio.Context) -> Callable[[int, str], EngineConnection]:
    """What opens (and starts) this server's connection to the engine of a rank at an address."""
    client_id = f"{ctx.spec.name}-{os.getpid()}-{uuid.uuid4().hex[:6]}"

    def connect(rank: int, address: str) -> EngineConnection:
        connection = EngineConnection(rank, address, f"{client_id}-{rank}", context, ctx.metrics.update_stats,
                                      ctx.spec.cluster_token, ctx.metrics.lost_requests, ctx.config.api.engine_stall_s)
        ctx.metrics.register_engine(rank)
        if ctx.adapters.eager:
            connection.on_ready = lambda engine: engine.load_adapters(ctx.adapters.requests())
        connection.start()
        return connection

    return connect


def _scale_link(ctx: ApiContext, connect: Callable[[int, str], EngineConnection]) -> ScaleLink | None:
    """This server's end of the launcher's resize socket, where the launcher has one."""
    if ctx.spec.scale_control is None:
        return None
    address, key = ctx.spec.scale_control
    try:
        return ScaleLink(address, key, ctx.pool, connect, lambda engine: ctx.metrics.engine_ready(engine.info),
                         ctx.metrics.forget_engine, ctx.metrics.resized)
    except (OSError, EOFError) as exc:
        log.warning("cannot reach the launcher's resize socket %s (%s): POST /scale_elastic_ep is refused", address,
                    exc)
        return None


def create_app(config: Config, spec: ApiServerSpec, on_ready: Callable[[], None] | None = None,
               observer=None) -> FastAPI:
    """An API server over the engines in ``spec``; ``on_ready`` runs once they all are;
    ``observer`` mirrors metrics elsewhere (see ``Metrics``)."""
    metrics = Metrics(config.served_model_name, observer,
                      load_spec(config.engine.model).model_len(config.engine.max_model_len),
                      config.engine.lora.max_loras if config.engine.lora else 0)
    template = read_template_argument(config.api.chat_template) if config.api.chat_template else None
    tokenizer = Tokenizer(config.engine.model, template)
    ctx = ApiContext(config, spec, tokenizer, metrics, Slots(config.api.max_concurrent_requests),
                     sampling_defaults(config.engine.model, config.api.generation_config), LogprobFormatter(tokenizer),
                     AdapterRegistry(config))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        context = zmq.asyncio.Context()
        connect = _connector(ctx, context)
        connections = [connect(rank, address) for rank, address in spec.engines]
        ctx.pool = EnginePool(connections, spec.policy, follows_coordinator=spec.coordinator_loads is not None,
                              one_rank_child=spec.mode == "multi_port")
        ctx.runner = RequestRunner(ctx.pool, tokenizer, metrics, config.api.request_timeout_s,
                                   config.api.migration_limit)
        ctx.scale = _scale_link(ctx, connect)
        tasks = [asyncio.create_task(_announce_ready(connections, on_ready, metrics))]
        if spec.coordinator_loads:
            tasks.append(asyncio.create_task(lifecycle.supervised(
                "the coordinator's follower", lambda: _follow_coordinator(context, spec.coordinator_loads, ctx))))
        yield
        for task in tasks:
            task.cancel()
        if ctx.scale is not None:
            ctx.scale.close()
        for connection in ctx.pool.engines:
            await connection.close()
        context.destroy(linger=0)

    app = FastAPI(title="hybridlb", version=__version__, lifespan=lifespan, **_without_native_telemetry())
    app.state.context = ctx

    def stop_requests() -> None:  # the server is stopping (``http_server.make_server``)
        if ctx.pool is not None:
            ctx.pool.stop_requests()

    app.state.stop_requests = stop_requests
    install_error_handlers(app)
    api_key = config.api.api_key or os.environ.get("HYBRIDLB_API_KEY") or os.environ.get("VLLM_API_KEY")
    app.add_middleware(RequestGuard, api_key=api_key, max_body_bytes=config.api.max_body_bytes, slots=ctx.slots,
                       body_timeout_s=config.api.body_timeout_s, budget=BodyBudget(config.api.max_body_bytes_in_flight))
    routes.install(app, runtime_lora=config.engine.lora is not None and runtime_updates_allowed())
    return app
