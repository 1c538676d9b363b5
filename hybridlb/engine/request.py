"""Engine-side state of one request."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from hybridlb.params import SamplingParams
from hybridlb.protocol import TokenLogprobs

if TYPE_CHECKING:  # a simulated engine never loads torch (start-up time and memory per process)
    from concurrent.futures import Future

    import torch

    from hybridlb.engine.lora import AdapterWeights
    from hybridlb.grammar import Matcher


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """Tokens of one sequence and how far the KV cache holds them.

    ``token_ids`` is the prompt followed by every generated token; the KV cache holds
    the first ``num_computed`` of them in ``block_ids``. A step computes the next
    chunk and, when the chunk reaches the end, samples one more token.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 max_tokens: int, generator: torch.Generator | None):
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens
        self.generator = generator
        self.num_computed = 0
        self.block_ids: list[int] = []
        # Prefix caching (see BlockManager): the hash of each full block of token_ids so far
        # computed, how many leading blocks are registered in the cache, whether the
        # cache was consulted for this request yet.
        self.block_hashes: list[int] = []
        self.num_cached_blocks = 0
        self.looked_up = False
        self.status = Status.WAITING
        self.stop_ids = set(params.stop_token_ids)
        self.arrived_at = time.monotonic()
        self.scheduled_at: float | None = None  # first admitted to the running batch
        # Filled by the model runner: sampled tokens' log-probabilities not yet sent, and the
        # prompt's (position 0 has none), sent whole with the first output.
        self.logprobs: list[TokenLogprobs] = []
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None if params.prompt_logprobs is None else [None]
        self.prompt_logprobs_sent = False
        # Structured outputs: the matcher once its grammar compiled (``compiling`` until then),
        # and whether the constrained part began (at once, or after params.constraint.after).
        self.compiling: Future[Matcher] | None = None
        self.grammar: Matcher | None = None
        self.grammar_started = params.constraint is not None and not params.constraint.after
        # While the output may still become the constraint's opener (see Constraint.opener).
        self.opening = params.constraint is not None and bool(params.constraint.after and params.constraint.opener)
        # Tokens masked until min_tokens are out (eos and stop_token_ids), set by the engine.
        self.min_tokens_banned: list[int] = []
        # Speculative decoding (see NgramProposer): decayed counts of draft tokens accepted and of
        # drafts cut by a rejection, probes in a row missed at their first token, and decode steps
        # to go before the next probe.
        self.draft_hits = 0.0
        self.draft_rejects = 0.0
        self.draft_misses = 0
        self.draft_wait = 0
        # LoRA: the engine slot holding this request's adapter while it runs (-1: the base
        # model), the adapter's tensors (read from disk when the request came in, so a step
        # only installs them), and the start of its block-hash chain (an adapter's KV is its own).
        self.lora_slot = -1
        self.lora_weights: AdapterWeights | None = None
        self.hash_seed: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def constrained(self) -> bool:
        """Whether this step's logits go through the grammar's mask."""
        return self.grammar is not None and (self.grammar_started or (self.opening and not self.num_output_tokens))

    @property
    def forced_token(self) -> int | None:
        """The opener's next token, once the output began it (nothing else may follow)."""
        if not self.opening or not self.num_output_tokens:
            return None
        return self.params.constraint.opener[self.num_output_tokens]

    @property
    def masks_logits(self) -> bool:
        """Whether anything beyond the grammar restricts this row's tokens (the sampler's masks)."""
        return bool(self.params.allowed_token_ids or self.params.bad_words
                    or (self.min_tokens_banned and self.num_output_tokens < self.params.min_tokens))

    @property
    def restricts_tokens(self) -> bool:
        """Whether its own params mask tokens beside a grammar (which may leave the grammar none)."""
        return bool(self.params.allowed_token_ids or self.params.bad_words or self.params.min_tokens)

    def take_logprobs(self) -> tuple[list[TokenLogprobs] | None, list[TokenLogprobs | None] | None]:
        """What the next output carries: the new tokens' log-probabilities, and the prompt's once."""
        new = None
        if self.params.logprobs is not None:
            new, self.logprobs = self.logprobs, []
        prompt = None
        if self.prompt_logprobs is not None and not self.prompt_logprobs_sent:
            prompt, self.prompt_logprobs_sent = self.prompt_logprobs, True
        return new, prompt

    def reset_for_recompute(self) -> None:
        """Preempted: the KV cache is gone; prompt and outputs so far are recomputed later."""
        self.num_computed = 0
        self.block_ids = []
        self.num_cached_blocks = 0
        self.status = Status.WAITING
