"""The C kernels against the torch code they replace, in both dtypes they serve.

bfloat16 norms, RoPE and SiLU must round exactly where torch rounds (the kernels'
promise); attention is compared in float32 within accumulation-order tolerance.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridlb.model import kernels
from hybridlb.model.attention import AttentionBatch, DecodeGroup, DecodeTable, PagedAttention, PrefillChunk
from hybridlb.model.layers import RMSNorm, RotaryEmbedding, silu_and_mul

K = kernels.load()
pytestmark = pytest.mark.skipif(K is None, reason="no C compiler: the kernels could not be built")
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_torch_and_adds_the_residual(dtype):
    norm = RMSNorm(96, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    x, residual = torch.randn(5, 96, dtype=dtype), torch.randn(5, 96, dtype=dtype)
    expected_sum = x + residual
    expected = norm(expected_sum.clone())
    summed = residual.clone()
    got = K.rms_norm(x, norm.weight, 1e-5, summed)
    torch.testing.assert_close(summed, expected_sum, rtol=0, atol=0)
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-6 if dtype == torch.float32 else 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(dtype):
    gate_up = torch.randn(7, 2 * 80, dtype=dtype) * 4
    tolerance = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 0.008, "atol": 1e-5}
    torch.testing.assert_close(K.silu_mul(gate_up), silu_and_mul(gate_up), **tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_rotates_in_place_and_fills_the_cache(dtype):
    heads, kv_heads, dim, tokens = 4, 2, 32, 6
    rotary = RotaryEmbedding(dim, 128, {"rope_theta": 10000.0, "rope_type": "default"})
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype)
    q, k, v = (t.view(tokens, -1, dim) for t in qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), -1))
    positions = torch.tensor([0, 5, 17, 3, 99, 127])
    want_q, want_k = rotary(positions, q.clone(), k.clone())
    k_cache = torch.zeros(8, kv_heads, dim, 16, dtype=dtype)
    v_cache = torch.zeros(8, kv_heads, 16, dim, dtype=dtype)
    slots = torch.tensor([3, 40, 41, 100, 127, 0])
    K.rope_store(q, k, v, positions, rotary.cos, rotary.sin, slots, k_cache, v_cache)
    torch.testing.assert_close(q, want_q, rtol=0, atol=0)
    torch.testing.assert_close(k, want_k, rtol=0, atol=0)
    keys, values = standard_layout(k_cache, v_cache)
    torch.testing.assert_close(keys.view(-1, kv_heads, dim)[slots], want_k, rtol=0, atol=0)
    torch.testing.assert_close(values.view(-1, kv_heads, dim)[slots], v, rtol=0, atol=0)


def kernel_layout(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[blocks, block_size, kv_heads, dim] caches in the kernels' layout."""
    return keys.permute(0, 2, 3, 1).contiguous(), values.permute(0, 2, 1, 3).contiguous()


def standard_layout(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return keys.permute(0, 3, 1, 2).contiguous(), values.permute(0, 2, 1, 3).contiguous()


@pytest.mark.parametrize(("dim", "block"), [(64, 16), (128, 16), (48, 32)])
def test_decode_attention_matches_the_torch_path(dim, block):
    """Ragged contexts over shuffled blocks, GQA 3:1: the kernel against the SDPA groups."""
    heads, kv_heads, lengths = 6, 2, [1, 16, 17, 40, 63]
    attention = PagedAttention(heads, kv_heads, dim)
    attention.k_cache = torch.randn(24, block, kv_heads, dim)
    attention.v_cache = torch.randn(24, block, kv_heads, dim)
    k_cache, v_cache = kernel_layout(attention.k_cache, attention.v_cache)
    order = torch.randperm(24).tolist()
    tables, width = [], -(-max(lengths) // block)
    for length in lengths:
        used = [order.pop() for _ in range(-(-length // block))]
        tables.append(used + [0] * (width - len(used)))
    q = torch.randn(len(lengths), heads, dim)
    got = K.decode_attention(q, k_cache, v_cache, torch.tensor(tables, dtype=torch.int32),
                             torch.tensor(lengths), attention.scale)
    for row, length in enumerate(lengths):
        keys = torch.arange(width * block)
        mask = (keys < length).view(1, 1, 1, -1)
        group = DecodeGroup(0, 1, torch.tensor(tables[row]), mask)
        want = attention._decode(q[row : row + 1], group)
        torch.testing.assert_close(got[row : row + 1], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block", [16, 32])  # 32: as long as a head, so the layouts' shapes coincide
def test_paged_attention_splits_decodes_and_prefills(block):
    """A mixed step: the kernel covers the decode rows, SDPA the prompts after them, one
    fresh and one continuing over cached context (read back from the kernels' layout)."""
    standard = PagedAttention(4, 2, 32)
    standard.k_cache, standard.v_cache = torch.randn(4, block, 2, 32), torch.randn(4, block, 2, 32)
    attention = PagedAttention(4, 2, 32)
    attention.kernels = K
    attention.k_cache, attention.v_cache = kernel_layout(standard.k_cache, standard.v_cache)
    q, k, v = torch.randn(7, 4, 32), torch.randn(7, 2, 32), torch.randn(7, 2, 32)
    table = DecodeTable(torch.tensor([[0, 1], [2, 0]], dtype=torch.int32), torch.tensor([20, 7]))
    mask = torch.arange(2 * block).unsqueeze(0) <= torch.tensor([[20], [21]])
    later = PrefillChunk(5, 7, torch.tensor([3, 1]), mask)
    prefills = [PrefillChunk(2, 5, None, None), later]
    out = attention(q, k, v, AttentionBatch(torch.arange(7), [], prefills, table))
    decodes = K.decode_attention(q[:2], attention.k_cache, attention.v_cache, table.blocks, table.lengths,
                                 attention.scale)
    prompt = F.scaled_dot_product_attention(q[2:5].transpose(0, 1), k[2:5].transpose(0, 1), v[2:5].transpose(0, 1),
                                            is_causal=True, scale=attention.scale, enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(out[:2], decodes)
    torch.testing.assert_close(out[2:5], prompt)
    torch.testing.assert_close(out[5:], standard._prefill(q, k, v, later))


def test_a_failing_compiler_is_reported_not_raised(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"compiling kernels\.c .* failed"):
        kernels._build()
    kernels.load.cache_clear()
    try:
        assert kernels.load() is None
    finally:
        monkeypatch.undo()
        kernels.load.cache_clear()
        assert kernels.load() is not None
