"""Prefix caching in the engine: cached prompt prefixes are reused, never change the tokens,
and the cache gives its blocks back when the pool needs them."""

from __future__ import annotations

import pytest

from hybridlb import LLM, SamplingParams
from hybridlb.config import EngineConfig
from hybridlb.engine.block_manager import BlockManager, Removed, Stored
from hybridlb.engine.core import EngineCore
from hybridlb.engine.request import Request
from hybridlb.prefix_hash import block_hashes, hash_seed

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _request(request_id: str, tokens: list[int], params: SamplingParams = GREEDY) -> Request:
    return Request(request_id, tokens, params, 8, None)


# -- the block manager alone ---------------------------------------------------------
def test_hashes_chain_over_the_whole_prefix():
    seed = hash_seed("model")
    a = block_hashes(list(range(40)), 16, seed)
    assert len(a) == 2  # the last 8 tokens are no full block
    assert block_hashes(list(range(32)) + [7] * 8, 16, seed) == a
    changed_first = block_hashes([99, *list(range(1, 40))], 16, seed)
    assert changed_first[0] != a[0] and changed_first[1] != a[1]  # same second block, other parent
    assert block_hashes(list(range(40)), 16, hash_seed("other model")) != a


def _admit(blocks: BlockManager, request: Request) -> list[int]:
    hit = blocks.lookup(request)
    blocks.count_lookup(request, hit)
    blocks.allocate(request, request.num_tokens - len(hit) * blocks.block_size, hit)
    request.num_computed = request.num_tokens
    blocks.cache_computed(request)
    return hit


def test_a_repeated_prefix_reuses_its_blocks_and_leaves_a_token_to_compute():
    blocks = BlockManager(8, 4, seed=1)
    blocks.record_events = blocks.record_stored = True
    first = _request("a", list(range(10)))
    assert _admit(blocks, first) == []
    assert [type(e) for e in blocks.take_events()] == [Stored, Stored]  # two full blocks of 4
    again = _request("b", list(range(8)))  # exactly two blocks: the second is recomputed
    hit = blocks.lookup(again)
    assert hit == first.block_ids[:1]
    longer = _request("c", [*list(range(12)), 50])
    assert _admit(blocks, longer) == first.block_ids[:2]
    assert longer.block_ids[:2] == first.block_ids[:2]
    assert blocks.refs[first.block_ids[0]] == 2
    assert (blocks.queried_tokens, blocks.hit_tokens) == (10 + 13, 8)


def test_freed_blocks_stay_cached_until_evicted_tail_first():
    blocks = BlockManager(4, 4, seed=1)
    blocks.record_events = True
    first = _request("a", list(range(13)))  # 3 full blocks + 1 token: all 4 blocks
    _admit(blocks, first)
    head, middle, tail, partial = first.block_ids
    blocks.free(first)
    assert blocks.num_free == 4 and blocks.num_cached == 3
    blocks.take_events()
    other = _request("b", [500, 501])  # takes the uncached block first, then the tail
    blocks.allocate(other, 2)
    assert other.block_ids == [partial]
    blocks.allocate(other, 6)
    assert other.block_ids == [partial, tail]
    assert blocks.take_events() == [Removed(blocks_hash := first.block_hashes[2])]
    assert blocks_hash not in blocks.cached
    again = _request("c", list(range(13)))
    assert blocks.lookup(again) == [head, middle]  # the surviving prefix


