"""The API server's view of its node's engines and the life of one request.

``Frontend.generate`` picks an engine, sends the prompt, detokenizes the outputs as they
stream back (stop strings included), records metrics, and, if the caller goes away
before the end, aborts the request so the engine frees its KV blocks.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from hybridlb.api.balance import choose_engine
from hybridlb.api.engine_client import EngineConnection, EngineUnavailable
from hybridlb.api.errors import APIError
from hybridlb.api.metrics import Metrics
from hybridlb.model.detokenizer import IncrementalDetokenizer
from hybridlb.model.tokenizer import Tokenizer
from hybridlb.protocol import LoadSnapshot, SamplingParams


@dataclass
class Delta:
    """New text of one request; ``finish_reason`` is set on its last delta."""

    text: str
    num_tokens: int
    finish_reason: str | None = None


class Frontend:
    def __init__(self, engines: list[EngineConnection], tokenizer: Tokenizer, metrics: Metrics,
                 policy: str = "least_loaded"):
        self.engines = engines
        self.policy = policy
        self.by_rank = {engine.rank: engine for engine in engines}
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.snapshot: LoadSnapshot | None = None  # the coordinator's latest view of every rank
        self._turn = itertools.count()

    def on_snapshot(self, snapshot: LoadSnapshot) -> None:
        """A coordinator snapshot: keep it, and refresh any local engine it has newer stats for."""
        self.snapshot = snapshot
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
    def ready(self) -> bool:
        return all(engine.alive for engine in self.engines)

    @property
    def max_model_len(self) -> int:
        return min(engine.info.max_model_len for engine in self.engines if engine.info)

    def check_rank(self, rank: int | None) -> None:
        """Fail early (before any response starts) if ``rank`` is not this node's."""
        if rank is not None and rank not in self.by_rank:
            owned = ", ".join(map(str, sorted(self.by_rank)))
            raise APIError(400, f"X-data-parallel-rank {rank} is not served here; this node has ranks {owned}",
                           param="X-data-parallel-rank")

    def pick(self, rank: int | None = None) -> EngineConnection:
        """The engine for a new request: ``rank`` if pinned, else the least loaded live one."""
        self.check_rank(rank)
        if rank is not None:
            engine = self.by_rank[rank]
        else:
            live = [engine for engine in self.engines if engine.alive]
            if not live:
                raise APIError(503, "no engine is available on this node")
            turn = next(self._turn)
            if self.policy == "round_robin":
                engine = live[turn % len(live)]
            else:
                engine = live[choose_engine([e.score for e in live], turn)]
        if not engine.alive:
            raise APIError(503, f"engine {engine.rank} is not available")
        return engine

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       rank: int | None = None) -> AsyncIterator[Delta]:
        """Stream the deltas of one request; raises APIError(503) if its engine dies.

        The engine is picked and the request sent in one step (no await in between), so
        the next decision already counts this request as in flight on that engine.
        """
        arrival = time.perf_counter()
        engine = self.pick(rank)
        try:
            queue = engine.add(request_id, prompt_ids, params, self.snapshot.current_wave if self.snapshot else 0)
        except EngineUnavailable as exc:
            raise APIError(503, str(exc)) from None
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop)
        labels = self.metrics.labels(engine.rank)
        last_token_at, num_tokens, finished = None, 0, False
        try:
            while not finished:
                output = await queue.get()
                if isinstance(output, EngineUnavailable):
                    raise APIError(503, f"{output}; the request was lost")
                if output.error:
                    raise APIError(400, output.error)
                now = time.perf_counter()
                if output.new_token_ids:
                    if last_token_at is None:
                        self.metrics.first_token(engine.rank, now - arrival)
                    else:
                        self.metrics.itl.labels(**labels).observe(now - last_token_at)
                    last_token_at = now
                num_tokens += len(output.new_token_ids)
                text = detok.push(output.new_token_ids)
                reason = "stop" if detok.stopped else output.finish_reason
                if reason is not None and not detok.stopped:
                    text += detok.finish()
                finished = reason is not None
                if finished:
                    self.metrics.finished(engine.rank, reason, now - arrival, len(prompt_ids), num_tokens)
                yield Delta(text, len(output.new_token_ids), reason)
        finally:
            # Not finished by the engine (stop string, client gone, error): stop it there too.
            engine.release(request_id, abort=not finished or detok.stopped)
