"""EngineCore behaviour: batching limits, abort, stop conditions, sampling params."""

from __future__ import annotations

import pytest

from hybridlb import LLM, SamplingParams
from hybridlb.config import EngineConfig
from hybridlb.engine.core import EngineCore
from tests.conftest import PROMPTS


@pytest.fixture(scope="module")
def llm(tiny_qwen3) -> LLM:
    return LLM(tiny_qwen3, max_model_len=256, num_kv_blocks=128, dtype="float32")


def _core(model: str, **options) -> EngineCore:
    return EngineCore(EngineConfig(model=model, max_model_len=256, num_kv_blocks=64, **{"dtype": "float32", **options}))


def test_abort_returns_every_block(tiny_qwen3, llm):
    core = _core(tiny_qwen3)
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        core.add_request(str(i), llm.tokenizer.encode(prompt), params)
    for _ in range(5):
        core.step()
    assert core.blocks.num_free < core.blocks.num_blocks
    outputs = core.abort([str(i) for i in range(len(PROMPTS))] + ["unknown"])
    assert {o.request_id for o in outputs} == {str(i) for i in range(len(PROMPTS))}
    assert all(o.finish_reason == "abort" for o in outputs)
    assert core.blocks.num_free == core.blocks.num_blocks
    assert not core.has_work


def test_batch_size_and_token_budget_are_respected(tiny_qwen3, llm):
    core = _core(tiny_qwen3, max_num_seqs=3, max_num_batched_tokens=20)
    for i, prompt in enumerate(PROMPTS):
        core.add_request(str(i), llm.tokenizer.encode(prompt), SamplingParams(max_tokens=4, temperature=0))
    finished = set()
    while core.has_work:
        chunks = core.scheduler.schedule()
        assert len(core.scheduler.running) <= 3
        assert sum(c.num_tokens for c in chunks) <= 20
        tokens = core.runner.run(chunks)
        finished |= {o.request_id for o in core._postprocess(chunks, tokens) if o.finish_reason}
    assert finished == {str(i) for i in range(len(PROMPTS))}


def test_invalid_requests_get_an_error_output(tiny_qwen3):
    core = _core(tiny_qwen3)
    assert "max_model_len is 256" in core.add_request("a", [5] * 300, SamplingParams()).error
    assert "empty" in core.add_request("b", [], SamplingParams()).error
    assert "[0, 1024)" in core.add_request("c", [99999], SamplingParams()).error
    assert "top_p" in core.add_request("d", [5], SamplingParams(top_p=0)).error
    assert core.add_request("e", [5], SamplingParams()) is None
    assert "already in use" in core.add_request("e", [5], SamplingParams()).error


def test_max_tokens_and_model_length_finish_with_length(llm):
    out = llm.generate("GPU", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    prompt = list(range(10, 250))
    out = llm.generate([prompt], SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))[0]
    assert len(prompt) + len(out.token_ids) == 256 and out.finish_reason == "length"


def test_stop_token_ids_and_eos(llm):
    free = llm.generate("GPU", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    stop_at = free.token_ids[5]
    first = free.token_ids.index(stop_at)
    out = llm.generate("GPU", SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_at]))[0]
    assert out.token_ids == free.token_ids[: first + 1] and out.finish_reason == "stop"
    # A sampled run long enough to hit an eos token stops there unless ignore_eos.
    eos = set(llm.tokenizer.eos_token_ids)
    long = SamplingParams(max_tokens=200, temperature=1.5, seed=7)
    outputs = llm.generate(PROMPTS, long)
    stopped = [o for o in outputs if o.finish_reason == "stop"]
    assert stopped, "the seeded run is expected to sample an eos token"
    assert all(o.token_ids[-1] in eos for o in stopped)
    assert all(not eos & set(o.token_ids[:-1]) for o in outputs)


def test_stop_strings_cut_the_text(llm):
    free = llm.generate("The alarm", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    stop = free.text[6:9]
    assert stop and stop not in free.text[:6]
    out = llm.generate("The alarm", SamplingParams(max_tokens=20, temperature=0, stop=[stop]))[0]
    assert out.text == free.text[: free.text.index(stop)]
    assert out.finish_reason == "stop"


def test_seeded_sampling_is_reproducible_alone_or_batched(llm):
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], seeded)[0].token_ids
    batched = llm.generate(PROMPTS, [seeded] + [SamplingParams(max_tokens=12, temperature=0.8)] * 7)[0]
    assert batched.token_ids == alone
    other_seed = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=99, ignore_eos=True)
    assert llm.generate(PROMPTS[0], other_seed)[0].token_ids != alone


def test_top_k_one_and_tiny_top_p_are_greedy(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    top_k = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=5.0, top_k=1, ignore_eos=True))
    top_p = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=1.0, top_p=1e-6, ignore_eos=True))
    assert [o.token_ids for o in top_k] == [o.token_ids for o in greedy]
    assert [o.token_ids for o in top_p] == [o.token_ids for o in greedy]


def test_the_kernels_tables_cover_runs_of_adjacent_rows_around_the_flash_prompts():
    """model_runner with the kernels on AMX: fresh prompts leave the kernel's table, so the
    sequences around them form one table per run of adjacent rows, each from its first row."""
    from types import SimpleNamespace

    from hybridlb.engine.model_runner import _adjacent_runs

    decode, cached, after = (SimpleNamespace(num_tokens=n) for n in (1, 23, 5))
    # rows 0-1 two decodes, rows 2-38 a fresh prompt (flash), 39-61 a cached chunk, 62-66 another
    runs = _adjacent_runs([(0, decode), (1, decode), (39, cached), (62, after)])
    assert [[row for row, _ in run] for run in runs] == [[0, 1], [39, 62]]
    assert _adjacent_runs([]) == []
