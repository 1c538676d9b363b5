"""LoRA adapters inside the model: every adapted projection holds ``max_loras`` slots, and one
batch mixes rows of different adapters (and of none).

Each slot of a projection stores its adapter's ``A`` matrices stacked (rank padded to
``max_lora_rank``; a fused projection such as q/k/v stacks one per part) and the matching
rows of ``B``, scaled, in the columns of their part. A step then adds, to the base
projection's output,

    ((x @ A_all.T) * row_mask) @ B_all

where ``row_mask`` keeps, for each row, only its own adapter's slot. That is the torch path:
two matmuls and a multiply per projection whatever the mix of adapters, every row paying for
every slot up to the highest one used. On CPU the kernel ``lora.c`` does the same sum with each
row reading only its own adapter's rows (and skipping parts its adapter leaves alone): one
call per projection, no per-request work in the layers. A step with no adapter rows skips
both.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from hybridlb.checkpoint.lora import AdapterInfo, module_shape
from hybridlb.checkpoint.spec import ModelSpec
from hybridlb.kernels import CPUKernels
from hybridlb.params import LoRARequest

# The fused projections of a decoder layer and the PEFT modules they hold, in column order.
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
         "down": ("down_proj",)}
RANK_BLOCK = 4  # lora.c's RANKS


class LoRARows:
    """Which slot each row of the current step uses; shared by every LoRALinear of a model."""

    def __init__(self):
        self.slots: torch.Tensor | None = None  # [rows] int64, -1 for the base model; None: no adapter rows
        self.slots_used = 0  # the highest slot used, plus one
        self._mask: torch.Tensor | None = None

    def set(self, slots: list[int], dtype: torch.dtype, device: torch.device) -> None:
        """``slots``: each row's slot, -1 for the base model."""
        top = max(slots, default=-1)
        self._mask = None
        if top < 0:
            self.slots, self.slots_used = None, 0
            return
        self.slots = torch.tensor(slots, dtype=torch.long, device=device)
        self.slots_used, self._dtype = top + 1, dtype

    @property
    def mask(self) -> torch.Tensor:
        """[rows, slots used, 1]: 1 where the row uses the slot (the torch path's row selection)."""
        if self._mask is None:
            used = torch.arange(self.slots_used, device=self.slots.device)
            self._mask = (self.slots.unsqueeze(1) == used).to(self._dtype).unsqueeze(-1)
        return self._mask


class LoRALinear(nn.Module):
    """A projection (any module: dense, packed or quantized) plus its adapters' slots.

    With the CPU kernels each row adds only its own adapter (``lora.c``); otherwise torch computes
    every slot up to the highest one used for every row and masks the other slots' rows out."""

    def __init__(self, base: nn.Module, in_features: int, parts: list[tuple[str, int]], num_slots: int,
                 max_rank: int, rows: LoRARows, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.base, self.rows = base, rows
        # Rows of A and B per part: the max rank rounded up to lora.c's block of ranks (rows past
        # an adapter's rank stay zero).
        self.stride = -(-max_rank // RANK_BLOCK) * RANK_BLOCK
        self.parts = [name for name, _ in parts]
        bounds, start = [], 0
        for _, width in parts:
            bounds.append((start, start + width))
            start += width
        self.columns = torch.tensor(bounds, dtype=torch.long)
        self.width = len(parts) * self.stride  # rows of A (and of B) per slot
        self.a = torch.zeros(num_slots * self.width, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots * self.width, start, dtype=dtype, device=device)
        self.ranks = torch.zeros(num_slots, len(parts), dtype=torch.long)  # rows of each part in use
        self.kernels: CPUKernels | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        slots = self.rows.slots
        if slots is None:
            return out
        if self.kernels is not None and x.dim() == 2 and x.stride(-1) == 1 and out.is_contiguous():
            self.kernels.lora_add(x, out, slots, self.a, self.b, self.ranks, self.columns, self.stride)
            return out
        used = self.rows.slots_used * self.width
        xa = torch.nn.functional.linear(x, self.a[:used])
        xa = (xa.view(-1, self.rows.slots_used, self.width) * self.rows.mask).view(-1, used)
        return out.addmm_(xa, self.b[:used])

    def clear(self, slot: int) -> None:
        self.a[slot * self.width : (slot + 1) * self.width] = 0
        self.b[slot * self.width : (slot + 1) * self.width] = 0
        self.ranks[slot] = 0

    def write(self, slot: int, module: str, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        """Place one PEFT module's ``lora_A`` [r, in] and ``lora_B`` [out, r] in ``slot``."""
        part = self.parts.index(module)
        start = slot * self.width + part * self.stride
        rank = a.shape[0]
        first, last = self.columns[part].tolist()
        self.a[start : start + rank] = a
        self.b[start : start + rank, first:last] = b.t() * scaling
        self.ranks[slot, part] = rank


class ReadAdapter(Protocol):
    """An adapter's tensors as read from disk (``hybridlb.engine.lora.AdapterWeights``)."""

    lora: LoRARequest
    info: AdapterInfo
    tensors: dict[str, torch.Tensor]


class ModelAdapters:
    """The model's adapter slots: wraps its projections, and installs in a slot the tensors of an
    adapter already read (``hybridlb.engine.lora`` reads them, off the step)."""

    def __init__(self, model: nn.Module, spec: ModelSpec, num_slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, kernels: CPUKernels | None = None):
        """``dtype``: the activations' (the adapters run in it, whatever the weights are stored as);
        ``kernels``: the CPU kernels, when loaded."""
        self.dtype, self.device = dtype, device
        self.rows = LoRARows()
        self.held: list[LoRARequest | None] = [None] * num_slots
        self.layers: list[dict[str, LoRALinear]] = []  # per layer: PEFT module name -> its projection
        for index, layer in enumerate(model.layers):
            wrapped = {}
            owners = {"qkv": layer.self_attn, "o": layer.self_attn}
            if not spec.is_moe_layer(index):
                owners.update(gate_up=layer.mlp, down=layer.mlp)
            for attribute, owner in owners.items():
                modules = FUSED[attribute]
                parts = [(m, module_shape(spec, m)[1]) for m in modules]
                linear = LoRALinear(getattr(owner, attribute), module_shape(spec, modules[0])[0], parts, num_slots,
                                    max_rank, self.rows, self.dtype, self.device)
                linear.kernels = kernels
                setattr(owner, attribute, linear)
                wrapped.update(dict.fromkeys(modules, linear))
            self.layers.append(wrapped)

    def place(self, slots: dict[int, ReadAdapter]) -> None:
        """Make each slot hold its adapter (as the scheduler assigned them)."""
        for slot, adapter in slots.items():
            if self.held[slot] != adapter.lora:
                self._install(slot, adapter)

    def _install(self, slot: int, adapter: ReadAdapter) -> None:
        self.held[slot] = None
        for layer in self.layers:
            for linear in set(layer.values()):
                linear.clear(slot)
        for module in adapter.info.modules:
            a, b = (adapter.tensors[f"{module.prefix}.lora_{which}.weight"].to(self.dtype) for which in "AB")
            self.layers[module.layer][module.module].write(slot, module.module, a, b, module.scaling)
        self.held[slot] = adapter.lora
