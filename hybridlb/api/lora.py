"""LoRA adapters as one API server serves them: the names requests may give as ``model``
(``--lora-modules``, and adapters loaded at run time), their cards in /v1/models, and vLLM's
runtime endpoints ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (present only
with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` set, as in vLLM).

An adapter is checked against the base model when it is registered (a bad directory is a
400 naming the problem); engines read it when a request first needs it, or at once with
``engine.lora.load: eager`` (then again whenever an engine restarts). Registering is this
API server's alone: with several API servers on a node, load an adapter on each (or list it
in ``--lora-modules``).

A client loads adapters only from inside the allowed roots (``engine.lora.allowed_roots``), and
every reason there is no adapter to read at its path gets one error text, so the errors cannot
map the server's files.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import msgspec
from fastapi import Request
from fastapi.responses import PlainTextResponse

from hybridlb.api.errors import APIError
from hybridlb.checkpoint.lora import WEIGHTS_FILE, AdapterError, AdapterMissing, read_adapter
from hybridlb.checkpoint.spec import ModelSpec, load_spec
from hybridlb.config import Config, LoRAConfig
from hybridlb.params import LoRARequest

log = logging.getLogger(__name__)

RUNTIME_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
NAME = re.compile(r"[^\s,]{1,128}")  # names are joined with commas in vllm:lora_requests_info
NO_ROOTS = ("loading adapters at run time is off: no allowed roots; start the server with --lora-allowed-root "
            "DIR (engine.lora.allowed_roots), the directory clients may load adapters from")


def runtime_updates_allowed() -> bool:
    return os.environ.get(RUNTIME_UPDATES_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def allowed_roots(lora: LoRAConfig) -> list[str]:
    """The directories clients may load adapters from, resolved: engine.lora.allowed_roots, by
    default the directories holding the --lora-modules adapters."""
    roots = lora.allowed_roots
    if roots is None:
        roots = [os.path.dirname(os.path.abspath(module.path)) for module in lora.modules]
    return sorted({os.path.realpath(root) for root in roots})


def inside(path: str, roots: list[str]) -> bool:
    """Whether ``path``, its symlinks and ``..`` resolved, is one of ``roots`` or lies under one."""
    try:
        resolved = os.path.realpath(path)
    except (OSError, ValueError):  # a NUL byte, a name too long
        return False
    return any(os.path.commonpath([root, resolved]) == root for root in roots)


def no_adapter_at(path: str) -> str:
    """The one error text for every reason a client's path has no adapter to read: outside the
    roots, missing, not a directory, no adapter_config.json, unreadable. Telling them apart
    would let a client map the server's files."""
    return (f"no loadable LoRA adapter at {path} under the allowed roots (--lora-allowed-root, "
            "engine.lora.allowed_roots)")


@dataclass(frozen=True)
class Adapter:
    request: LoRARequest  # what rides in SamplingParams
    parent: str  # the served model name it adapts (/v1/models "parent")
    created: int


