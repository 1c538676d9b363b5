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

A rejected draft still cost its rows, which is nothing at small batches (a step streams the
weights whatever its rows) and most of a step at large ones. So a request whose draft is
rejected at its first token waits before drafting again, 1, 3, 7 ... up to MAX_WAIT decode
steps as misses repeat, while more than FREE_DRAFT_BATCH requests run; one accepted token
resets it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from hybridlb.config import SpeculativeConfig
from hybridlb.engine.request import Request

LOOKBACK = 4096  # tokens searched for a match (the most recent ones)
MAX_WAIT = 64  # most decode steps a request whose drafts keep failing goes without drafting
# Up to this many running requests, every decode drafts whatever its misses: a step of SmolLM2 at
# batch 1 took 27.2 ms with one row and 28.4 ms with five (bfloat16, this machine), but at batch 16
# drafts that all failed made steps 2.4x longer.
FREE_DRAFT_BATCH = 4


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.longest = config.prompt_lookup_max
        self.shortest = config.prompt_lookup_min

    def draft(self, request: Request, most: int, batch: int) -> list[int]:
        """The request's draft this step, unless it is backing off after missed drafts in a batch of
        ``batch`` running requests."""
        if request.draft_wait:
            request.draft_wait -= 1
            if batch > FREE_DRAFT_BATCH:
                return []
        return self.propose(request.token_ids, most)

    def checked(self, request: Request, accepted: int) -> None:
        """After a draft of ``request`` was checked: back off after a miss, reset after a hit."""
        if accepted:
            request.draft_misses = request.draft_wait = 0
            return
        request.draft_misses += 1
        request.draft_wait = min(2**request.draft_misses - 1, MAX_WAIT)

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
