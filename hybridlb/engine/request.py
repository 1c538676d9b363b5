"""Engine-side state of one request."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from hybridlb.protocol import SamplingParams

if TYPE_CHECKING:  # a simulated engine never loads torch (start-up time and memory per process)
    import torch


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
        self.status = Status.WAITING
        self.stop_ids = set(params.stop_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    def reset_for_recompute(self) -> None:
        """Preempted: the KV cache is gone; prompt and outputs so far are recomputed later."""
        self.num_computed = 0
        self.block_ids = []
        self.status = Status.WAITING
