"""LoRA adapters in one API server process, the one place it keeps them: the names requests may
give as ``model`` (``--lora-modules``, and adapters loaded at run time, see
``hybridlb.api.openai.lora_routes``), their cards in /v1/models, which ranks hold which adapter
(``HeldAdapters``), and where a request for one goes (``prefer_holders``).

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

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

from hybridlb.api.dispatch.balance import MAX_LOAD_GAP
from hybridlb.checkpoint.lora import WEIGHTS_FILE, AdapterError, AdapterMissing, read_adapter
from hybridlb.checkpoint.spec import ModelSpec, load_spec
from hybridlb.config import Config, LoRAConfig
from hybridlb.params import LoRARequest

log = logging.getLogger(__name__)

RUNTIME_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
ADAPTER_SENT_S = 2.0  # a rank sent a LoRA request this recently counts as holding the adapter
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


class HeldAdapters:
    """Which LoRA adapters one rank holds, as this API server sees it: those its latest stats
    list, and those it will hold: this server sent it a request for them in the last
    ADAPTER_SENT_S (stats lag behind)."""

    def __init__(self):
        self.sent: dict[str, float] = {}  # adapter -> when this server last sent a request for it

    def record(self, lora: LoRARequest | None) -> None:
        if lora is not None:
            self.sent[lora.name] = time.monotonic()

    def names(self, loaded: list[str]) -> set[str]:
        """``loaded``: the adapters the rank's latest stats say it holds."""
        now = time.monotonic()
        return {name for name, sent in self.sent.items() if now - sent < ADAPTER_SENT_S} | set(loaded)


class Rank(Protocol):
    """What ``prefer_holders`` reads of an engine (``EngineConnection``)."""

    rank: int
    requests: int
    queue_full: bool

    def adapters(self) -> set[str]: ...


R = TypeVar("R", bound=Rank)


def prefer_holders(live: list[R], adapter: str) -> list[R]:
    """The ranks a request for LoRA ``adapter`` may go to. Among those within MAX_LOAD_GAP
    requests of the least loaded (the gap ``cache_aware`` allows a cached prefix): the ones
    holding the adapter; if none does, the ones holding the fewest adapters (a free slot evicts
    nothing, and a node's adapters spread over its ranks). A hot adapter whose holders are all
    further above the least loaded rank than the gap spreads to it."""
    floor = min(engine.requests for engine in live)
    near = [e for e in live if e.requests <= floor + MAX_LOAD_GAP and not e.queue_full]
    if not near:
        return live
    held = {e.rank: e.adapters() for e in near}
    holders = [e for e in near if adapter in held[e.rank]]
    if holders:
        return holders
    fewest = min(len(names) for names in held.values())
    return [e for e in near if len(held[e.rank]) == fewest]
