"""Paged KV cache bookkeeping: which fixed-size blocks each request owns, and which full
blocks are cached for reuse by later requests with the same prefix.

Prefix caching: every full block a request computes is registered under its chained hash
(``hybridlb.prefix_hash``). A new request first claims the blocks of its longest cached
prefix and computes only the rest. Blocks are reference-counted; a block nobody holds
goes to the free queue but keeps its cached content until the pool needs it, oldest
first (least recently used), and the last blocks of a sequence go before its first ones
(a shared prefix outlives the tails that hang off it). Blocks without cached content are
handed out before any cached one.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from hybridlb.engine.request import Request
from hybridlb.prefix_hash import extend_hashes


@dataclass
class Stored:
    """A block entered the cache."""

    block_hash: int
    parent_hash: int | None
    token_ids: list[int]


@dataclass
class Removed:
    """A cached block was evicted (its memory reused for something else)."""

    block_hash: int


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, caching: bool = True, seed: int = 0):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        self.seed = seed  # the hash chain's start (the model), see prefix_hash.hash_seed
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # next to use first
        self.refs = [0] * num_blocks
        self.hash_of: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # block hash -> block id
        # The engine process turns these on: evictions go to its front ends (routing), stored
        # blocks to a KV-event publisher if one is configured.
        self.record_events = False
        self.record_stored = False
        self.events: list[Stored | Removed] = []
        self.queried_tokens = 0  # prompt tokens looked up in the cache (vLLM's prefix_cache_queries)
        self.hit_tokens = 0  # of those, found cached

    def _seed(self, request: Request) -> int:
        """Where ``request``'s hash chain starts: the model's, or its adapter's (Request.hash_seed)."""
        return self.seed if request.hash_seed is None else request.hash_seed

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached blocks nobody holds count as free)."""
        return 1.0 - self.num_free / self.num_blocks

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    def take_events(self) -> list[Stored | Removed]:
        events, self.events = self.events, []
        return events

    # -- lookup ----------------------------------------------------------------------
    def lookup(self, request: Request) -> list[int]:
        """The cached blocks of ``request``'s longest cached prefix (nothing is claimed yet).

        At least one token is always left to compute, so the last position's logits exist
        to sample from. A request that wants prompt log-probabilities computes its whole
        prompt (cached blocks have no logits).
        """
        if not self.caching or request.block_ids or request.params.prompt_logprobs is not None:
            return []
        most = (request.num_tokens - 1) // self.block_size
        extend_hashes(request.block_hashes, request.token_ids, self.block_size, self._seed(request), most)
        hit = []
        for block_hash in request.block_hashes[:most]:
            block = self.cached.get(block_hash)
            if block is None:
                break
            hit.append(block)
        return hit

    # -- allocation ------------------------------------------------------------------
    def blocks_needed(self, request: Request, num_new_tokens: int, hit: list[int] = ()) -> int:
        """Blocks taken from the free queue for ``request`` to hold ``num_new_tokens`` more
        tokens after its cached prefix ``hit`` (hit blocks nobody holds come off the queue too)."""
        held = len(request.block_ids) + len(hit)
        total = request.num_computed + len(hit) * self.block_size + num_new_tokens
        reclaimed = sum(1 for block in hit if self.refs[block] == 0)
        return max(0, -(-total // self.block_size) - held) + reclaimed

    def can_allocate(self, request: Request, num_new_tokens: int, hit: list[int] = ()) -> bool:
        return self.blocks_needed(request, num_new_tokens, hit) <= self.num_free

    def allocate(self, request: Request, num_new_tokens: int, hit: list[int] = ()) -> None:
        """Give ``request`` its cached prefix ``hit`` (it counts as computed) and enough new
        blocks for ``num_new_tokens`` more."""
        for block in hit:
            if self.refs[block] == 0:
                del self.free_blocks[block]
            self.refs[block] += 1
        if hit:
            request.block_ids = list(hit)
            request.num_cached_blocks = len(hit)
            request.num_computed = len(hit) * self.block_size
        total = request.num_computed + num_new_tokens
        for _ in range(max(0, -(-total // self.block_size) - len(request.block_ids))):
            request.block_ids.append(self._take_free())

    def count_lookup(self, request: Request, hit: list[int]) -> None:
        """Count a request's first admission in the hit-rate counters (a recompute after
        preemption is not a new query)."""
        if self.caching and not request.looked_up and request.params.prompt_logprobs is None:
            self.queried_tokens += request.num_prompt_tokens
            self.hit_tokens += len(hit) * self.block_size
        request.looked_up = True

    def _take_free(self) -> int:
        block, _ = self.free_blocks.popitem(last=False)
        block_hash = self.hash_of[block]
        if block_hash is not None:  # evict its cached content
            self.hash_of[block] = None
            del self.cached[block_hash]
            if self.record_events:
                self.events.append(Removed(block_hash))
        self.refs[block] = 1
        return block

    def free(self, request: Request) -> None:
        """Drop ``request``'s hold on its blocks; cached ones stay reusable until evicted."""
        for block in reversed(request.block_ids):  # a sequence's tail is evicted before its head
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free_blocks[block] = None
                if self.hash_of[block] is None:
                    self.free_blocks.move_to_end(block, last=False)  # nothing to keep: reuse it first
        request.block_ids = []
        request.num_cached_blocks = 0

    # -- caching ---------------------------------------------------------------------
    def cache_computed(self, request: Request) -> None:
        """Register the blocks ``request`` has filled since the last call."""
        if not self.caching:
            return
        full = request.num_computed // self.block_size
        if full <= request.num_cached_blocks:
            return
        extend_hashes(request.block_hashes, request.token_ids, self.block_size, self._seed(request), full)
        for index in range(request.num_cached_blocks, full):
            block_hash, block = request.block_hashes[index], request.block_ids[index]
            if block_hash in self.cached:
                continue  # another request computed the same block first: ours stays private
            self.cached[block_hash] = block
            self.hash_of[block] = block_hash
            if self.record_stored:
                parent = request.block_hashes[index - 1] if index else None
                tokens = request.token_ids[index * self.block_size : (index + 1) * self.block_size]
                self.events.append(Stored(block_hash, parent, tokens))
        request.num_cached_blocks = full
