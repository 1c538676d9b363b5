"""When a dense step raises: whose fault was it, the engine's or some of its requests'?

An exception out of a batched step says nothing about which request caused it, and failing
the whole batch (or, after ``engine.max_failed_steps``, the engine) turns one bad request
into many failures — and, through migration, into every engine of a node failing in turn.
Two questions settle it:

* ``canary_runs``: does the engine still run a step of its own (one token of a one-token
  prompt, default sampling, no adapter, no grammar)? If not, the fault is the engine's (a
  broken device, memory, a bug every batch hits): the step's requests fail and the failure
  counts towards ``engine.max_failed_steps``.
* ``isolate``: otherwise the step's requests run again in halves, recursively, until each
  failing group is one request. Those requests are the culprits and fail alone; every other
  request keeps what its group's step gave it (one slower step, nothing lost).

Re-running is safe because the model's step changes nothing of its requests (tokens are
appended, KV blocks cached and grammars advanced afterwards, in ``EngineCore._postprocess``); a
re-run rewrites the same KV positions. A failure after that (``AfterTheStep``) cannot be re-run:
it is the engine's. A failure blamed on requests does not count towards ``max_failed_steps``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from hybridlb.engine.request import Request
from hybridlb.engine.scheduler import ScheduledChunk
from hybridlb.params import SamplingParams
from hybridlb.protocol import RequestOutput

if TYPE_CHECKING:
    from hybridlb.engine.block_manager import BlockManager

log = logging.getLogger(__name__)
CANARY_ID = "hybridlb:canary"


class AfterTheStep(RuntimeError):
    """The step computed, then failed while its outputs were taken in (requests' state may have
    moved on): it cannot run again, so it is not isolated."""


def isolate(run: Callable[[list[ScheduledChunk]], list[RequestOutput]], chunks: list[ScheduledChunk],
            failure: Exception) -> tuple[list[RequestOutput], list[tuple[ScheduledChunk, Exception]]]:
    """``chunks`` failed with ``failure``: run them again in halves. Returns the outputs of the
    groups that ran and each chunk that fails alone, with its exception."""
    if len(chunks) == 1:
        return [], [(chunks[0], failure)]
    outputs: list[RequestOutput] = []
    culprits: list[tuple[ScheduledChunk, Exception]] = []
    half = len(chunks) // 2
    for group in (chunks[:half], chunks[half:]):
        try:
            outputs += run(group)
        except AfterTheStep:
            raise
        except Exception as exc:
            ran, failed = isolate(run, group, exc)
            outputs += ran
            culprits += failed
    return outputs, culprits


def canary_runs(run: Callable[[list[ScheduledChunk]], list[int]], blocks: BlockManager) -> bool:
    """Whether the model still computes a step of the engine's own (``run``: the runner's).
    False too when no KV block is free for it: the failure then stays unexplained."""
    canary = Request(CANARY_ID, [0], SamplingParams(max_tokens=1, temperature=0.0), 1, None)
    if not blocks.can_allocate(canary, 1):
        return False
    blocks.allocate(canary, 1)
    try:
        run([ScheduledChunk(canary, 1)])
        return True
    except Exception as exc:
        log.warning("the engine's own canary step failed too (%s: %s): the fault is the engine's",
                    type(exc).__name__, exc)
        return False
    finally:
        blocks.free(canary)


def error_output(rank: int, request_id: str, exc: Exception, kind: str) -> RequestOutput:
    """A failed request's output: ``invalid``, the step failed for it alone (a 400); ``internal``,
    for the engine's fault (a 500)."""
    why = f"{type(exc).__name__}: {exc}"
    if kind == "invalid":
        log.warning("engine %d: request %s fails every step it is in (%s); failing it alone", rank, request_id, why)
        why += "; the request was failed alone, the engine serves on"
    return RequestOutput(request_id, [], "error", error=f"engine {rank} failed to run this request: {why}",
                         error_kind=kind)
