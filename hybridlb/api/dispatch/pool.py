"""The API server's engines: which are up, what the coordinator says of them, and which one
takes the next request.

``EnginePool.submit`` picks an engine by ``lb.policy`` (``hybridlb.api.dispatch.balance``) and sends
the request in one step, with no ``await`` in between, so the next pick already counts
it as in flight there. A routing rule that looks at more than load and prefixes (an
adapter a rank holds, say) belongs in ``pick``, as a ``RankView`` field weighed by
``balance``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

from hybridlb.api.dispatch.admission import RETRY_AFTER_S
from hybridlb.api.dispatch.balance import MIN_CACHED_TOKENS, choose_cache_aware, choose_engine, serve_cost
from hybridlb.api.dispatch.engine_client import EngineConnection, EngineUnavailable, MessageTooLarge
from hybridlb.api.dispatch.lora import prefer_holders
from hybridlb.api.errors import APIError
from hybridlb.params import LoRARequest, SamplingParams
from hybridlb.prefix_hash import adapter_seed, block_hashes
from hybridlb.protocol import LoadSnapshot

log = logging.getLogger(__name__)
COORDINATOR_SILENCE_S = 3.0  # three missed coordinator heartbeats


class EnginePool:
    def __init__(self, engines: list[EngineConnection], policy: str = "cache_aware",
                 follows_coordinator: bool = False, one_rank_child: bool = False):
        """``one_rank_child``: a multi-port node's server of one rank, which ignores a rank header that
        names another rank, as vLLM's children do (a gateway's pin for another port's rank)."""
        self.engines = engines
        self.one_rank_child = one_rank_child
        self.by_rank = {engine.rank: engine for engine in engines}
        self.policy = policy
        self.follows_coordinator = follows_coordinator
        self.snapshot: LoadSnapshot | None = None  # the coordinator's latest view of every rank
        self.snapshot_at = time.monotonic()  # start-up counts as a sign of life
        self._turn = itertools.count()

    # -- a resize (hybridlb.launch.scaling) ------------------------------------------------
    def add(self, engine: EngineConnection) -> None:
        """A rank the node grew by, ready: it takes requests from now on."""
        self.engines = sorted([*self.engines, engine], key=lambda e: e.rank)
        self.by_rank[engine.rank] = engine

    def remove(self, ranks: list[int]) -> list[EngineConnection]:
        """Ranks the node shrank by: no request goes there any more; their connections, to close."""
        gone = [engine for engine in self.engines if engine.rank in ranks]
        self.engines = [engine for engine in self.engines if engine.rank not in ranks]
        for engine in gone:
            del self.by_rank[engine.rank]
        return gone

    # -- what the engines and the coordinator say ---------------------------------------
    def on_snapshot(self, snapshot: LoadSnapshot) -> None:
        """A coordinator snapshot: keep it, and refresh any local engine it has newer stats for."""
        self.snapshot, self.snapshot_at = snapshot, time.monotonic()
        for stats in snapshot.engines:
            engine = self.by_rank.get(stats.rank)
            if engine is not None:
                engine.update_stats(stats)

    @property
    def load(self) -> float | None:
        """One number for an upstream balancer: mean score of this server's live engines."""
        live = [engine.score for engine in self.engines if engine.alive]
        return sum(live) / len(live) if live else None

    @property
    def started(self) -> bool:
        """Every engine said it was ready at least once (later deaths are ``problems``)."""
        return all(engine.info is not None for engine in self.engines)

    @property
    def down_ranks(self) -> list[int]:
        return [engine.rank for engine in self.engines if not engine.alive]

    @property
    def coordinator_silent_s(self) -> float | None:
        """Seconds since the coordinator's last snapshot once that counts as lost, else None."""
        silent = time.monotonic() - self.snapshot_at
        return silent if self.follows_coordinator and silent > COORDINATOR_SILENCE_S else None

    @property
    def lockstep(self) -> bool:
        """MoE experts sharded over the ranks: no wave can start without the coordinator."""
        return any(engine.info is not None and engine.info.dp_group for engine in self.engines)

    @property
    def max_model_len(self) -> int:
        return min(engine.info.max_model_len for engine in self.engines if engine.info)

    @property
    def vocab_size(self) -> int:
        """The engines' vocabulary (the model's logits: token ids a request may name are below it)."""
        return min(engine.info.vocab_size for engine in self.engines if engine.info)

    @property
    def wave(self) -> int:
        """The coordinator's current wave (MoE): new requests carry it."""
        return self.snapshot.current_wave if self.snapshot else 0

    def outage(self) -> str | None:
        """Why this API server cannot serve at all right now, or None."""
        if not any(engine.alive for engine in self.engines):
            return f"no engine of this node is available (down: {self.down_ranks})"
        if self.lockstep and self.coordinator_silent_s is not None:
            return (f"the coordinator has been silent for {self.coordinator_silent_s:.0f} s and MoE waves cannot "
                    "start without it")
        return None

    def problems(self) -> list[str]:
        """What is down but does not stop this server from serving (dense models)."""
        found = [f"engine {rank} is down" for rank in self.down_ranks]
        if self.coordinator_silent_s is not None:
            found.append(f"the coordinator has been silent for {self.coordinator_silent_s:.0f} s "
                         "(balancing on this server's own view)")
        elif self.snapshot is not None and self.snapshot.lost_ranks:
            found.append(f"ranks {self.snapshot.lost_ranks} of the cluster are not reporting to the coordinator")
        return found

    def stop_requests(self) -> None:
        """This process is stopping (SIGTERM, Ctrl-C, its node giving up): end every in-flight
        request now with an error its client sees, rather than have the connection cut when
        the grace period ends (the node stops its engines at the same time)."""
        for engine in self.engines:
            engine.fail_all(f"engine {engine.rank}: the API server is shutting down", "shutdown", logging.INFO)

    # -- which engine takes a request -----------------------------------------------------
    def resolve_rank(self, value: int | None) -> int | None:
        """The global rank an ``X-data-parallel-rank`` value pins: a rank this node serves, or a local
        index 0..n-1 into them, as vLLM's per-node frontend and vllm-router read it (the two readings
        are the same rank on the node whose start rank is 0). Anything else is a 400 naming both."""
        if value is None or value in self.by_rank:
            return value
        ranks = sorted(self.by_rank)
        if 0 <= value < len(ranks):
            return ranks[value]
        if self.one_rank_child:
            return None
        owned = ", ".join(map(str, ranks))
        raise APIError(400, f"X-data-parallel-rank {value} is neither a rank this node serves (ranks {owned}) nor a "
                            f"local index of them (0..{len(ranks) - 1})", param="X-data-parallel-rank")

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, rank: int | None,
               tried: set[int], resumed: list[int] | None = None) -> tuple[EngineConnection, asyncio.Queue]:
        """Pick an engine not tried yet and send the request (``resumed``: a migrated one's
        output so far); raise APIError(503) when none is left."""
        hashes = self._block_hashes(prompt_ids + resumed if resumed else prompt_ids, params.lora)
        adapter = params.lora.name if params.lora is not None else None
        while True:
            engine = self.pick(rank, frozenset(tried), hashes, len(prompt_ids), adapter, params, len(resumed or ()))
            tried.add(engine.rank)
            try:
                queue = engine.add(request_id, prompt_ids, params, self.wave, engine.cached_tokens(hashes), resumed)
                if engine.prefix is not None and hashes:
                    engine.prefix.record(hashes)
                return engine, queue
            except EngineUnavailable as exc:
                if rank is not None:
                    raise APIError(503, str(exc)) from None
            except MessageTooLarge as exc:
                raise APIError(400, str(exc)) from None

    def _block_hashes(self, prompt_ids: list[int], lora: LoRARequest | None) -> list[int]:
        """The prompt's full-block hashes as the engines compute them (their cache is keyed
        by these; an adapter's chain starts from its own seed), for ``cache_aware``; none for
        other policies or when no local engine caches prefixes."""
        info = next((e.info for e in self.engines if e.prefix is not None and e.info is not None), None)
        if info is None or self.policy != "cache_aware" or len(self.engines) == 1:
            return []
        seed = info.block_hash_seed if lora is None else adapter_seed(info.block_hash_seed, lora.key)
        return block_hashes(prompt_ids, info.block_size, seed)

    def pick(self, rank: int | None = None, exclude: frozenset[int] = frozenset(),
             hashes: list[int] = (), prompt_tokens: int = 0, adapter: str | None = None,
             params: SamplingParams | None = None, resumed_tokens: int = 0) -> EngineConnection:
        """The engine for a new request: ``rank`` if pinned, else by the policy among the live
        ones (``cache_aware`` weighs what each rank holds of the prompt's ``hashes`` against its
        load, weighted by how long each request there stays beside this one's ``params.max_tokens``,
        and its queue of prompts to prefill, and sends a request for LoRA ``adapter`` to a
        rank holding it when one is within MAX_LOAD_GAP requests of the least loaded, see
        ``hybridlb.api.dispatch.lora.prefer_holders``). ``rank`` is a global one (``resolve_rank``)."""
        if (outage := self.outage()) is not None:
            raise APIError(503, outage)
        if rank is not None:
            engine = self.by_rank.get(rank)
            if engine is None or engine.draining:
                raise APIError(503, f"engine {rank} is leaving this node (a resize); send the request without the "
                                    "X-data-parallel-rank header, or to a rank that stays")
        else:
            live = [engine for engine in self.engines
                    if engine.alive and not engine.draining and engine.rank not in exclude]
            if not live:
                raise APIError(503, "no engine is available on this node")
            if all(engine.queue_full for engine in live):
                raise all_busy()
            if adapter is not None and self.policy == "cache_aware":
                live = prefer_holders(live, adapter)
            turn = next(self._turn)
            if self.policy == "round_robin":
                engine = live[turn % len(live)]
            elif self.policy == "cache_aware":
                params = params or SamplingParams()
                views = [e.cache_view(hashes, e.output_budget(prompt_tokens, params, resumed_tokens)) for e in live]
                engine = live[choose_cache_aware(views, prompt_tokens, turn)]
                if log.isEnabledFor(logging.DEBUG):  # HYBRIDLB_LOG_LEVEL=DEBUG: why each request went where
                    _trace(engine.rank, prompt_tokens, live, views)
            else:
                engine = live[choose_engine([e.score for e in live], turn)]
        if not engine.alive:
            raise APIError(503, f"engine {engine.rank} is not available")
        return engine


def _trace(chosen: int, prompt_tokens: int, live: list[EngineConnection], views: list) -> None:
    cached_somewhere = any(view.cached_tokens >= MIN_CACHED_TOKENS for view in views)
    ranks = "; ".join(
        f"rank {engine.rank}: {view.requests} requests, {view.prefill_tokens} to prefill, {view.cached_tokens} cached, "
        f"pressure {view.pressure:.2f}, decode load {view.decode_load or 0:.2f}, cost "
        f"{serve_cost(view, prompt_tokens, cached_somewhere):.0f}" for engine, view in zip(live, views, strict=True))
    log.debug("cache_aware: %d prompt tokens to rank %d (%s)", prompt_tokens, chosen, ranks)


def all_busy() -> APIError:
    """The 429 for a node whose every engine has a full queue."""
    return APIError(429, "every engine of this node has a full queue (engine.max_queued_requests); retry shortly",
                    code="too_many_requests", retry_after_s=RETRY_AFTER_S)
