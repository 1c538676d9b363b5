"""The life of one engine request in the API server: send it, read its outputs, turn them
into text, record its metrics, and stop it in the engine when its reader goes away.

``RequestRunner.generate`` resends a request that an engine refused or lost before it
produced anything (``MAX_ATTEMPTS`` sends, any engine of the node), migrates one whose engine
was lost mid-stream to another engine of the node with the tokens it already has (dense
models, ``api.migration_limit`` times), and gives up on one its engine has said nothing
about for ``api.request_timeout_s``. Text comes from the same
incremental detokenizer (stop strings included) the offline ``LLM`` uses. Work on each
output's tokens that needs the whole text so far (a tool-call or reasoning parser) reads
the ``Delta``s this yields, in ``hybridlb.api.responses``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec

from hybridlb.api.admission import RETRY_AFTER_S
from hybridlb.api.engine_client import EngineConnection, EngineUnavailable
from hybridlb.api.errors import APIError
from hybridlb.api.metrics import Finished, Metrics
from hybridlb.api.pool import EnginePool, all_busy
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
        attempt, wire_id = 0, request_id  # each send has its own id: a late output of an earlier one is not this one's
        engine, queue = self.pool.submit(wire_id, prompt_ids, params, rank, tried)
        if rank is not None:
            self.metrics.pinned_request(rank)
        detok = IncrementalDetokenizer.for_request(self.tokenizer, prompt_ids, params)
        finished, yielded = False, False
        produced: list[int] = []  # every token this request got, from whichever engine: a migration's start
        migrations, losses = 0, 0
        try:
            while not finished:
                output = await self._next(queue, engine, wire_id)
                if isinstance(output, EngineUnavailable) and output.reason == "shutdown":
                    raise _failure(output)  # this server is stopping: nowhere to send it again
                if isinstance(output, EngineUnavailable) and output.reason in ENGINE_FAILURES:
                    losses += 1
                    if losses >= QUARANTINE_AFTER:
                        raise self._quarantine(request_id, output, losses)
                if yielded and self._migrates(output, migrations):
                    migrations, attempt = migrations + 1, attempt + 1
                    engine.release(wire_id, abort=False)  # lost: nothing to abort there
                    wire_id = f"{request_id}~{attempt}"
                    engine, queue = self._migrate(engine, output, request_id, wire_id, prompt_ids, produced, params,
                                                  tried)
                    continue
                if _refused(output):
                    if yielded or rank is not None or attempt + 1 >= MAX_ATTEMPTS:
                        raise _failure(output)
                    attempt += 1
                    engine.release(wire_id, abort=False)  # refused, or already aborted by the connection
                    wire_id = f"{request_id}~{attempt}"
                    engine, queue = self._resend(engine, output, request_id, wire_id, prompt_ids, params, tried)
                    continue
                if output.error:
                    raise _failure(output)
                produced.extend(output.new_token_ids)
                shown = visible(output.new_token_ids, output.stop_token_id, params)
                text, reason = detok.take(shown, output.finish_reason)
                self._observe(engine.rank, output, timing, reason, len(prompt_ids), params)
                finished, yielded = reason is not None, True
                yield Delta(text, len(output.new_token_ids), reason, output.new_token_ids, output.logprobs,
                            output.prompt_logprobs)
        finally:
            # Not finished by the engine (stop string, client gone, error): stop it there too.
            engine.release(wire_id, abort=not finished or detok.stopped)

    def _quarantine(self, request_id: str, why: EngineUnavailable, losses: int) -> APIError:
        log.error("request %s was in flight on %d engines that failed (the last: %s); quarantined, not sent again",
                  request_id, losses, why)
        self.metrics.quarantined_request()
        return APIError(500, f"{why}; this request was in flight on {losses} engines that failed, so it is not sent "
                             "to another (quarantined)", code="quarantined")

    def _resend(self, engine: EngineConnection, why, request_id: str, wire_id: str, prompt_ids: list[int],
                params: SamplingParams, tried: set[int]) -> tuple[EngineConnection, asyncio.Queue]:
        """Send a request again that ``engine`` refused (its queue is full) or lost before it started."""
        busy = not isinstance(why, EngineUnavailable)
        again = not busy and why.reason != "engine_down"
        if again:
            tried.discard(engine.rank)  # alive: it may take the request again
        log.warning("%s before request %s started; sending it %s", f"engine {engine.rank} is full" if busy else why,
                    request_id, "again" if again else "to another engine")
        try:
            return self.pool.submit(wire_id, prompt_ids, params, None, tried)
        except APIError as none_left:
            raise all_busy() if busy and none_left.status == 503 else none_left from None

    def _migrates(self, output, migrations: int) -> bool:
        """Whether a request that already streamed moves on: its engine was lost (not a busy
        refusal or an error of the request's own), the limit allows, and the ranks are dense."""
        return isinstance(output, EngineUnavailable) and migrations < self.migration_limit and not self.pool.lockstep

    def _migrate(self, engine: EngineConnection, why: EngineUnavailable, request_id: str, wire_id: str,
                 prompt_ids: list[int], produced: list[int], params: SamplingParams,
                 tried: set[int]) -> tuple[EngineConnection, asyncio.Queue]:
        """Send a request whose engine was lost mid-stream to another engine of the node, with
        the tokens it already has: it goes on from there (AddRequest.resumed)."""
        tried.clear()  # engines it left earlier may be back; only the one just lost is out
        tried.add(engine.rank)
        log.warning("%s while request %s streamed (%d tokens so far); moving it to another engine", why, request_id,
                    len(produced))
        try:
            moved = self.pool.submit(wire_id, prompt_ids, msgspec.structs.replace(params, prompt_logprobs=None), None,
                                     tried, produced)
        except APIError:
            raise _failure(why) from None
        self.metrics.migrated_request(engine.rank)
        return moved

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


def _refused(output) -> bool:
    """Whether the request never started: its engine was lost, or refused it (a full queue)."""
    return isinstance(output, EngineUnavailable) or (output.error_kind == "busy" and bool(output.error))


def _failure(output) -> APIError:
    """The client's error for an engine failure or an error output."""
    if isinstance(output, EngineUnavailable):
        return APIError(503, f"{output}; the request was lost")
    status = _ERROR_STATUS.get(output.error_kind, 500)
    if status == 429:
        return APIError(429, output.error, code="too_many_requests", retry_after_s=RETRY_AFTER_S)
    return APIError(status, output.error)
