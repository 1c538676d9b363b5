"""Building blocks of the decoder: norm, rotary embedding, dense MLP and MoE block.

Projections are stored fused (gate+up in one weight, experts stacked in one tensor)
so a layer is a few large matmuls rather than many small ones; the loader fills them
from the checkpoint's separate tensors.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from hybridlb.kernels import CPUKernels, bf16_fits


class RMSNorm(nn.Module):
    """weight * x / rms(x); given ``residual``, first ``residual += x`` in place and normalise that
    (the pre-norm decoder's residual add, fused into the norm that follows it)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.kernels: CPUKernels | None = None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.kernels is not None and x.dim() == 2 and x.stride(-1) == 1:
            return self.kernels.rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = residual.add_(x)
        # Accumulate in float32 as the reference implementations do, whatever the dtype.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _inverse_frequencies(head_dim: int, rope: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies for the checkpoint's scaling type, and the factor that scales cos/sin.

    The formulas are transformers' (modeling_rope_utils), so greedy tokens match it.
    """
    base, kind = rope["rope_theta"], rope["rope_type"]
    if kind == "dynamic":  # NTK-aware: a larger base, evaluated at the longest sequence served
        original, factor = rope["original_max_position_embeddings"], rope["factor"]
        if max_positions > original:
            base = base * (factor * max_positions / original - (factor - 1)) ** (head_dim / (head_dim - 2))
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if "freq_factors" in rope:  # GGUF llama3 files carry the divisors precomputed
        inv_freq = inv_freq / torch.tensor(rope["freq_factors"], dtype=torch.float32)
    if kind == "linear":
        return inv_freq / rope["factor"], 1.0
    if kind == "llama3":
        return _llama3_scaled(inv_freq, rope), 1.0
    if kind == "yarn":
        return _yarn_scaled(inv_freq, head_dim, rope)
    return inv_freq, 1.0


def _llama3_scaled(inv_freq: torch.Tensor, rope: dict) -> torch.Tensor:
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    in_between = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(in_between, blended, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_scaled(inv_freq: torch.Tensor, head_dim: int, rope: dict) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, keep high ones, ramp between; scale attention."""
    base, factor = rope["rope_theta"], rope["factor"]
    original = rope["original_max_position_embeddings"]
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.get("beta_fast") or 32), correction_dim(rope.get("beta_slow") or 1)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide by factor)
    return inv_freq / factor * (1 - keep) + inv_freq * keep, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a precomputed cos/sin table indexed by position."""

    def __init__(self, head_dim: int, max_positions: int, rope: dict):
        super().__init__()
        self.head_dim, self.max_positions, self.rope = head_dim, max_positions, rope
        self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)
        if self.cos.device.type != "meta":
            self.reset()

    def reset(self) -> None:
        """(Re)compute the tables in float32 on the buffers' device."""
        inv_freq, scale = _inverse_frequencies(self.head_dim, self.rope, self.max_positions)
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32), inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)
        self.cos = (angles.cos() * scale).to(self.cos.device)
        self.sin = (angles.sin() * scale).to(self.sin.device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)
        self.kernels: CPUKernels | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        if self.kernels is not None and gate_up.dim() == 2:
            return self.down(self.kernels.silu_mul(gate_up))
        return self.down(silu_and_mul(gate_up))


class PackedLinear(nn.Module):
    """A CPU bfloat16 linear layer whose weight was reordered once, at load, into the layout
    its matmul reads (the weight is then held only in that form):

    * with the engine's kernels on a CPU with AVX-512 BF16, bf16.c's (``kernels.bf16_pack``):
      at every batch size at least as fast as oneDNN, and at batch 1-16 1.2-1.7x faster,
      streaming the weights near the memory's read bandwidth;
    * otherwise oneDNN's blocked layout: results identical to ``F.linear``, and small-batch
      matmuls up to 2x faster than ``F.linear``, which reorders the weight on every call.
    """

    def __init__(self, linear: nn.Linear, kernels: CPUKernels | None = None, batch_hint: int = 64,
                 into: torch.Tensor | None = None):
        """``into``: where bf16.c's packed weight goes ([out * in] bfloat16, e.g. a slice of one
        huge-page buffer for the whole model, see ``CausalLM.use_cpu_kernels``)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.kernels = None
        if self.runs_on_bf16_kernel(weight, kernels):
            self.kernels = kernels
            self.packed = kernels.bf16_pack(weight, into)
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        self.bias = linear.bias

    @staticmethod
    def runs_on_bf16_kernel(weight: torch.Tensor, kernels: CPUKernels | None) -> bool:
        return kernels is not None and kernels.bf16_matmul_supported and bf16_fits(weight)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``out_dtype`` float32: bf16.c's sums unrounded (the logits); oneDNN's are rounded first."""
        if self.kernels is not None:  # 2-D input with contiguous rows as it is (rows may be strided)
            flat = x if x.dim() == 2 and x.stride(-1) == 1 else x.reshape(-1, self.in_features).contiguous()
            out = self.kernels.bf16_matmul(flat, self.packed, self.bias, self.out_features, out_dtype or x.dtype)
            return out.view(*x.shape[:-1], self.out_features)
        out = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return out if out_dtype is None else out.to(out_dtype)


class ExpertDispatch(Protocol):
    """Runs a MoE block whose experts are sharded over the data-parallel ranks on every rank's
    tokens (``hybridlb.engine.expert_parallel.ExpertParallel``): it calls the block's
    ``route`` and ``run_experts`` on the gathered tokens and returns this rank's rows."""

    def dispatch_combine(self, block: MoEBlock, x: torch.Tensor) -> torch.Tensor: ...


class MoEBlock(nn.Module):
    """Top-k routed experts; holds the experts ``expert_range`` of all ``num_experts``.

    Routing follows both supported families: softmax over all experts in float32,
    top-k, then renormalise the k weights when ``norm_topk_prob`` (always for Mixtral).
    """

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool, expert_range: range | None = None, dispatch: ExpertDispatch | None = None):
        super().__init__()
        self.expert_range = expert_range or range(num_experts)
        local = len(self.expert_range)
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.w_gate_up = nn.Parameter(torch.empty(local, 2 * intermediate, hidden))
        self.w_down = nn.Parameter(torch.empty(local, hidden, intermediate))
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.dispatch = dispatch  # experts sharded over the data-parallel ranks: who runs every rank's tokens

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ids [T, k] and their weights [T, k] (in x's dtype) for each token."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dispatch is not None:
            return self.dispatch.dispatch_combine(self, x)
        experts, weights = self.route(x)
        return self.run_experts(x, experts, weights)

    def run_experts(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Sum of weight * expert(x) over the local experts each token was routed to."""
        out = torch.zeros_like(x)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token_of = order // self.top_k
        flat_weights = weights.flatten()
        start = sum(counts[: self.expert_range.start])
        for local, expert in enumerate(self.expert_range):
            count = counts[expert]
            if count == 0:
                continue
            picked = order[start : start + count]
            rows = token_of[start : start + count]
            hidden = silu_and_mul(x[rows] @ self.w_gate_up[local].T) @ self.w_down[local].T
            out.index_add_(0, rows, hidden * flat_weights[picked].unsqueeze(-1))
            start += count
        return out
