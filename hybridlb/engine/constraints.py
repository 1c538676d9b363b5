"""Structured outputs in the engine: constrained requests from arrival to their last token.

A constrained request waits here while its grammar compiles (on the grammar cache's threads,
never the step's), joins the scheduler once it has a matcher, or ends with an error output
if its grammar cannot compile. Each token it then samples advances its matcher
(``follow``); the sampler masks each step's logits with it (``sampler._apply_grammars``).
A reasoning model's constraint starts after its end-of-thinking marker (``Constraint.after``),
or at once when the output does not open with the start-of-thinking marker
(``Constraint.opener``).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, wait
from typing import TYPE_CHECKING

from hybridlb.engine.request import Request, Status
from hybridlb.protocol import RequestOutput

if TYPE_CHECKING:  # grammar backends load with the first constrained request
    from hybridlb.config import EngineConfig
    from hybridlb.grammar import GrammarCache

log = logging.getLogger(__name__)


class Constraints:
    def __init__(self, config: EngineConfig, vocab_size: int, rank: int, eos_token_ids: set[int]):
        self.config, self.vocab_size, self.rank, self.eos_token_ids = config, vocab_size, rank, eos_token_ids
        self.grammars: GrammarCache | None = None  # made at the first constrained request
        self.compiling: list[Request] = []  # not scheduled until their grammar compiled

    def add(self, request: Request) -> None:
        """Start compiling ``request``'s grammar; ``admit`` hands it on once it compiled."""
        request.compiling = self._cache().matcher(request.params.constraint)
        self.compiling.append(request)

    def drop(self, request: Request) -> bool:
        """Forget ``request`` if its grammar is still compiling (aborted); whether it was. A
        compilation no other request waits for is dropped before it starts."""
        if request not in self.compiling:
            return False
        self.compiling.remove(request)
        self.grammars.cancel(request.compiling)
        request.status = Status.FINISHED
        return True

    def wait_briefly(self) -> None:
        """Nothing else to run: wait a moment for a grammar to compile."""
        wait([r.compiling for r in self.compiling], timeout=0.005, return_when=FIRST_COMPLETED)

    def admit(self) -> tuple[list[Request], list[RequestOutput]]:
        """Requests whose grammar compiled (their matcher set, a migrated one's advanced through
        the output it has), and the error outputs of those whose grammar failed."""
        from hybridlb.grammar import GrammarError

        ready, failed = [], self._expired()
        for request in [r for r in self.compiling if r.compiling.done()]:
            self.compiling.remove(request)
            future, request.compiling = request.compiling, None
            if (error := future.exception()) is None:
                request.grammar = future.result()
                self._replay(request)
                ready.append(request)
                continue
            request.status = Status.FINISHED
            kind = "invalid" if isinstance(error, GrammarError) else "internal"
            if kind == "internal":
                log.error("engine %d: the grammar of request %s failed: %s: %s", self.rank, request.request_id,
                          type(error).__name__, error)
            failed.append(RequestOutput(request.request_id, [], "error", error=str(error), error_kind=kind))
        return ready, failed

    def _expired(self) -> list[RequestOutput]:
        """The error outputs of requests whose grammar is still not compiled after compile_timeout_s."""
        limit = self.config.structured_outputs.compile_timeout_s
        late = [r for r in self.compiling if not r.compiling.done() and time.monotonic() - r.arrived_at > limit]
        for request in late:
            self.drop(request)
            log.warning("engine %d: the grammar of request %s did not compile within %g s", self.rank,
                        request.request_id, limit)
        return [RequestOutput(r.request_id, [], "error", error_kind="invalid", error=(
                    f"its grammar did not compile within {limit:g} s (structured_outputs.compile_timeout_s); "
                    "simplify it")) for r in late]

    def follow(self, request: Request, token: int) -> tuple[str | None, int | None, str | None]:
        """Advance the request's grammar by the token it sampled: (finish reason, stop token, error)."""
        if request.opening:
            output, opener = request.output_token_ids, request.params.constraint.opener
            if output == opener[: len(output)]:  # thinking: the grammar waits for `after`
                request.opening = len(output) < len(opener)
                return None, None, None
            request.opening, request.grammar_started = False, True  # no opener: the token is the grammar's
        elif not request.grammar_started:
            after = request.params.constraint.after
            request.grammar_started = request.output_token_ids[-len(after):] == after
            return None, None, None
        if not request.grammar.accept(token):  # the mask allowed it: no token was left, or an engine bug
            if request.restricts_tokens:  # allowed_token_ids, bad_words or min_tokens left the grammar no token
                return "error", None, ("no token is allowed by both the request's grammar and its "
                                       "allowed_token_ids, bad_words or min_tokens; loosen one of them")
            log.error("engine %d: request %s sampled token %d, which its grammar rejects", self.rank,
                      request.request_id, token)
            return "error", None, f"engine {self.rank}: the output left the request's grammar at token {token}"
        if request.grammar.done:  # complete, and nothing may follow
            return "stop", token if token in self.eos_token_ids or token in request.stop_ids else None, None
        return None, None, None

    def _replay(self, request: Request) -> None:
        """A migrated request's grammar, advanced through the output it already has."""
        produced = request.output_token_ids
        if not produced:
            return
        del request.token_ids[request.num_prompt_tokens :]
        for token in produced:
            request.token_ids.append(token)
            self.follow(request, token)

    def _cache(self) -> GrammarCache:
        if self.grammars is None:
            from hybridlb.checkpoint.tokenizer import Tokenizer
            from hybridlb.grammar import GrammarCache, make_backend

            options, model, vocab = self.config.structured_outputs, self.config.model, self.vocab_size
            self.grammars = GrammarCache(lambda: make_backend(options, Tokenizer(model), vocab), options.cache_size,
                                         options.cache_bytes)
        return self.grammars
