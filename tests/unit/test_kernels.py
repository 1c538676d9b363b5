"""The C kernels against the torch code they replace, in both dtypes they serve.

bfloat16 norms, RoPE and SiLU must round exactly where torch rounds (the kernels'
promise); attention is compared in float32 within accumulation-order tolerance.
"""

from __future__ import annotations

import pytest
import torch

from hybridlb import kernels
from hybridlb.model.attention import AttentionBatch, DecodeGroup, PagedAttention, PagedTable, PrefillChunk
from hybridlb.model.layers import RMSNorm, RotaryEmbedding, silu_and_mul

K = kernels.load()
pytestmark = pytest.mark.skipif(K is None, reason="no C compiler: the kernels could not be built")
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(0)


# A few rows run on one thread; a prefill's many rows are split over torch's threads.
ROWS = [5, 300]


@pytest.mark.parametrize("hidden", [96, 100])  # 100: 16-lane vectors and a tail of 4
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_torch_and_adds_the_residual(dtype, rows, hidden):
    norm = RMSNorm(hidden, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    x, residual = torch.randn(rows, hidden, dtype=dtype), torch.randn(rows, hidden, dtype=dtype)
    expected_sum = x + residual
    expected = norm(expected_sum.clone())
    summed = residual.clone()
    got = K.rms_norm(x, norm.weight, 1e-5, summed)
    torch.testing.assert_close(summed, expected_sum, rtol=0, atol=0)
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-6 if dtype == torch.float32 else 0)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(dtype, rows):
    gate_up = torch.randn(rows, 2 * 80, dtype=dtype) * 4
    tolerance = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 0.008, "atol": 1e-5}
    torch.testing.assert_close(K.silu_mul(gate_up), silu_and_mul(gate_up), **tolerance)


@pytest.mark.parametrize("dim", [32, 40])  # 32: halves of 16-lane vectors; 40: the element loop
@pytest.mark.parametrize("tokens", [6, 120])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_rotates_in_place_and_fills_the_cache(dtype, tokens, dim):
    heads, kv_heads = 4, 2
    rotary = RotaryEmbedding(dim, 128, {"rope_theta": 10000.0, "rope_type": "default"})
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype)
    q, k, v = (t.view(tokens, -1, dim) for t in qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), -1))
    positions = torch.randint(0, 128, (tokens,))
    want_q, want_k = rotary(positions, q.clone(), k.clone())
    k_cache = torch.zeros(8, kv_heads, dim, 16, dtype=dtype)
    v_cache = torch.zeros(8, kv_heads, 16, dim, dtype=dtype)
    slots = torch.randperm(128)[:tokens]
    K.rope_store(q, k, v, positions, rotary.cos, rotary.sin, slots, k_cache, v_cache)
    torch.testing.assert_close(q, want_q, rtol=0, atol=0)
    torch.testing.assert_close(k, want_k, rtol=0, atol=0)
    keys, values = standard_layout(k_cache, v_cache)
    torch.testing.assert_close(keys.view(-1, kv_heads, dim)[slots], want_k, rtol=0, atol=0)
    torch.testing.assert_close(values.view(-1, kv_heads, dim)[slots], v, rtol=0, atol=0)