class AdapterRegistry:
    """The adapters this API server answers to, by name."""

    def __init__(self, config: Config):
        self.lora = config.engine.lora
        self.base_names = config.served_model_names
        self.model = config.engine.model
        self._spec: ModelSpec | None = None
        self.adapters: dict[str, Adapter] = {}
        self.roots = allowed_roots(self.lora) if self.lora else []
        for module in self.lora.modules if self.lora else []:
            self.add(module.name, module.path, module.base_model_name)

    @property
    def enabled(self) -> bool:
        return self.lora is not None

    @property
    def eager(self) -> bool:
        """Engines read adapters as they are registered (engine.lora.load eager)."""
        return self.lora is not None and self.lora.load == "eager"

    def requests(self) -> list[LoRARequest]:
        return [adapter.request for adapter in self.adapters.values()]

    def get(self, name: str | None) -> LoRARequest | None:
        adapter = self.adapters.get(name) if name is not None else None
        return adapter.request if adapter is not None else None

    def load(self, name: str, path: str) -> Adapter:
        """Register a client's adapter (/v1/load_lora_adapter), only from under the allowed roots.
        A problem of the adapter there is an AdapterError naming it; no adapter to read is one
        text whatever the reason (the log says which)."""
        if not self.roots:
            raise AdapterError(NO_ROOTS)
        try:
            if not inside(path, self.roots):
                raise AdapterMissing(f"{path} lies outside the allowed roots {self.roots}")
            return self.add(name, path)
        except AdapterMissing as exc:
            log.warning("LoRA adapter %r not loaded: %r", name, str(exc))  # a path may hold control characters
            raise AdapterError(no_adapter_at(path)) from None

    def add(self, name: str, path: str, parent: str | None = None) -> Adapter:
        """Register an adapter after checking it (AdapterError names what is wrong)."""
        if self._spec is None:
            self._spec = load_spec(self.model)
        read_adapter(path, self._spec, self.lora.max_lora_rank)
        try:  # the version: the same on every API server of the node
            version = (Path(path) / WEIGHTS_FILE).stat().st_mtime_ns
        except OSError as exc:
            raise AdapterMissing(f"{path}: {exc.strerror}") from None
        adapter = Adapter(LoRARequest(name, path, version), parent or self.base_names[0], int(time.time()))
        self.adapters[name] = adapter
        return adapter

    def cards(self) -> list[dict]:
        """/v1/models entries, vLLM's shape: ``root`` the adapter's path, ``parent`` the base model."""
        return [{"id": name, "object": "model", "created": a.created, "owned_by": "hybridlb", "root": a.request.path,
                 "parent": a.parent, "max_model_len": None} for name, a in self.adapters.items()]


class LoadLoRAAdapter(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_path: Annotated[str, msgspec.Meta(max_length=4096)]  # PATH_MAX: error messages quote it
    load_inplace: bool = False  # replace an adapter of the same name (vLLM's flag)


class UnloadLoRAAdapter(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_int_id: int | None = None  # vLLM accepts it; names identify adapters here


async def _body(request: Request, kind: type):
    try:
        return msgspec.json.decode(await request.body(), type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise APIError(400, f"invalid request body: {exc}") from None


async def load_lora_adapter(request: Request):
    ctx = request.app.state.context
    registry: AdapterRegistry = ctx.adapters
    body = await _body(request, LoadLoRAAdapter)
    if not registry.enabled:
        raise APIError(400, "this server serves no LoRA adapters; start it with --enable-lora")
    if not body.lora_name.strip() or not body.lora_path.strip():
        raise APIError(400, "both 'lora_name' and 'lora_path' must be provided", param="lora_name")
    if not NAME.fullmatch(body.lora_name):
        raise APIError(400, "lora_name must be 1 to 128 characters without spaces or commas", param="lora_name")
    if body.lora_name in ctx.served_names:
        raise APIError(400, f"'{body.lora_name}' is the base model's name; give the adapter another", param="lora_name")
    if body.lora_name in registry.adapters and not body.load_inplace:
        raise APIError(400, f"The lora adapter '{body.lora_name}' has already been loaded. If you want to load the "
                            "adapter in place, set 'load_inplace' to True.", param="lora_name")
    try:  # reading the header and config touches the disk: not on the event loop
        adapter = await asyncio.to_thread(registry.load, body.lora_name, body.lora_path)
    except AdapterError as exc:
        raise APIError(400, f"adapter '{body.lora_name}': {exc}", param="lora_path") from None
    if registry.eager:
        for engine in ctx.pool.engines:
            engine.load_adapters([adapter.request])
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(request: Request):
    ctx = request.app.state.context
    registry: AdapterRegistry = ctx.adapters
    body = await _body(request, UnloadLoRAAdapter)
    if registry.adapters.pop(body.lora_name, None) is None:
        raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name",
                       code="not_found")
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


RUNTIME_ROUTES = (
    ("/v1/load_lora_adapter", ["POST"], load_lora_adapter),
    ("/v1/unload_lora_adapter", ["POST"], unload_lora_adapter),
)
