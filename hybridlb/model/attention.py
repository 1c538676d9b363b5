"""Paged attention over a block-structured KV cache.

A step's tokens are laid out flat: first one token per decoding sequence (longest
context first), then each prefill chunk. With the C kernels (``hybridlb.kernels``) one call
reads each sequence's blocks in place (``PagedTable``) for the decodes and every prompt
chunk (on CPUs without AMX, at every prompt length measured, 32 to 2,048 tokens, it is
1.3-2x faster than torch's flash attention called per prompt). Where the CPU has AMX, torch's
flash attention is 2.2-2.9x faster than the kernel on fresh bfloat16 prompts, so those
(``PrefillChunk`` without context) run on it and the kernel takes the rest, in one call per
run of adjacent sequences (``PagedTable.row``). Without the kernels, decodes of similar context
length form a group that runs as one batched SDPA over its gathered, padded contexts,
and each prefill chunk runs on torch SDPA (a fresh prompt attends to itself with
``is_causal``, a later chunk to the cached context under an explicit mask).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from hybridlb.kernels import CPUKernels


@dataclass
class PrefillChunk:
    start: int  # first row of the chunk in the flat token batch
    end: int
    context_blocks: torch.Tensor | None  # block ids covering the whole context; None: fresh prompt
    mask: torch.Tensor | None  # [chunk, context] bool, True where a query may attend


@dataclass
class DecodeGroup:
    start: int  # rows [start, end) of the flat batch, one token each
    end: int
    blocks: torch.Tensor  # [(end - start) * max_blocks] block ids, each row padded to max_blocks
    mask: torch.Tensor  # [end - start, 1, 1, max_blocks * block_size] bool


@dataclass
class PagedTable:
    """Every sequence of the step for the C kernel: sequence s owns rows
    [query_start[s], query_start[s + 1]) of the flat batch, its last new tokens."""

    blocks: torch.Tensor  # [seqs, max_blocks] int32 block ids, each row padded
    query_start: torch.Tensor  # [seqs + 1] int64, from 0 at ``row``
    lengths: torch.Tensor  # [seqs] int64 context length including this step's tokens
    row: int = 0  # the flat batch's row of the first sequence's first token


@dataclass
class AttentionBatch:
    """Where this step's tokens live in the KV cache and what each attends to."""

    slot_mapping: torch.Tensor  # [N] cache slot (block * block_size + offset) of each new token
    decodes: list[DecodeGroup]  # the torch path's decode groups and prompt chunks
    prefills: list[PrefillChunk]  # (with the kernels: the fresh prompts torch's flash attention takes)
    tables: list[PagedTable] = field(default_factory=list)  # the kernel path: every other sequence


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        # Allocated by the model runner in the shapes ``cache_shapes`` gives.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.kernels: CPUKernels | None = None

    def cache_shapes(self, num_blocks: int, block_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Key and value cache shapes: [blocks, block_size, kv_heads, dim] each for torch; for
        the kernels keys [blocks, kv_heads, dim, block_size] and values [blocks, kv_heads,
        block_size, dim], in bfloat16 holding pairs side by side (see rope_store in
        kernels/csrc/kernels_body.h)."""
        heads, dim = self.num_kv_heads, self.head_dim
        if self.kernels is None:
            return (num_blocks, block_size, heads, dim), (num_blocks, block_size, heads, dim)
        return (num_blocks, heads, dim, block_size), (num_blocks, heads, block_size, dim)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """q [N, heads, dim], k/v [N, kv_heads, dim], already rotated and stored → [N, heads, dim]."""
        out = q.new_empty(q.shape)
        for table in batch.tables:
            self.kernels.paged_attention(q[table.row :], self.k_cache, self.v_cache, table.blocks, table.query_start,
                                         table.lengths, self.scale, out[table.row :])
        for group in batch.decodes:
            out[group.start : group.end] = self._decode(q[group.start : group.end], group)
        for chunk in batch.prefills:
            out[chunk.start : chunk.end] = self._prefill(q, k, v, chunk)
        return out

    def store(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        kv_shape = (-1, self.num_kv_heads, self.head_dim)
        self.k_cache.view(kv_shape).index_copy_(0, slots, k)
        self.v_cache.view(kv_shape).index_copy_(0, slots, v)

    def _gather(self, cache: torch.Tensor, blocks: torch.Tensor, rows: int) -> torch.Tensor:
        """Context of ``rows`` sequences as [rows, kv_heads, tokens, dim] (the torch path's layout)."""
        picked = cache.index_select(0, blocks)
        return picked.view(rows, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)

    def _decode(self, q: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
        rows = q.shape[0]
        keys = self._gather(self.k_cache, group.blocks, rows)
        values = self._gather(self.v_cache, group.blocks, rows)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=group.mask, scale=self.scale, enable_gqa=True
        )
        return out.squeeze(2)

    def _prefill(self, q, k, v, chunk: PrefillChunk) -> torch.Tensor:
        query = q[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
        if chunk.context_blocks is None:
            keys = k[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
            values = v[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(
                query, keys, values, is_causal=True, scale=self.scale, enable_gqa=True
            )
        else:
            keys = self._gather(self.k_cache, chunk.context_blocks, 1)
            values = self._gather(self.v_cache, chunk.context_blocks, 1)
            out = F.scaled_dot_product_attention(
                query, keys, values, attn_mask=chunk.mask, scale=self.scale, enable_gqa=True
            )
        return out[0].transpose(0, 1)