def kernel_layout(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[blocks, block_size, kv_heads, dim] caches in the kernels' layout (rope_store's):
    float32 keys [blocks, kv_heads, dim, block_size] and values [blocks, kv_heads, block_size,
    dim]; bfloat16 the same shapes holding pairs, keys [dim / 2][block_size][2] and values
    [block_size / 2][dim][2] per block and head."""
    blocks, block, heads, dim = keys.shape
    if keys.dtype != torch.bfloat16:
        return keys.permute(0, 2, 3, 1).contiguous(), values.permute(0, 2, 1, 3).contiguous()
    paired_keys = keys.view(blocks, block, heads, dim // 2, 2).permute(0, 2, 3, 1, 4)
    paired_values = values.view(blocks, block // 2, 2, heads, dim).permute(0, 3, 1, 4, 2)
    return (paired_keys.contiguous().view(blocks, heads, dim, block),
            paired_values.contiguous().view(blocks, heads, block, dim))


def standard_layout(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``kernel_layout``."""
    blocks, heads, dim, block = keys.shape
    if keys.dtype != torch.bfloat16:
        return keys.permute(0, 3, 1, 2).contiguous(), values.permute(0, 2, 1, 3).contiguous()
    keys = keys.view(blocks, heads, dim // 2, block, 2).permute(0, 3, 1, 2, 4)
    values = values.view(blocks, heads, block // 2, dim, 2).permute(0, 2, 4, 1, 3)
    return keys.contiguous().view(blocks, block, heads, dim), values.contiguous().view(blocks, block, heads, dim)


def mixed_step(heads: int, kv_heads: int, dim: int, block: int):
    """One step's attention inputs: decodes over ragged contexts, a fresh prompt, and a prompt
    chunk continuing a cached context, all over shuffled blocks of a standard-layout cache that
    already holds the step's keys and values. Returns (q, k, v, caches, torch-path batch, table)."""
    # (context before the step, tokens this step): 4 decodes, a 37-token prompt, 23 more after 41
    sequences = [(0, 1), (15, 1), (16, 1), (62, 1), (0, 37), (41, 23)]
    num_blocks = sum(-(-(cached + new) // block) for cached, new in sequences) + 3
    k_cache, v_cache = torch.randn(num_blocks, block, kv_heads, dim), torch.randn(num_blocks, block, kv_heads, dim)
    free = torch.randperm(num_blocks).tolist()
    rows = sum(new for _, new in sequences)
    q, k, v = torch.randn(rows, heads, dim), torch.randn(rows, kv_heads, dim), torch.randn(rows, kv_heads, dim)
    tables, slots, decodes, prefills, query_start = [], [], [], [], [0]
    for cached, new in sequences:
        length, row = cached + new, query_start[-1]
        table = [free.pop() for _ in range(-(-length // block))]
        tables.append(table)
        slots += [table[p // block] * block + p % block for p in range(cached, length)]
        context = torch.arange(len(table) * block)
        if new == 1:
            decodes.append(DecodeGroup(row, row + 1, torch.tensor(table), (context < length).view(1, 1, 1, -1)))
        else:
            mask = context.unsqueeze(0) <= torch.arange(cached, length).unsqueeze(1)
            prefills.append(PrefillChunk(row, row + new, torch.tensor(table) if cached else None, mask))
        query_start.append(row + new)
    kv_shape = (-1, kv_heads, dim)
    k_cache.view(kv_shape)[torch.tensor(slots)] = k
    v_cache.view(kv_shape)[torch.tensor(slots)] = v
    width = max(map(len, tables))
    table = PagedTable(torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
                       torch.tensor(query_start), torch.tensor([c + n for c, n in sequences]))
    return q, k, v, (k_cache, v_cache), AttentionBatch(torch.tensor(slots), decodes, prefills), table


# GQA 3:1 at a common head size; plain multi-head (16-row tiles); 16:1 (one-row tiles), blocks of 32
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block"), [(6, 2, 64, 16), (4, 4, 128, 16), (16, 1, 48, 32)])
@pytest.mark.parametrize("threads", [1, 2])
def test_paged_attention_matches_the_torch_path(heads, kv_heads, dim, block, threads):
    """The kernel's one call for a whole mixed step against the torch path's SDPA per group and chunk."""
    q, k, v, (k_cache, v_cache), batch, table = mixed_step(heads, kv_heads, dim, block)
    standard = PagedAttention(heads, kv_heads, dim)
    standard.k_cache, standard.v_cache = k_cache, v_cache
    want = standard(q, k, v, batch)
    fast = PagedAttention(heads, kv_heads, dim)
    fast.kernels = K
    fast.k_cache, fast.v_cache = kernel_layout(k_cache, v_cache)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = fast(q, k, v, AttentionBatch(batch.slot_mapping, [], [], [table]))
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fresh_prompts_on_flash_attention_and_the_rest_on_the_kernel_agree_with_the_torch_path():
    """The AMX path (model_runner's flash_prompts): the fresh 37-token prompt runs on torch's flash
    attention, and the kernel takes the decodes before it and the continuing chunk after it in
    two calls, each from its own first row."""
    q, k, v, (k_cache, v_cache), batch, table = mixed_step(6, 2, 64, 16)
    standard = PagedAttention(6, 2, 64)
    standard.k_cache, standard.v_cache = k_cache, v_cache
    want = standard(q, k, v, batch)
    (fresh,) = [chunk for chunk in batch.prefills if chunk.context_blocks is None]
    starts = table.query_start.tolist()
    runs = [PagedTable(table.blocks[:4], table.query_start[:5], table.lengths[:4], 0),
            PagedTable(table.blocks[5:], table.query_start[5:] - starts[5], table.lengths[5:], starts[5])]
    fast = PagedAttention(6, 2, 64)
    fast.kernels = K
    fast.k_cache, fast.v_cache = kernel_layout(k_cache, v_cache)
    got = fast(q, k, v, AttentionBatch(batch.slot_mapping, [], [fresh], runs))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_paged_attention_in_bfloat16_tracks_float32():
    q, _, _, (k_cache, v_cache), _, table = mixed_step(6, 2, 64, 16)
    want = K.paged_attention(q, *kernel_layout(k_cache, v_cache), table.blocks, table.query_start, table.lengths, 0.125)
    q, k_cache, v_cache = q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
    got = K.paged_attention(q, *kernel_layout(k_cache, v_cache), table.blocks, table.query_start, table.lengths, 0.125)
    torch.testing.assert_close(got.float(), want, rtol=0.02, atol=0.02)


INT8_MATMUL = pytest.mark.skipif(K is None or not K.int8_matmul_supported,
                                 reason="int8.c's matmul needs a CPU with AVX-512 VNNI")


@INT8_MATMUL
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k", [(64, 128), (48, 80)])
def test_int8_matmul_matches_the_dequantized_weight(dtype, threads, n, k, matmul_path):
    """Rows 1 to 9 (one to three passes over each group of panels), 16, 17, 33 (blocks of 16 rows
    and tails on tiles), 40 and 300 (split over threads), inputs that are a slice of a wider
    tensor, a bias, 4 or 3 panels (an odd one alone); against x @ (codes * scale)^T in float32. The
    kernel quantizes each input row to 16 bits (int8.c), an error of at most half a step, max|x| /
    65,534, per input; its bound on each output is that times the row's sum of |weights|. On tiles
    (k 128; 80 stays on vpdpbusd) the integer sums are vpdpbusd's: the outputs are identical."""
    from hybridlb.model.quantized import int8_rows

    codes, scale = int8_rows(torch.randn(n, k))
    packed = K.int8_pack(codes)
    assert torch.equal(K.int8_unpack(packed), codes)
    scale, bias = scale.to(dtype), torch.randn(n).to(dtype)
    dense = codes.float() * scale.float()[:, None]
    wide = torch.randn(300, k + 12).to(dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in [*range(1, 10), 16, 17, 33, 40, 300]:
            x = wide[:rows, 7 : 7 + k]  # rows k + 12 apart
            want = x.float() @ dense.T + bias.float()
            got = K.int8_matmul(x, packed, codes.sum(dim=1, dtype=torch.int32), scale, bias)
            assert got.dtype == dtype and got.shape == (rows, n)
            bound = x.float().abs().amax(dim=1, keepdim=True) / 65534 * dense.abs().sum(dim=1) + 1e-5
            if dtype == torch.bfloat16:
                bound = bound + want.abs() * 2**-8  # the output's rounding
            assert ((got.float() - want).abs() <= bound).all(), rows
            if matmul_path == "tiles":
                K.use_tiles(0)
                vnni = K.int8_matmul(x, packed, codes.sum(dim=1, dtype=torch.int32), scale, bias)
                K.use_tiles(1)
                assert torch.equal(got, vnni), rows
    finally:
        torch.set_num_threads(before)


@INT8_MATMUL
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n, k", [(64, 128), (48, 96)])
def test_int8_group_matmul_scales_each_group_of_32_inputs(threads, n, k):
    """GGUF Q8_0's grid (a scale per 32 inputs of a row, int8_groups) on int8.c: rows 1 to 7 (one and two
    rows per pass, 2 or 3 panels: an odd one alone) and 40 (split over threads), strided inputs; against
    x @ (codes * group scale)^T in float32, within the 16-bit input rounding's bound. Scales that differ
    by 1,000x between groups catch a sum scaled by the wrong group's scale."""
    from hybridlb.model.quantized import int8_groups

    weight = torch.randn(n, k) * torch.logspace(-3, 0, k // 32).repeat_interleave(32)
    codes, scale = int8_groups(weight)
    assert (scale == scale.half().float()).all()  # float16 scales, as Q8_0 stores them
    dense = (codes.float().reshape(n, -1, 32) * scale[..., None]).reshape(n, k)
    assert ((dense - weight).abs() <= scale.repeat_interleave(32, dim=1) / 2 + 1e-7).all()
    packed, group_scales = K.int8_pack(codes), K.int8_group_scales_pack(scale)
    wide = torch.randn(40, k + 12)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in [*range(1, 8), 40]:
            x = wide[:rows, 5 : 5 + k]
            want = x @ dense.T
            got = K.int8_group_matmul(x, packed, group_scales)
            assert got.dtype == torch.float32 and got.shape == (rows, n)
            bound = x.abs().amax(dim=1, keepdim=True) / 65534 * dense.abs().sum(dim=1) * 1.01 + 1e-6
            assert ((got - want).abs() <= bound).all(), rows
    finally:
        torch.set_num_threads(before)


INT4_MATMUL = pytest.mark.skipif(K is None or not K.int4_matmul_supported,
                                 reason="int4.c's matmul needs a CPU with AVX-512 BF16 and VNNI")


@INT4_MATMUL
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n, k", [(64, 128), (48, 96)])
def test_int4_matmul_matches_the_weight_its_codes_stand_for(threads, n, k, matmul_path):
    """GGUF Q4_1-style groups (float16 scale and low, codes 0..15) packed into int4.c's blocks and back
    unchanged; rows 1 to 9, 16, 17, 40 and 300, strided inputs, a bias, 4 or 3 panels (an odd one
    alone); against x @ (scale * code + low)^T in float32 (on tiles: the weights rounded once to
    bfloat16, as a dequantizing engine holds them), within the output's bfloat16 rounding and
    float32 summation; on vpdpbusd also the inputs' rounding to two int8 digits (each group of
    32 in steps of its max |x| / (127 * 254): at most half a step on each input)."""
    from hybridlb.model.quantized import int4_groups

    codes, scale, low = int4_groups(torch.randn(n, k))
    scale, low = scale.half().float(), low.half().float()
    blocks = K.int4_pack(codes, scale, low)
    back = K.int4_unpack(blocks)
    assert torch.equal(back[0], codes) and torch.equal(back[1], scale) and torch.equal(back[2], low)
    dense = (codes.float().reshape(n, k // 32, 32) * scale[..., None] + low[..., None]).reshape(n, k)
    bias = torch.randn(n).bfloat16()
    wide = torch.randn(300, k + 12).bfloat16()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        weight = dense.bfloat16().float() if matmul_path == "tiles" else dense
        for rows in [*range(1, 10), 16, 17, 40, 300]:
            x = wide[:rows, 5 : 5 + k]
            want = x.float() @ weight.T + bias.float()
            got = K.int4_matmul(x, blocks, bias)
            assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
            bound = want.abs() * 2**-8 + (x.float().abs() @ dense.abs().T) * 1e-5 + 1e-5
            if matmul_path != "tiles":
                half_step = x.float().abs().reshape(rows, k // 32, 32).amax(-1) / (254 * 254)  # [rows, groups]
                bound = bound + 1.01 * half_step @ dense.abs().reshape(n, k // 32, 32).sum(-1).T
            assert ((got.float() - want).abs() <= bound).all(), rows
    finally:
        torch.set_num_threads(before)


BF16_MATMUL = pytest.mark.skipif(K is None or not K.bf16_matmul_supported,
                                 reason="bf16.c's matmul needs a CPU with AVX-512 BF16")


TILES = K is not None and K.bf16_matmul_supported and K.use_tiles(1)
if K is not None:
    K.use_tiles(kernels.AMX_MIN_ROWS, kernels.INT4_AMX_MIN_ROWS)


@pytest.fixture(params=["vdpbf16ps", "tiles"])
def matmul_path(request):
    """The matmuls (bf16.c's, int4.c's, int8.c's) on their vector instructions at every row count,
    or on AMX tiles at every row count."""
    if request.param == "tiles" and not TILES:
        pytest.skip("the tiles need a CPU with AMX (Intel Sapphire Rapids or later) and Linux 5.16+")
    K.use_tiles(1 if request.param == "tiles" else 0)
    yield request.param
    K.use_tiles(kernels.AMX_MIN_ROWS, kernels.INT4_AMX_MIN_ROWS)


@BF16_MATMUL
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("k", [128, 80])
def test_bf16_matmul_matches_float32_up_to_the_outputs_rounding(threads, k, matmul_path):
    """No rows, every row count from 1 to 17 (one to three row groups over each panel group; one
    block of 16 rows and a tail on tiles), 32, 33, 40 and 64 rows (prefills: two blocks of 16
    at once, and a tail), 5 panels of 16 columns (a group of 4 and a group of 1, split unevenly
    over two threads), inputs that are a slice of a wider tensor, with and without a bias; an
    input width tiles take (128: 32-deep steps) and one they leave to vdpbf16ps (80). The
    products are exact and summed in float32, so each output is float32's x @ w^T + bias
    rounded once to bfloat16: within half a bfloat16 step (at most 2^-8 of it), plus float32's
    summation order."""
    weight, bias = torch.randn(80, k).bfloat16(), torch.randn(80).bfloat16()
    packed = K.bf16_pack(weight)
    wide = torch.randn(64, k + 12).bfloat16()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in [0, *range(1, 18), 32, 33, 40, 64]:  # 0: an expert-parallel dummy step
            x = wide[:rows, 7:k + 7]  # rows k + 12 apart
            for b in (bias, None):
                want = x.float() @ weight.float().T + (0 if b is None else b.float())
                got = K.bf16_matmul(x, packed, b, 80)
                assert got.dtype == torch.bfloat16 and got.shape == (rows, 80)
                summation = 1e-4 * (x.float().abs() @ weight.float().abs().T)
                bound = want.abs() * 2**-8 + summation
                assert ((got.float() - want).abs() <= bound).all(), f"{rows} rows, bias {b is not None}"
                # the logits' form: the same sums in float32, not rounded
                unrounded = K.bf16_matmul(x, packed, b, 80, torch.float32)
                assert unrounded.dtype == torch.float32 and unrounded.shape == (rows, 80)
                assert ((unrounded - want).abs() <= summation).all(), f"float32 out, {rows} rows"
                assert torch.equal(unrounded.bfloat16(), got)
    finally:
        torch.set_num_threads(before)


@BF16_MATMUL
def test_packed_linear_runs_on_the_bf16_kernel_and_agrees_with_torch():
    """A model's linear layers, packed for bf16.c, give F.linear's result up to one rounding of the
    output (any leading shape); a weight the kernel does not take (8 outputs) stays on oneDNN."""
    from torch import nn

    from hybridlb.model.layers import PackedLinear

    for outputs, on_kernel in ((96, True), (8, False)):
        linear = nn.Linear(64, outputs, bias=True).bfloat16()
        packed = PackedLinear(linear, K)
        assert (packed.kernels is not None) == on_kernel
        x = torch.randn(3, 5, 64).bfloat16()
        want = torch.nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float())
        got = packed(x)
        assert got.shape == (3, 5, outputs)
        torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=1e-2)
