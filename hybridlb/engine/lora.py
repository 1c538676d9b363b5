"""Which adapter each of an engine's LoRA slots holds (bookkeeping only; the model runner loads
the weights, ``hybridlb.model.lora``).

The scheduler asks for a slot when it admits a request that names an adapter. An adapter
already held keeps its slot; otherwise it takes a free slot, or evicts the least recently
used adapter that no running request needs. When every slot is needed by running requests,
the request waits (it is not failed) and requests behind it may go first.
"""

from __future__ import annotations

import itertools

from hybridlb.params import LoRARequest


class AdapterSlots:
    def __init__(self, count: int):
        self.held: list[LoRARequest | None] = [None] * count
        self._used = [0] * count  # when each slot was last assigned (a counter)
        self._clock = itertools.count(1)
        self.loads = 0  # adapters placed into a slot since start

    def assign(self, lora: LoRARequest, busy: set[LoRARequest]) -> int | None:
        """A slot holding ``lora``, or None while every slot holds an adapter in ``busy``."""
        if lora in self.held:
            slot = self.held.index(lora)
        elif None in self.held:
            slot = self.held.index(None)
        else:
            idle = [slot for slot, held in enumerate(self.held) if held not in busy]
            if not idle:
                return None
            slot = min(idle, key=self._used.__getitem__)
        if self.held[slot] != lora:
            self.held[slot] = lora
            self.loads += 1
        self._used[slot] = next(self._clock)
        return slot

    def take_free(self, lora: LoRARequest) -> int | None:
        """Eager loading: a free slot for ``lora`` (None if it is held already or none is free)."""
        if lora in self.held or None not in self.held:
            return None
        return self.assign(lora, set())

    def names(self) -> list[str]:
        """The adapters held, least recently used first."""
        order = sorted((self._used[s], held.name) for s, held in enumerate(self.held) if held is not None)
        return [name for _, name in order]
