"""Paged KV cache bookkeeping: which fixed-size blocks each request owns."""

from __future__ import annotations

from collections import deque

from hybridlb.engine.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Extra blocks for the cache to hold ``num_new_tokens`` more of ``request``."""
        total = request.num_computed + num_new_tokens
        return max(0, -(-total // self.block_size) - len(request.block_ids))

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        return self.blocks_needed(request, num_new_tokens) <= self.num_free

    def allocate(self, request: Request, num_new_tokens: int) -> None:
        for _ in range(self.blocks_needed(request, num_new_tokens)):
            request.block_ids.append(self.free_blocks.popleft())

    def free(self, request: Request) -> None:
        self.free_blocks.extend(request.block_ids)
        request.block_ids = []
