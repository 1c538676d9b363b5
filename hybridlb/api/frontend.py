"""The API server's view of its node's engines and the life of one request.

``Frontend.generate`` picks an engine, sends the prompt, detokenizes the outputs as they
stream back (stop strings included), records metrics, and, if the caller goes away
before the end, aborts the request so the engine frees its KV blocks.

Faults: a request whose engine dies (or whose outputs were lost) before it produced
anything is sent to another live engine of this node (the client never notices); one that
already streamed tokens ends with an error. So does one its engine has said nothing about
for ``request_timeout_s``. An engine whose queue is full refuses a request, which then
tries the node's other engines and, when every one is full, gets 429. The node keeps
serving while any of its engines is alive; ``problems`` lists what is down for /health.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from hybridlb.api.admission import RETRY_AFTER_S, Slots
from hybridlb.api.balance import choose_cache_aware, choose_engine
from hybridlb.api.engine_client import EngineConnection, EngineUnavailable
from hybridlb.api.errors import APIError
from hybridlb.api.logprobs import LogprobFormatter
from hybridlb.api.metrics import Finished, Metrics
from hybridlb.model.detokenizer import IncrementalDetokenizer
from hybridlb.model.tokenizer import Tokenizer
from hybridlb.prefix_hash import block_hashes
from hybridlb.protocol import LoadSnapshot, SamplingParams, TokenLogprobs

log = logging.getLogger(__name__)
COORDINATOR_SILENCE_S = 3.0  # three missed coordinator heartbeats
_ERROR_STATUS = {"invalid": 400, "busy": 429, "internal": 500}
STALL_S = 0.5  # a timer this late means the event loop (or the whole process) was stalled
MAX_ATTEMPTS = 3  # sends of one request (to any engine of the node) before its failure reaches the client

@dataclass
class Delta:
    """New text of one request; ``finish_reason`` is set on its last delta. The engine's
    log-probabilities ride along when the request asked for them (see RequestOutput)."""

    text: str
    num_tokens: int
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class Frontend:
    def __init__(self, engines: list[EngineConnection], tokenizer: Tokenizer, metrics: Metrics,
                 policy: str = "cache_aware", follows_coordinator: bool = False,
                 sampling_defaults: dict | None = None, slots: Slots | None = None,
                 request_timeout_s: float = 0.0):
        self.engines = engines
        self.slots = slots or Slots(0)
        self.request_timeout_s = request_timeout_s or None
        self.sampling_defaults = sampling_defaults or {}  # the model's generation_config.json
        self.follows_coordinator = follows_coordinator
        self.snapshot_at = time.monotonic()  # start-up counts as a sign of life
        self.policy = policy
        self.by_rank = {engine.rank: engine for engine in engines}
        self.tokenizer = tokenizer
        self.logprob_format = LogprobFormatter(tokenizer)
        self.metrics = metrics
        self.snapshot: LoadSnapshot | None = None  # the coordinator's latest view of every rank
        self._turn = itertools.count()

    def on_snapshot(self, snapshot: LoadSnapshot) -> None:
        """A coordinator snapshot: keep it, and refresh any local engine it has newer stats for."""
        self.snapshot, self.snapshot_at = snapshot, time.monotonic()
        self.metrics.update_waves(snapshot)
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

    def outage(self) -> str | None:
        """Why this API server cannot serve at all right now, or None."""
        if not any(engine.alive for engine in self.engines):
            return f"no engine of this node is available (down: {self.down_ranks})"
        if self.lockstep and self.coordinator_silent_s is not None:
            return (f"the coordinator has been silent for {self.coordinator_silent_s:.0f} s and MoE waves cannot "
                    "start without it")
        return None

    def stop_requests(self) -> None:
        """This process is stopping (SIGTERM, Ctrl-C, its node giving up): end every in-flight
        request now with an error its client sees, rather than have the connection cut when
        the grace period ends (the node stops its engines at the same time)."""
        for engine in self.engines:
            engine.fail_all(f"engine {engine.rank}: the API server is shutting down", "shutdown", logging.INFO)

    def problems(self) -> list[str]:
        """What is down but does not stop this server from serving (dense models)."""
        found = [f"engine {rank} is down" for rank in self.down_ranks]
        if self.coordinator_silent_s is not None:
            found.append(f"the coordinator has been silent for {self.coordinator_silent_s:.0f} s "
                         "(balancing on this server's own view)")
        elif self.snapshot is not None and self.snapshot.lost_ranks:
            found.append(f"ranks {self.snapshot.lost_ranks} of the cluster are not reporting to the coordinator")
        return found

    @property
    def max_model_len(self) -> int:
        return min(engine.info.max_model_len for engine in self.engines if engine.info)

    def _submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, rank: int | None,
                tried: set[int]):
        """Pick an engine not tried yet and send the request; raise APIError(503) when none is left."""
        hashes = self._block_hashes(prompt_ids)
        while True:
            engine = self.pick(rank, frozenset(tried), hashes, len(prompt_ids))
            tried.add(engine.rank)
            try:
                wave = self.snapshot.current_wave if self.snapshot else 0
                queue = engine.add(request_id, prompt_ids, params, wave, engine.cached_tokens(hashes))
                if engine.prefix is not None and hashes:
                    engine.prefix.record(hashes)
                return engine, queue
            except EngineUnavailable as exc:
                if rank is not None:
                    raise APIError(503, str(exc)) from None

    def check_rank(self, rank: int | None) -> None:
        """Fail early (before any response starts) if ``rank`` is not this node's."""
        if rank is not None and rank not in self.by_rank:
            owned = ", ".join(map(str, sorted(self.by_rank)))
            raise APIError(400, f"X-data-parallel-rank {rank} is not served here; this node has ranks {owned}",
                           param="X-data-parallel-rank")

    def _block_hashes(self, prompt_ids: list[int]) -> list[int]:
        """The prompt's full-block hashes as the engines compute them (their cache is keyed
        by these), for ``cache_aware``; none for other policies or when no local engine
        caches prefixes."""
        info = next((e.info for e in self.engines if e.prefix is not None and e.info is not None), None)
        if info is None or self.policy != "cache_aware" or len(self.engines) == 1:
            return []
        return block_hashes(prompt_ids, info.block_size, info.block_hash_seed)

    def pick(self, rank: int | None = None, exclude: frozenset[int] = frozenset(),
             hashes: list[int] = (), prompt_tokens: int = 0) -> EngineConnection:
        """The engine for a new request: ``rank`` if pinned, else by the policy among the live
        ones (``cache_aware`` weighs what each rank holds of the prompt's ``hashes`` against its
        load and its queue of prompts to prefill)."""
        self.check_rank(rank)
        if (outage := self.outage()) is not None:
            raise APIError(503, outage)
        if rank is not None:
            engine = self.by_rank[rank]
        else:
            live = [engine for engine in self.engines if engine.alive and engine.rank not in exclude]
            if not live:
                raise APIError(503, "no engine is available on this node")
            if all(engine.queue_full for engine in live):
                raise self._all_busy()
            turn = next(self._turn)
            if self.policy == "round_robin":
                engine = live[turn % len(live)]
            elif self.policy == "cache_aware" and hashes:
                engine = live[choose_cache_aware([e.cache_view(hashes) for e in live], prompt_tokens, turn)]
            else:
                engine = live[choose_engine([e.score for e in live], turn)]
        if not engine.alive:
            raise APIError(503, f"engine {engine.rank} is not available")
        return engine

    def _all_busy(self) -> APIError:
        return APIError(429, "every engine of this node has a full queue (engine.max_queued_requests); retry shortly",
                        code="too_many_requests", retry_after_s=RETRY_AFTER_S)

    async def _next(self, queue: asyncio.Queue, engine: EngineConnection, request_id: str):
        """The request's next output, or APIError(504) once its engine has been silent about it
        for ``request_timeout_s``. A timer that fires late means this process was not running
        (a stall: the engine's outputs may be waiting unread), so it starts over instead."""
        if not queue.empty():
            return queue.get_nowait()
        if self.request_timeout_s is None:
            return await queue.get()
        loop = asyncio.get_running_loop()
        while True:
            deadline = loop.time() + self.request_timeout_s
            try:
                async with asyncio.timeout_at(deadline):
                    return await queue.get()
            except TimeoutError:
                if loop.time() - deadline < STALL_S:
                    break
        self.metrics.lost_requests(engine.rank, "timeout")
        log.error("engine %d sent nothing for request %s in %g s; failing it", engine.rank, request_id,
                  self.request_timeout_s)
        raise APIError(504, f"engine {engine.rank} sent nothing for this request in {self.request_timeout_s:g} s "
                            "(api.request_timeout_s); it was aborted")

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       rank: int | None = None) -> AsyncIterator[Delta]:
        """Stream the deltas of one request; raises APIError(503) if its engine dies.

        The engine is picked and the request sent in one step (no await in between), so
        the next decision already counts this request as in flight on that engine.
        """
        arrival = time.perf_counter()
        tried: set[int] = set()
        attempt, wire_id = 0, request_id  # each send has its own id: a late output of an earlier one is not this one's
        engine, queue = self._submit(wire_id, prompt_ids, params, rank, tried)
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop)
        last_token_at, num_tokens, finished, yielded = None, 0, False, False
        timings: tuple[float | None, float | None] = (None, None)  # the engine's queue and prefill times
        ttft = None
        try:
            while not finished:
                output = await self._next(queue, engine, wire_id)
                busy = not isinstance(output, EngineUnavailable) and output.error_kind == "busy" and output.error
                if isinstance(output, EngineUnavailable) or busy:
                    if yielded or rank is not None or attempt + 1 >= MAX_ATTEMPTS:
                        raise self._failure(output)
                    engine.release(wire_id, abort=False)  # refused, or already aborted by the connection
                    again = not busy and output.reason != "engine_down"
                    if again:
                        tried.discard(engine.rank)  # alive: it may take the request again
                    log.warning("%s before request %s started; sending it %s", f"engine {engine.rank} is full"
                                if busy else output, request_id, "again" if again else "to another engine")
                    attempt += 1
                    wire_id = f"{request_id}~{attempt}"
                    try:
                        engine, queue = self._submit(wire_id, prompt_ids, params, rank, tried)
                    except APIError as none_left:
                        raise self._all_busy() if busy and none_left.status == 503 else none_left from None
                    continue
                if output.error:
                    raise self._failure(output)
                now = time.perf_counter()
                if output.queued_s is not None:
                    timings = (output.queued_s, output.prefill_s)
                if output.new_token_ids:
                    if last_token_at is None:
                        ttft = now - arrival
                        self.metrics.first_token(engine.rank, ttft)
                    else:
                        self.metrics.of(self.metrics.itl, engine.rank).observe(now - last_token_at)
                    last_token_at = now
                num_tokens += len(output.new_token_ids)
                text = detok.push(output.new_token_ids)
                reason = "stop" if detok.stopped else output.finish_reason
                if reason is not None and not detok.stopped:
                    text += detok.finish()
                finished = reason is not None
                if finished:
                    self.metrics.finished(Finished(engine.rank, reason, now - arrival, len(prompt_ids), num_tokens,
                                                   params.max_tokens, ttft, *timings))
                yielded = True
                yield Delta(text, len(output.new_token_ids), reason, output.new_token_ids, output.logprobs,
                            output.prompt_logprobs)
        finally:
            # Not finished by the engine (stop string, client gone, error): stop it there too.
            engine.release(wire_id, abort=not finished or detok.stopped)

    def _failure(self, output) -> APIError:
        """The client's error for an engine failure or an error output."""
        if isinstance(output, EngineUnavailable):
            return APIError(503, f"{output}; the request was lost")
        status = _ERROR_STATUS.get(output.error_kind, 500)
        if status == 429:
            return APIError(429, output.error, code="too_many_requests", retry_after_s=RETRY_AFTER_S)
        return APIError(status, output.error)
