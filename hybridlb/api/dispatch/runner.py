"""The life of one engine request in the API server: send it, read its outputs, turn them
into text, record its metrics, and stop it in the engine when its reader goes away.

``RequestRunner.generate`` resends a request that an engine refused or lost before it
produced anything (``MAX_ATTEMPTS`` sends, any engine of the node), migrates one whose engine
was lost mid-stream to another engine of the node with the tokens it already has (dense
models, ``api.migration_limit`` times), and gives up on one its engine has said nothing
about for ``api.request_timeout_s``. A request an engine's failure takes off it counts once:
migrated when it goes on elsewhere, lost when its client gets the error
(``hybridlb.api.dispatch.evacuation``). Text comes from the same
incremental detokenizer (stop strings included) the offline ``LLM`` uses. Work on each
output's tokens that needs the whole text so far (a tool-call or reasoning parser) reads
the ``Delta``s this yields, in ``hybridlb.api.openai.responses``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec

from hybridlb.api.dispatch.admission import RETRY_AFTER_S
from hybridlb.api.dispatch.engine_client import EngineConnection, EngineUnavailable
from hybridlb.api.dispatch.metrics import Finished, Metrics
from hybridlb.api.dispatch.pool import EnginePool, all_busy
from hybridlb.api.errors import APIError
from hybridlb.checkpoint.detokenizer import IncrementalDetokenizer, visible
from hybridlb.checkpoint.tokenizer import Tokenizer
from hybridlb.params import SamplingParams
from hybridlb.protocol import RequestOutput, TokenLogprobs

log = logging.getLogger(__name__)
_ERROR_STATUS = {"invalid": 400, "busy": 429, "internal": 500}
STALL_S = 0.5  # a timer this late means the event loop (or the whole process) was stalled
MAX_ATTEMPTS = 3  # sends of one request (to any engine of the node) before its failure reaches the client
# A request in flight on this many engines that died or stalled under it is quarantined: failed,
# never sent again, so a request that kills engines kills at most this many, not the node.
QUARANTINE_AFTER = 2
ENGINE_FAILURES = ("engine_down", "stuck")  # EngineUnavailable reasons that are the engine's death or stall


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


@dataclass
class _Timing:
    """What the metrics of one request need, as it goes."""

    arrival: float
    ttft: float | None = None
    last_token_at: float | None = None
    num_tokens: int = 0
    engine_times: tuple[float | None, float | None] = (None, None)  # the engine's queue and prefill times


@dataclass
class _Route:
    """Where one request runs now, and where it has been. Each send has its own wire id
    (``request_id~attempt``): a late output of an earlier send is not this one's."""

    request_id: str
    rank: int | None  # the rank it is pinned to
    tried: set[int]  # engines not to send it to again
    engine: EngineConnection
    queue: asyncio.Queue
    wire_id: str = ""
    attempt: int = 0
    migrations: int = 0
    losses: int = 0  # engines that died or stalled with it in flight (QUARANTINE_AFTER)
    produced: list[int] = field(default_factory=list)  # every token it got, from any engine: a migration's start

    def __post_init__(self) -> None:
        self.wire_id = self.wire_id or self.request_id

    def next_wire_id(self) -> str:
        self.attempt += 1
        self.wire_id = f"{self.request_id}~{self.attempt}"
        return self.wire_id

    def go(self, engine: EngineConnection, queue: asyncio.Queue) -> None:
        self.engine, self.queue = engine, queue