def test_prompt_logprobs_requests_compute_their_whole_prompt():
    blocks = BlockManager(8, 4, seed=1)
    _admit(blocks, _request("a", list(range(10))))
    scored = _request("b", list(range(10)), SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert blocks.lookup(scored) == []


def test_caching_off_finds_nothing():
    blocks = BlockManager(8, 4, caching=False, seed=1)
    _admit(blocks, _request("a", list(range(10))))
    assert blocks.num_cached == 0 and blocks.lookup(_request("b", list(range(10)))) == []


# -- the engine: same tokens with and without the cache ------------------------------
def _run(core: EngineCore, waves: list[list[tuple[str, list[int]]]]) -> dict[str, list[int]]:
    """Add each wave's requests, step until they are done, then the next wave."""
    tokens: dict[str, list[int]] = {}
    for wave in waves:
        for request_id, prompt in wave:
            assert core.add_request(request_id, prompt, GREEDY) is None
            tokens[request_id] = []
        while core.has_work:
            for output in core.step():
                tokens[output.request_id] += output.new_token_ids
    return tokens


def _shared_prefix_waves(prefix_len: int) -> list[list[tuple[str, list[int]]]]:
    prefix = [(7 * i + 3) % 900 + 10 for i in range(prefix_len)]
    tails = [[11, 12, 13], [400 + i for i in range(21)], [5], list(range(100, 140))]
    return [
        [("w0", prefix + tails[0])],  # fills the cache
        [(f"w1-{i}", prefix + tail) for i, tail in enumerate(tails)],  # a shared-prefix batch
        [("w2", prefix + tails[3] + [1, 2])],  # a cached prefix longer than the first prompt's
    ]


@pytest.mark.parametrize("options", [
    dict(),  # whole prompts
    dict(max_num_batched_tokens=24),  # chunked prefill across the cached boundary
    dict(num_kv_blocks=18, max_model_len=136),  # a small pool: preemption and eviction
], ids=["whole", "chunked", "preempted"])
def test_greedy_tokens_equal_with_and_without_caching(tiny_qwen3, options):
    waves = _shared_prefix_waves(70)
    results, cores = [], []
    for caching in (True, False):
        config = dict(model=tiny_qwen3, max_model_len=256, num_kv_blocks=128, dtype="float32", block_size=8)
        core = EngineCore(EngineConfig(**{**config, **options, "prefix_caching": caching}))
        results.append(_run(core, waves))
        cores.append(core)
    assert results[0] == results[1]
    assert sum(len(set(t)) for t in results[0].values()) > len(results[0]), "degenerate output"
    cached, plain = cores[0].stats(), cores[1].stats()
    assert cached.prefix_hits > 0 and plain.prefix_hits == 0
    if "num_kv_blocks" in options:
        assert cached.num_preemptions > 0  # the case was exercised
    else:
        assert cached.prefix_hits >= 5 * 64  # five requests found the 70-token prefix's 8 blocks


def test_eviction_under_pressure_keeps_the_tokens(tiny_qwen3):
    """More distinct prompts than the pool can keep cached: old prefixes are evicted, a
    repeated one is recomputed where evicted and reused where not, tokens unchanged."""
    prompts = [[(31 * i + 17 * k) % 900 + 10 for k in range(60)] for i in range(6)]
    waves = [[(f"p{i}", p)] for i, p in enumerate(prompts)] + [[(f"again{i}", p)] for i, p in enumerate(prompts)]
    results = []
    for caching in (True, False):
        core = EngineCore(EngineConfig(model=tiny_qwen3, max_model_len=128, num_kv_blocks=24, dtype="float32",
                                       block_size=8, prefix_caching=caching))
        core.blocks.record_events = True
        results.append(_run(core, waves))
        if caching:
            evicted = [e for e in core.blocks.take_events() if isinstance(e, Removed)]
            assert evicted, "nothing was evicted: the case was not exercised"
            assert core.blocks.num_cached <= 24
    again = {k: v for k, v in results[0].items() if k.startswith("again")}
    assert again == {k: v for k, v in results[1].items() if k.startswith("again")}
    assert results[0] == results[1]


def test_cached_prefix_computes_only_the_new_tokens(tiny_qwen3):
    core = EngineCore(EngineConfig(model=tiny_qwen3, max_model_len=1024, num_kv_blocks=128, dtype="float32"))
    prefix = [(13 * i) % 900 + 10 for i in range(512)]
    _run(core, [[("first", [*prefix, 1, 2, 3])]])
    computed = []
    original = core.runner.run

    def counting(chunks):
        computed.extend(c.num_tokens for c in chunks)
        return original(chunks)

    core.runner.run = counting
    _run(core, [[("second", [*prefix, 4, 5, 6, 7])]])
    assert computed[0] == 4  # 512 cached tokens, then the 4 new ones
    assert core.stats().prefix_hits == 512


def test_offline_llm_reuses_a_prompt_across_calls(tiny_qwen3):
    llm = LLM(tiny_qwen3, max_model_len=256, num_kv_blocks=64, dtype="float32")
    prompt = list(range(10, 90))
    first = llm.generate([prompt], GREEDY)[0].token_ids
    assert llm.generate([prompt], GREEDY)[0].token_ids == first
    assert llm.engine.stats().prefix_hits == 64  # 4 of the 5 blocks (one token always recomputed)
