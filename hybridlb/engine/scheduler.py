"""Continuous batching: which requests compute how many tokens in the next step.

Every step has a token budget (``max_num_batched_tokens``). Running requests go
first, oldest first: a decoding request takes one token, a request part-way through a
long prompt takes the next chunk. Waiting requests are then admitted while budget,
batch size and KV blocks allow, their prompt chunked to fit the remaining budget.
A waiting request first takes the longest prefix of its tokens the KV cache already
holds (prefix caching, see BlockManager) and computes only the rest. When a running
request needs a block and none is free, the newest running request is preempted: its
blocks are freed and it goes back to the head of the waiting queue, to be recomputed
from its tokens so far (the blocks it filled usually still cached).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from hybridlb.engine.block_manager import BlockManager
from hybridlb.engine.lora import AdapterSlots
from hybridlb.engine.request import Request, Status
from hybridlb.engine.speculative import NgramProposer, SpecStats


@dataclass
class ScheduledChunk:
    request: Request
    num_tokens: int  # positions computed: the request's next tokens, then the draft's
    draft: list[int] = field(default_factory=list)  # proposed tokens after the request's last one

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the known tokens, so a token is sampled."""
        return self.request.num_computed + self.num_tokens - len(self.draft) == self.request.num_tokens

    @property
    def token_ids(self) -> list[int]:
        """The tokens of the positions this chunk computes."""
        start = self.request.num_computed
        return self.request.token_ids[start : start + self.num_tokens - len(self.draft)] + self.draft


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, block_manager: BlockManager,
                 proposer: NgramProposer | None = None, adapters: AdapterSlots | None = None):
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.blocks = block_manager
        self.proposer = proposer
        self.adapters = adapters  # LoRA: which adapter each slot holds (a batch mixes at most that many)
        self.spec_stats = SpecStats()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        chunks, preempted = self._schedule_running(budget)
        budget -= sum(c.num_tokens for c in chunks)
        if not preempted:
            chunks += self._admit_waiting(budget)
        return chunks

    def _schedule_running(self, budget: int) -> tuple[list[ScheduledChunk], bool]:
        chunks: list[ScheduledChunk] = []
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_tokens = min(request.num_uncomputed, budget)
            while not self.blocks.can_allocate(request, num_tokens):
                self._preempt(self.running.pop())
                preempted = True
                if index == len(self.running):  # preempted the request itself
                    return chunks, preempted
            draft = []
            if request.num_uncomputed == 1:  # decoding: the requests after it keep a block each for their next token
                draft = self._draft(request, budget - num_tokens, reserve=len(self.running) - index - 1)
            self.blocks.allocate(request, num_tokens + len(draft))
            chunks.append(ScheduledChunk(request, num_tokens + len(draft), draft))
            budget -= num_tokens + len(draft)
            index += 1
        return chunks, preempted

    def _draft(self, request: Request, budget: int, reserve: int) -> list[int]:
        """A decoding request's proposal, within the step's budget, its max_tokens (the step also
        yields one token past an accepted draft) and the free blocks less ``reserve``: a draft never
        preempts anyone, nor takes a block another running request needs this step."""
        if self.proposer is None:
            return []
        room = request.max_tokens - request.num_output_tokens - 1
        draft = self.proposer.draft(request, min(budget, room), len(self.running))
        while draft and self.blocks.blocks_needed(request, 1 + len(draft)) > self.blocks.num_free - reserve:
            draft.pop()
        if draft:
            self.spec_stats.proposed(len(draft))
        return draft

    def _admit_waiting(self, budget: int) -> list[ScheduledChunk]:
        chunks = []
        passed = []  # requests whose adapter has no slot free this step: they keep their place
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if not self._adapter_slot(request):
                passed.append(self.waiting.popleft())
                continue
            hit = self.blocks.lookup(request)
            num_tokens = min(request.num_tokens - len(hit) * self.blocks.block_size, budget)
            if not self.blocks.can_allocate(request, num_tokens, hit):
                break
            self.waiting.popleft()
            self.blocks.count_lookup(request, hit)
            self.blocks.allocate(request, num_tokens, hit)
            request.status = Status.RUNNING
            if request.scheduled_at is None:
                request.scheduled_at = time.monotonic()
            self.running.append(request)
            chunks.append(ScheduledChunk(request, num_tokens))
            budget -= num_tokens
        self.waiting.extendleft(reversed(passed))
        return chunks

    def _adapter_slot(self, request: Request) -> bool:
        """Give a request naming an adapter its slot; False while every slot holds an adapter that
        running requests use."""
        lora = request.params.lora
        if lora is None:
            return True
        busy = {r.params.lora for r in self.running if r.params.lora is not None}
        slot = self.adapters.assign(lora, busy)
        request.lora_slot = -1 if slot is None else slot
        return slot is not None

    def adapter_stats(self) -> dict:
        """EngineStats' LoRA fields: the adapters held (least recently used first), those running
        requests use, those waiting requests wait for, and placements so far; none without LoRA."""
        if self.adapters is None:
            return {}

        def names(requests):
            return sorted({r.params.lora.name for r in requests if r.params.lora is not None})

        return {"lora_loaded": self.adapters.names(), "lora_running": names(self.running),
                "lora_waiting": names(self.waiting), "lora_loads": self.adapters.loads}

    def _preempt(self, request: Request) -> None:
        self.blocks.free(request)
        request.reset_for_recompute()
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def finish(self, request: Request) -> None:
        """Remove a finished or aborted request from whichever queue holds it."""
        if request.status is Status.RUNNING:
            self.running.remove(request)
        elif request.status is Status.WAITING:
            self.waiting.remove(request)
        self.blocks.free(request)
        request.status = Status.FINISHED
