"""What one API server believes each of its ranks holds in its prefix cache.

The API server records the block hashes of every prompt it sends to a rank
(``hybridlb.prefix_hash``, the engine's own hashes) and forgets those the engine reports
evicted. The view is approximate: bounded to the rank's KV pool size (oldest forgotten
first), blind to what other API servers sent, and a little ahead of the engine (a prompt
still queued counts as cached). It only steers routing; the engine's own cache decides
what is reused.
"""

from __future__ import annotations

from collections import OrderedDict


class PrefixIndex:
    def __init__(self, capacity: int):
        self.capacity = max(1, capacity)
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.blocks)

    def matched(self, hashes: list[int]) -> int:
        """How many leading blocks of ``hashes`` the rank holds."""
        count = 0
        for block_hash in hashes:
            if block_hash not in self.blocks:
                break
            count += 1
        return count

    def record(self, hashes: list[int]) -> None:
        """``hashes`` (a prompt's chain) went to the rank; the chain's root counts as the
        most recently used, as the engine frees a sequence's tail before its head."""
        for block_hash in reversed(hashes):
            self.blocks[block_hash] = None
            self.blocks.move_to_end(block_hash)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)

    def forget(self, hashes: list[int]) -> None:
        for block_hash in hashes:
            self.blocks.pop(block_hash, None)
