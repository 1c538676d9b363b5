"""The decoder-only transformer shared by every supported architecture.

Llama, Qwen2, Qwen3, Qwen3-MoE and Mixtral differ only in details the ModelSpec
carries: q/k/v bias (Qwen2), per-head q/k RMSNorm (Qwen3), and which layers use a
routed MoE block instead of a dense MLP.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridlb.checkpoint.spec import ModelSpec
from hybridlb.cpu_features import has_onednn_bfloat16_packing
from hybridlb.kernels import CPUKernels
from hybridlb.model import memory
from hybridlb.model.attention import AttentionBatch, PagedAttention
from hybridlb.model.layers import DenseMLP, ExpertDispatch, MoEBlock, PackedLinear, RMSNorm, RotaryEmbedding
from hybridlb.model.quantized import GROUP_ROWS_MAX, Int8GroupLinear


class SelfAttention(nn.Module):
    def __init__(self, spec: ModelSpec, rotary: RotaryEmbedding):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv = nn.Linear(spec.hidden_size, sum(self.split), bias=spec.attention_bias)
        self.o = nn.Linear(q_size, spec.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.rotary = rotary
        self.attn = PagedAttention(self.heads, self.kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        q, k, v = self.qkv(x).split(self.split, dim=-1)
        q = q.view(-1, self.heads, self.head_dim)
        k = k.view(-1, self.kv_heads, self.head_dim)
        v = v.view(-1, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        kernels = self.attn.kernels
        if kernels is not None:  # rotate q and k in place and store k, v: one call
            rotary, attn = self.rotary, self.attn
            kernels.rope_store(q, k, v, positions, rotary.cos, rotary.sin, batch.slot_mapping,
                               attn.k_cache, attn.v_cache)
        else:
            q, k = self.rotary(positions, q, k)
            self.attn.store(k, v, batch.slot_mapping)
        out = self.attn(q, k, v, batch)
        return self.o(out.reshape(-1, self.heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int, rotary: RotaryEmbedding, expert_range: range | None,
                 dispatch: ExpertDispatch | None):
        super().__init__()
        self.input_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = SelfAttention(spec, rotary)
        self.post_attn_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        if spec.is_moe_layer(layer):
            self.mlp = MoEBlock(
                spec.hidden_size, spec.moe_intermediate_size, spec.num_experts,
                spec.num_experts_per_tok, spec.norm_topk_prob, expert_range, dispatch,
            )
        else:
            self.mlp = DenseMLP(spec.hidden_size, spec.intermediate_size)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                batch: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm block carrying the residual stream separately: each residual add is fused
        into the norm after it (the next layer's input norm adds this layer's MLP output)."""
        if residual is None:
            residual = x
            h = self.input_norm(x)
        else:
            h = self.input_norm(x, residual)
        h = self.self_attn(h, positions, batch)
        return self.mlp(self.post_attn_norm(h, residual)), residual


class CausalLM(nn.Module):
    """Token ids in, hidden states out; ``logits`` projects only the rows that sample."""

    def __init__(self, spec: ModelSpec, max_positions: int, expert_range: range | None = None,
                 dispatch: ExpertDispatch | None = None):
        """``expert_range``: the experts this rank holds; ``dispatch``: how their MoE layers reach the
        other ranks' (None: every expert is here)."""
        super().__init__()
        self.spec = spec
        rotary = RotaryEmbedding(spec.head_dim, max_positions, spec.rope)
        # With a weight given, nn.Embedding skips its random init: on the meta device (load_model) that
        # init runs torch's Python reference of normal_, which imports torch._dynamo and triton (~140 MiB
        # of every engine's memory, ~0.9 s of its start).
        self.embed = nn.Embedding(spec.vocab_size, spec.hidden_size,
                                  _weight=torch.empty(spec.vocab_size, spec.hidden_size))
        self.layers = nn.ModuleList(
            DecoderLayer(spec, i, rotary, expert_range, dispatch) for i in range(spec.num_layers)
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding matrix with the output layer when the checkpoint ties them."""
        if self.spec.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        x, residual = self.embed(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, batch)
        return self.norm(x, residual)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits. On bf16.c they are its float32 sums: rounded to bfloat16 first (a step
        of 0.125 at SmolLM2's logit sizes) the top tokens of a prompt often tie."""
        head = self.lm_head
        if isinstance(head, Int8GroupLinear):  # a GGUF file's quantized output layer: its codes for few rows
            if head.dense is None or hidden.shape[0] <= GROUP_ROWS_MAX:
                return head(hidden)
            head = head.dense
        if isinstance(head, PackedLinear):
            return head(hidden, torch.float32)
        return head(hidden).float()

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.layers]

    def use_cpu_kernels(self, kernels: CPUKernels, pack_linears: bool) -> None:
        """Route the small per-token work through the C kernels; with ``pack_linears``
        (bfloat16 on CPU) hold every linear weight packed for its matmul (``PackedLinear``). A tied output
        projection is packed too, at the cost of a second copy of the embedding matrix
        (the lookup needs it dense): on SmolLM2-135M that is +56 MiB and 6 ms less per
        batch-16 decode step, as the unpacked matmul reorders 56 MiB on every call."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, DenseMLP, PagedAttention)):
                module.kernels = kernels
        if not pack_linears:
            return
        linears = [(module, name, child) for module in list(self.modules())
                   for name, child in module.named_children() if isinstance(child, nn.Linear)]
        # bf16.c's packed weights share one huge-page buffer (model/memory.py), filled as each
        # is packed and its checkpoint weight dropped, so memory peaks at one copy plus a layer.
        fast = [PackedLinear.runs_on_bf16_kernel(child.weight, kernels) for _, _, child in linears]
        if not has_onednn_bfloat16_packing():  # what bf16.c does not run stays a plain linear
            linears = [linear for linear, on_kernel in zip(linears, fast, strict=True) if on_kernel]
            fast = [True] * len(linears)
        sizes = [(child.weight.numel(),) for (_, _, child), on_kernel in zip(linears, fast, strict=True) if on_kernel]
        slots = iter(memory.empty(sizes, torch.bfloat16))
        linears.reverse()
        for on_kernel in fast:
            module, name, child = linears.pop()  # the list must not keep the replaced weights alive
            setattr(module, name, PackedLinear(child, kernels, into=next(slots) if on_kernel else None))