class RequestRunner:
    def __init__(self, pool: EnginePool, tokenizer: Tokenizer, metrics: Metrics, request_timeout_s: float = 0.0,
                 migration_limit: int = 0):
        self.pool = pool
        self.migration_limit = migration_limit
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.request_timeout_s = request_timeout_s or None

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       rank: int | None = None) -> AsyncIterator[Delta]:
        """Stream the deltas of one request; raises APIError if it fails (503 if its engine dies)."""
        timing = _Timing(time.perf_counter())
        tried: set[int] = set()
        route = _Route(request_id, rank, tried, *self.pool.submit(request_id, prompt_ids, params, rank, tried))
        if rank is not None:
            self.metrics.pinned_request(rank)
        detok = IncrementalDetokenizer.for_request(self.tokenizer, prompt_ids, params)
        finished, yielded = False, False
        try:
            while not finished:
                output = await self._next(route.queue, route.engine, route.wire_id)
                if isinstance(output, EngineUnavailable):
                    self._recover(route, output, prompt_ids, params, yielded)
                    continue
                if output.error_kind == "busy" and output.error:  # the engine's queue is full
                    if yielded or rank is not None or route.attempt + 1 >= MAX_ATTEMPTS:
                        raise _failure(output)
                    self._resend(route, output, prompt_ids, params)
                    continue
                if output.error:
                    raise _failure(output)
                route.produced.extend(output.new_token_ids)
                shown = visible(output.new_token_ids, output.stop_token_id, params)
                text, reason = detok.take(shown, output.finish_reason)
                self._observe(route.engine.rank, output, timing, reason, len(prompt_ids), params)
                finished, yielded = reason is not None, True
                yield Delta(text, len(output.new_token_ids), reason, output.new_token_ids, output.logprobs,
                            output.prompt_logprobs)
        finally:
            # Not finished by the engine (stop string, client gone, error): stop it there too.
            route.engine.release(route.wire_id, abort=not finished or detok.stopped)
            _abandon(route)

    def _recover(self, route: _Route, failure: EngineUnavailable, prompt_ids: list[int], params: SamplingParams,
                 yielded: bool) -> None:
        """Move a request that ``failure`` took off its engine on to another one, or raise its
        client's error; either way count it once (migrated, or lost) and tell ``failure``."""
        left = route.engine
        try:
            self._go_on(route, failure, prompt_ids, params, yielded)
        except Exception:
            failure.settle("lost", route.request_id)
            raise
        self.metrics.migrated_request(left.rank)
        failure.settle("moved", route.request_id)

    def _go_on(self, route: _Route, failure: EngineUnavailable, prompt_ids: list[int], params: SamplingParams,
               yielded: bool) -> None:
        if failure.reason == "shutdown":
            raise _failure(failure)  # this server is stopping: nowhere to send it again
        if failure.reason in ENGINE_FAILURES:
            route.losses += 1
            if route.losses >= QUARANTINE_AFTER:
                raise self._quarantine(route.request_id, failure, route.losses)
        if yielded:
            if route.migrations >= self.migration_limit or self.pool.lockstep:  # dense ranks only
                raise _failure(failure)
            route.migrations += 1
            self._migrate(route, failure, prompt_ids, params)
        elif route.rank is not None or route.attempt + 1 >= MAX_ATTEMPTS:
            raise _failure(failure)
        else:
            self._resend(route, failure, prompt_ids, params)

    def _quarantine(self, request_id: str, why: EngineUnavailable, losses: int) -> APIError:
        log.error("request %s was in flight on %d engines that failed (the last: %s); quarantined, not sent again",
                  request_id, losses, why)
        self.metrics.quarantined_request()
        return APIError(500, f"{why}; this request was in flight on {losses} engines that failed, so it is not sent "
                             "to another (quarantined)", code="quarantined")

    def _resend(self, route: _Route, why, prompt_ids: list[int], params: SamplingParams) -> None:
        """Send a request again that its engine refused (its queue is full) or lost before it started."""
        busy = not isinstance(why, EngineUnavailable)
        if not busy and why.reason != "engine_down":
            route.tried.discard(route.engine.rank)  # alive: it may take the request again
        log.log(logging.WARNING if busy else logging.DEBUG, "%s before request %s started; sending it again",
                f"engine {route.engine.rank} is full" if busy else why, route.request_id)
        route.engine.release(route.wire_id, abort=False)  # refused, or already aborted by the connection
        try:
            route.go(*self.pool.submit(route.next_wire_id(), prompt_ids, params, None, route.tried))
        except APIError as none_left:
            raise all_busy() if busy and none_left.status == 503 else none_left from None

    def _migrate(self, route: _Route, why: EngineUnavailable, prompt_ids: list[int], params: SamplingParams) -> None:
        """Send a request whose engine was lost mid-stream to another engine of the node, with
        the tokens it already has: it goes on from there (AddRequest.resumed)."""
        route.engine.release(route.wire_id, abort=False)  # lost: nothing to abort there
        route.tried.clear()  # engines it left earlier may be back; only the one just lost is out
        route.tried.add(route.engine.rank)
        try:
            route.go(*self.pool.submit(route.next_wire_id(), prompt_ids,
                                       msgspec.structs.replace(params, prompt_logprobs=None), None, route.tried,
                                       route.produced))
        except APIError:
            raise _failure(why) from None
        log.debug("%s while request %s streamed (%d tokens so far); it moved to engine %d", why, route.request_id,
                  len(route.produced), route.engine.rank)

    def _observe(self, rank: int, output: RequestOutput, timing: _Timing, reason: str | None, prompt_tokens: int,
                 params: SamplingParams) -> None:
        now = time.perf_counter()
        if output.queued_s is not None:
            timing.engine_times = (output.queued_s, output.prefill_s)
        if output.new_token_ids:
            if timing.last_token_at is None:
                timing.ttft = now - timing.arrival
                self.metrics.first_token(rank, timing.ttft)
            else:
                self.metrics.observe("itl", rank, now - timing.last_token_at)
            timing.last_token_at = now
        timing.num_tokens += len(output.new_token_ids)
        if reason is not None:
            self.metrics.finished(Finished(rank, reason, now - timing.arrival, prompt_tokens, timing.num_tokens,
                                           params.max_tokens, timing.ttft, *timing.engine_times))

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


def _abandon(route: _Route) -> None:
    """The request's client has gone (or it ended) with an engine failure still unread on its
    queue: it was neither moved nor lost by it."""
    while not route.queue.empty():
        if isinstance(output := route.queue.get_nowait(), EngineUnavailable):
            output.settle("abandoned", route.request_id)


def _failure(output) -> APIError:
    """The client's error for an engine failure or an error output."""
    if isinstance(output, EngineUnavailable):
        return APIError(503, f"{output}; the request was lost")
    status = _ERROR_STATUS.get(output.error_kind, 500)
    if status == 429:
        return APIError(429, output.error, code="too_many_requests", retry_after_s=RETRY_AFTER_S)
    return APIError(status, output.error)
