"""The FastAPI application of one API server."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import inspect
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybridlb import __version__
from hybridlb.api.admission import SCOPE_KEY, Slots
from hybridlb.api.completions import chat_job, completion_job, prepare, respond
from hybridlb.api.engine_client import EngineConnection
from hybridlb.api.errors import APIError, error_response, install_error_handlers
from hybridlb.api.frontend import Frontend
from hybridlb.api.metrics import Metrics
from hybridlb.api.schemas import ChatCompletionRequest, CompletionRequest
from hybridlb.api.tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize, tokenizer_info
from hybridlb.config import Config
from hybridlb.model.chat_template import read_template_argument
from hybridlb.model.generation_config import sampling_defaults
from hybridlb.model.spec import load_spec
from hybridlb.model.tokenizer import Tokenizer
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


def _engine_view(engine: EngineConnection) -> dict:
    stats = engine.stats
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
        "num_kv_blocks": engine.info.num_kv_blocks if engine.info else 0,
        "prefix_hit_rate": round(stats.prefix_hits / stats.prefix_queries, 4) if stats and stats.prefix_queries else 0.0,
        "in_flight_here": engine.in_flight, "score": engine.score,
        "dp_group": engine.info.dp_group if engine.info else None,
    }


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


# Probes, scrapers and upstream balancers: no API key, and never refused for load.
OPEN_PATHS = frozenset({"/health", "/ping", "/load", "/metrics", "/version"})


class RequestGuard:
    """ASGI middleware: the API key on every path but ``OPEN_PATHS`` (so a new route is
    guarded by default), the request body size limit, and the first slot of the concurrency
    limit (``Slots``: a request takes the rest once its body says how many sequences it has)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, slots: Slots):
        self.app, self.api_key, self.max_body_bytes, self.slots = app, api_key, max_body_bytes, slots

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self._unauthorized(headers.get(b"authorization", b"")):
            error = APIError(401, "missing or wrong API key; send 'Authorization: Bearer <key>'",
                             code="invalid_api_key")
            return await error_response(error)(scope, receive, send)
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return await self._too_large(scope, receive, send)
        try:
            self.slots.take(1)
        except APIError as busy:
            return await error_response(busy)(scope, receive, send)
        scope[SCOPE_KEY] = 1
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_body_bytes:  # no Content-Length (chunked): stop reading here
                raise StarletteHTTPException(413, self._too_large_message())
            return message

        try:
            return await self.app(scope, counted, send)
        finally:
            self.slots.give_back(scope[SCOPE_KEY])

    def _unauthorized(self, authorization: bytes) -> bool:
        if not self.api_key:
            return False
        return not hmac.compare_digest(authorization, f"Bearer {self.api_key}".encode())

    def _too_large_message(self) -> str:
        return f"request body larger than {self.max_body_bytes} bytes (api.max_body_bytes)"

    async def _too_large(self, scope, receive, send):
        return await error_response(APIError(413, self._too_large_message()))(scope, receive, send)


@dataclass(frozen=True)
class ApiServerSpec:
    """Which engines one API server fronts, and how it fits in the cluster."""

    engines: tuple[tuple[int, str], ...]  # (global rank, address)
    name: str = "api:0"
    node: int = 0
    mode: str = "hybrid"
    coordinator_loads: str | None = None
    policy: str = "cache_aware"
    cluster_token: str | None = None  # keys for TCP sockets (``hybridlb.transport``), resolved by the launcher


async def _follow_coordinator(context: zmq.asyncio.Context, address: str, frontend: Frontend,
                              token: str | None) -> None:
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    connect_securely(sub, address, token)
    sub.connect(address)
    try:
        while True:
            payload = await sub.recv()
            try:
                frontend.on_snapshot(loads_decoder.decode(payload))
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("dropped a malformed load snapshot: %s", exc)
    finally:
        sub.close(linger=0)


