"""LoRA adapters in one engine process, the one place it keeps them: whether a request's adapter
can be served here (``read_for_request``), its tensors read from disk when the request comes in
(``AdapterReader``, so a step only installs tensors already in memory), and which adapter each
of the engine's slots holds (``AdapterSlots``). The layers that compute with them, and install
an adapter's tensors in a slot, are ``hybridlb.model.lora``.

The scheduler asks for a slot when it admits a request that names an adapter. An adapter
already held keeps its slot; otherwise it takes a free slot, or evicts the least recently
used adapter that no running request needs. When every slot is needed by running requests,
the request waits (it is not failed) and requests behind it may go first.
"""

from __future__ import annotations

import itertools
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING

from hybridlb.checkpoint.lora import WEIGHTS_FILE, AdapterError, AdapterInfo, read_adapter
from hybridlb.checkpoint.spec import ModelSpec
from hybridlb.config import EngineConfig
from hybridlb.params import LoRARequest

if TYPE_CHECKING:
    import torch


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


class AdapterWeights:
    """One adapter as read from disk: its modules, checked against the model, and its tensors."""

    def __init__(self, lora: LoRARequest, info: AdapterInfo, tensors: dict[str, torch.Tensor]):
        self.lora, self.info, self.tensors = lora, info, tensors


class AdapterReader:
    """Adapters read from disk. The ``cpu_slots`` most recently used stay in memory; past those,
    one that a request still holds (``Request.lora_weights``) is not read again either."""

    def __init__(self, spec: ModelSpec, max_rank: int, cpu_slots: int):
        self.spec, self.max_rank, self.cpu_slots = spec, max_rank, cpu_slots
        self.recent: OrderedDict[LoRARequest, AdapterWeights] = OrderedDict()
        self._held: weakref.WeakValueDictionary[LoRARequest, AdapterWeights] = weakref.WeakValueDictionary()

    def read(self, lora: LoRARequest) -> AdapterWeights:
        """``lora``'s tensors (AdapterError for a directory that cannot be served)."""
        weights = self.recent.pop(lora, None) or self._held.get(lora) or self._from_disk(lora)
        self.recent[lora] = self._held[lora] = weights
        while len(self.recent) > self.cpu_slots:
            self.recent.popitem(last=False)
        return weights

    def _from_disk(self, lora: LoRARequest) -> AdapterWeights:
        from safetensors.torch import load_file

        info = read_adapter(lora.path, self.spec, self.max_rank)
        tensors = {key.removeprefix("base_model.model."): value
                   for key, value in load_file(f"{lora.path}/{WEIGHTS_FILE}").items()}
        return AdapterWeights(lora, info, tensors)


def read_for_request(config: EngineConfig, runner, lora: LoRARequest) -> AdapterWeights | str:
    """A request's adapter read (``runner.check_lora``), or why it cannot be served here. Any
    failure to read it (a file replaced or truncated since it was registered) is the request's
    error, never the engine's."""
    if config.lora is None:
        return f"this engine serves no LoRA adapters (engine.lora is unset); {lora.name!r} needs --enable-lora"
    try:
        return runner.check_lora(lora)
    except AdapterError as exc:
        return f"LoRA adapter {lora.name!r}: {exc}"
    except Exception as exc:
        return f"LoRA adapter {lora.name!r} cannot be read: {type(exc).__name__}: {exc}"
