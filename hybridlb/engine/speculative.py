"""Speculative decoding by n-gram prompt lookup (vLLM's ``"method": "ngram"``).

Before a step, a decoding request proposes a draft: its last n tokens (n from
``prompt_lookup_max`` down to ``prompt_lookup_min``, longest first) are looked up earlier in
its own prompt and output, and the tokens that followed their latest earlier occurrence
are the draft (at most ``num_speculative_tokens``). The step computes the request's next
token and the draft in one pass, one row per position. The core then samples row by row
(``EngineCore._verify_drafts``): row 0 exactly as without speculation; row j only while the
token just sampled equals draft token j, which makes row j's context the one the request
really has. A draft is thus a guess that is checked, never an output: for a draft that is
one fixed token, "sample from the model's distribution and keep it if it equals the draft,
else keep what was sampled" is standard rejection sampling, so greedy and sampled outputs
are distributed exactly as without speculation (seeded requests draw the same noise per
output token and so produce the same tokens).

A rejected draft still cost its rows: nothing at small batches (a step streams the weights
whatever its rows), most of a step at large ones. So each draft is as long as it pays
(``NgramProposer.length``): a draft token at position j holds with probability q**j, where q
is the request's recent per-token acceptance (decayed counts, drawn towards the engine's own
rate); it is worth its row while q**j is at least what a row costs against a token's share
of the step at this batch size, both measured on the engine's own decode steps
(``StepCost``). A request whose estimate allows no draft probes with one token after waiting
3, 15, 63 ... decode steps as probes miss; a hit resets the wait and raises the estimate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from hybridlb.config import SpeculativeConfig
from hybridlb.engine.request import Request

LOOKBACK = 4096  # tokens searched for a match (the most recent ones)
MAX_WAIT = 64  # most decode steps a request whose drafts keep failing goes without drafting
REQUEST_DECAY = 0.7  # a request's acceptance counts: about its last three drafts
ENGINE_DECAY = 0.99  # the engine's: about its last hundred
PRIOR_WEIGHT = 1.0  # drafts' worth of the engine's rate in a request's estimate
STEP_DECAY = 0.95  # the step-time curve: about the last twenty decode steps of each size
STEP_SAMPLES = 3  # decode steps of a size before its time counts
PRIOR_STEP_ROWS = 30  # until measured: a decode row costs 1/30 of a step's fixed part (SmolLM2
# bfloat16 here: a step of 16 decodes ~22 ms, each further row ~0.6 ms)


class StepCost:
    """What a decode row costs, from the engine's own decode steps: decayed mean seconds and
    rows per size class (rows 1, 2-3, 4-7, 8-15, ...); the cost of a row at a batch size is the
    slope from its class to the nearest other class measured (a step is flat in rows while it
    streams the weights, and grows in them once it turns compute-bound)."""

    def __init__(self) -> None:
        self.classes: dict[int, list[float]] = {}  # rows.bit_length() → [weight, rows, seconds]

    def timed(self, rows: int, seconds: float) -> None:
        weight, total_rows, total_s = self.classes.get(rows.bit_length(), (0.0, 0.0, 0.0))
        self.classes[rows.bit_length()] = [STEP_DECAY * weight + 1, STEP_DECAY * total_rows + rows,
                                           STEP_DECAY * total_s + seconds]

    def _mean(self, size_class: int) -> tuple[float, float] | None:
        weight, rows, seconds = self.classes.get(size_class, (0.0, 0.0, 0.0))
        return (rows / weight, seconds / weight) if weight >= STEP_SAMPLES else None

    def threshold(self, batch: int) -> float:
        """The acceptance probability at which a draft row pays in a step of ``batch`` decodes:
        a row's cost over a token's share of the step."""
        here = self._mean(batch.bit_length())
        others = [(abs(c - batch.bit_length()), c > batch.bit_length(), mean) for c in self.classes
                  if c != batch.bit_length() and (mean := self._mean(c))]
        if here is None or not others:
            return batch / (PRIOR_STEP_ROWS + batch)
        _, _, there = min(others, key=lambda o: (o[0], not o[1]))  # nearest; above before below
        (x0, y0), (x1, y1) = sorted([here, there])
        per_row = max((y1 - y0) / (x1 - x0), 0.0) if x1 > x0 else 0.0
        step = here[1] + per_row * (batch - here[0])
        return min(per_row * batch / step, 1.0) if step > 0 else 1.0


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.longest = config.prompt_lookup_max
        self.shortest = config.prompt_lookup_min
        self.cost = StepCost()
        self.hits, self.misses = 1.0, 1.0  # the engine's decayed acceptance counts (a prior of 1/2)

    def acceptance(self, request: Request) -> float:
        """The chance that a draft token of ``request`` holds, given that the ones before it did."""
        prior = self.hits / (self.hits + self.misses)
        return (request.draft_hits + PRIOR_WEIGHT * prior) / (request.draft_hits + request.draft_rejects
                                                              + PRIOR_WEIGHT)

    def length(self, request: Request, batch: int) -> int:
        """How many draft tokens pay for their rows in a step of ``batch`` running requests."""
        q, threshold = self.acceptance(request), self.cost.threshold(batch)
        if q >= 1.0 or threshold <= 0.0:
            return self.k
        if q <= threshold:
            return 0
        return min(self.k, int(math.log(threshold) / math.log(q)))

    def draft(self, request: Request, most: int, batch: int) -> list[int]:
        """The request's draft this step among ``batch`` running requests: as long as pays, or a
        one-token probe once a request that drafts nothing has waited out its back-off."""
        length = self.length(request, batch)
        if not length:
            if request.draft_wait:
                request.draft_wait -= 1
                return []
            length = 1
        return self.propose(request.token_ids, min(most, length))

    def checked(self, request: Request, drafted: int, accepted: int) -> None:
        """After ``accepted`` of ``drafted`` draft tokens held: update the estimates; back off
        after a miss at the first token, reset after a hit."""
        rejected = float(accepted < drafted)
        request.draft_hits = REQUEST_DECAY * request.draft_hits + accepted
        request.draft_rejects = REQUEST_DECAY * request.draft_rejects + rejected
        self.hits = ENGINE_DECAY * self.hits + accepted
        self.misses = ENGINE_DECAY * self.misses + rejected
        if accepted:
            request.draft_misses = request.draft_wait = 0
            return
        request.draft_misses += 1
        request.draft_wait = min(4**request.draft_misses - 1, MAX_WAIT)

    def propose(self, token_ids: list[int], most: int) -> list[int]:
        """Up to ``min(k, most)`` tokens that followed the latest earlier occurrence of the
        longest matching suffix of ``token_ids``; [] if no suffix of at least
        ``prompt_lookup_min`` tokens occurs earlier."""
        most = min(self.k, most)
        if most <= 0 or len(token_ids) <= self.shortest:
            return []
        tokens = np.asarray(token_ids[-LOOKBACK:], dtype=np.int64)
        for n in range(min(self.longest, len(tokens) - 1), self.shortest - 1, -1):
            # Windows start at 0 .. len - 1 - n: each is followed by at least one token, and the
            # suffix itself (starting at len - n) is not among them.
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start : start + most].tolist()
        return []


@dataclass
class SpecStats:
    """vLLM's spec_decode counters: drafts proposed, their tokens, the tokens accepted, and the
    acceptances at each draft position (position 0 is each draft's first token)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def proposed(self, length: int) -> None:
        self.drafts += 1
        self.draft_tokens += length

    def accepted(self, position: int) -> None:
        self.accepted_tokens += 1
        while len(self.accepted_per_position) <= position:
            self.accepted_per_position.append(0)
        self.accepted_per_position[position] += 1
