"""vLLM's KV-cache events, as hybridlb's: what feeds the API server's prefix index."""

from __future__ import annotations

from hybridlb.engine.block_manager import Removed, Stored
from hybridlb.prefix_hash import block_hash


class CacheEvents:
    """Stands in for the KV-event publisher of vLLM's scheduler: follows the blocks vLLM caches,
    naming each by hybridlb's hash of the same tokens (``prefix_hash``, what the API server's
    prefix index routes by), as ``Stored`` events, and the ones vLLM evicts as ``Removed``."""

    def __init__(self, seed: int, adapter_seeds: dict[str, int]):
        self.seed, self.adapter_seeds = seed, adapter_seeds
        self.ours: dict = {}  # vLLM's block hash -> hybridlb's
        self.events: list[Stored | Removed] = []

    def publish(self, batch) -> None:
        for event in batch.events:
            kind = type(event).__name__
            if kind == "BlockStored":
                seed = self.adapter_seeds.get(event.lora_name, self.seed) if event.lora_name else self.seed
                parent = seed if event.parent_block_hash is None else self.ours.get(event.parent_block_hash)
                if parent is None:  # its parent left before we saw it: nothing to name it by
                    continue
                size = event.block_size
                for index, theirs in enumerate(event.block_hashes):
                    tokens = event.token_ids[index * size:(index + 1) * size]
                    ours = block_hash(parent, tokens)
                    self.events.append(Stored(ours, parent, tokens))
                    self.ours[theirs] = parent = ours
            elif kind == "BlockRemoved":
                self.events += [Removed(ours) for theirs in event.block_hashes
                                if (ours := self.ours.pop(theirs, None)) is not None]
            elif kind == "AllBlocksCleared":
                self.events += [Removed(ours) for ours in self.ours.values()]
                self.ours.clear()

    def shutdown(self) -> None:
        """vLLM's scheduler calls it on shutdown: nothing to release."""