def create_app(config: Config, spec: ApiServerSpec, on_ready: Callable[[], None] | None = None,
               observer=None) -> FastAPI:
    """An API server over the engines in ``spec``; ``on_ready`` runs once they all are;
    ``observer`` mirrors metrics elsewhere (see ``Metrics``)."""
    name = config.served_model_name
    metrics = Metrics(name, observer, load_spec(config.engine.model).model_len(config.engine.max_model_len))
    tokenizer = Tokenizer(config.engine.model, read_template_argument(config.api.chat_template)
                          if config.api.chat_template else None)
    defaults = sampling_defaults(config.engine.model, config.api.generation_config)
    state: dict[str, Frontend] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        context = zmq.asyncio.Context()
        client_id = f"{spec.name}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        connections = [EngineConnection(rank, address, f"{client_id}-{rank}", context, metrics.update_stats,
                                        spec.cluster_token, metrics.lost_requests)
                       for rank, address in spec.engines]
        for connection in connections:
            metrics.register_engine(connection.rank)
            connection.start()
        frontend = state["frontend"] = Frontend(connections, tokenizer, metrics, spec.policy,
                                                follows_coordinator=spec.coordinator_loads is not None,
                                                sampling_defaults=defaults, slots=slots,
                                                request_timeout_s=config.api.request_timeout_s)
        tasks = [asyncio.create_task(_announce_ready(connections, on_ready, metrics))]
        if spec.coordinator_loads:
            tasks.append(asyncio.create_task(_follow_coordinator(context, spec.coordinator_loads, frontend,
                                                                  spec.cluster_token)))
        yield
        for task in tasks:
            task.cancel()
        for connection in connections:
            await connection.close()
        context.destroy(linger=0)

    app = FastAPI(title="hybridlb", version=__version__, lifespan=lifespan, **_without_native_telemetry())

    def stop_requests() -> None:  # the server is stopping (``server.make_server``)
        if "frontend" in state:
            state["frontend"].stop_requests()

    app.state.stop_requests = stop_requests
    install_error_handlers(app)
    api_key = config.api.api_key or os.environ.get("HYBRIDLB_API_KEY") or os.environ.get("VLLM_API_KEY")
    slots = Slots(config.api.max_concurrent_requests)
    app.add_middleware(RequestGuard, api_key=api_key, max_body_bytes=config.api.max_body_bytes, slots=slots)

    names = config.served_model_names

    def frontend_for(model: str | None) -> Frontend:
        """The frontend, for a request naming ``model`` (None: a tokenizer call that names none)."""
        if model is not None and model not in names:
            served = ", ".join(f"`{n}`" for n in names)
            raise APIError(404, f"the model `{model}` does not exist; this server serves {served}",
                           param="model", code="model_not_found")
        frontend = state["frontend"]
        if not frontend.started:
            raise APIError(503, "the engines of this node are not ready yet")
        return frontend

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        frontend = frontend_for(body.model)
        return await respond(request, frontend, await prepare(request, completion_job, frontend, body), body.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        frontend = frontend_for(body.model)
        return await respond(request, frontend, await prepare(request, chat_job, frontend, body), body.stream)

    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest):
        return tokenize(frontend_for(body.model), body)

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest):
        return detokenize(frontend_for(body.model), body)

    @app.get("/tokenizer_info")
    async def tokenizer_info_route():
        return tokenizer_info(frontend_for(None))

    @app.get("/v1/models")
    async def models():
        frontend = state["frontend"]
        limit = frontend.max_model_len if frontend.started else None
        cards = [{"id": served, "object": "model", "created": int(time.time()), "owned_by": "hybridlb",
                  "root": config.engine.model, "max_model_len": limit} for served in names]
        if config.engine.simulate is not None:  # never let a benchmark pass for the model's speed
            for card in cards:
                card["simulated"] = f"SIMULATED engines: {config.engine.simulate.step_ms:g} ms per step, no model"
        return {"object": "list", "data": cards}

    @app.get("/health")
    async def health():
        """200 while this server can serve (``degraded`` lists what is down); 503 when it cannot."""
        frontend = state["frontend"]
        if not frontend.started:
            return error_response(APIError(503, f"engines not ready yet: {frontend.down_ranks}"))
        if (outage := frontend.outage()) is not None:
            return error_response(APIError(503, outage))
        problems = frontend.problems()
        return JSONResponse({"status": "degraded" if problems else "ok", "problems": problems,
                             "down_ranks": frontend.down_ranks})

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        """/health under the name SageMaker-style probes use."""
        return await health()

    @app.get("/ranks")
    async def ranks():
        frontend = state["frontend"]
        snapshot = frontend.snapshot
        return {
            "node": spec.node, "api_server": spec.name, "mode": spec.mode,
            "ranks": [engine.rank for engine in frontend.engines],
            "coordinator": spec.coordinator_loads,
            "coordinator_silent_s": frontend.coordinator_silent_s,
            "lost_ranks": snapshot.lost_ranks if snapshot else [],
            "problems": frontend.problems(),
            "engines": [_engine_view(engine) for engine in frontend.engines],
            "cluster": [msgspec.to_builtins(stats) for stats in snapshot.engines] if snapshot else None,
            "wave": {"current": snapshot.current_wave, "running": snapshot.engines_running,
                     "messages": snapshot.wave_messages, "completed": snapshot.waves_completed}
            if snapshot else None,
        }

    @app.get("/load")
    async def load():
        frontend = state["frontend"]
        return {"node": spec.node, "load": frontend.load,
                "engines": sum(engine.alive for engine in frontend.engines)}

    @app.get("/metrics")
    async def prometheus():
        # Multiprocess rendering reads every process's files: off the event loop.
        body = await asyncio.to_thread(metrics.render) if metrics.multiprocess else metrics.render()
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    return app
