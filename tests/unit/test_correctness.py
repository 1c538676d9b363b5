"""Greedy tokens of our engine equal transformers', alone and batched, per architecture."""

from __future__ import annotations

import pytest

from hybridlb import LLM, SamplingParams
from tests.conftest import PROMPTS, hf_greedy

MAX_NEW = 16
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)


def _assert_non_degenerate(reference: list[list[int]]) -> None:
    # A degenerate random model repeats one token whatever the prompt; matching it proves nothing.
    distinct = [len(set(tokens)) for tokens in reference]
    assert sum(distinct) / len(distinct) >= 5, f"reference output is degenerate: {distinct}"
    assert len({tuple(tokens) for tokens in reference}) == len(reference), "outputs ignore the prompt"


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "llama", "mixtral", "qwen2"])
def test_greedy_matches_transformers_alone_and_batched(checkpoints, arch):
    model = checkpoints(arch)
    llm = LLM(model, max_model_len=256, num_kv_blocks=128, dtype="float32")
    batched = llm.generate(PROMPTS, GREEDY)
    reference = hf_greedy(model, [r.prompt_token_ids for r in batched], MAX_NEW)
    _assert_non_degenerate(reference)
    assert [r.token_ids for r in batched] == reference
    alone = [llm.generate(prompt, GREEDY)[0].token_ids for prompt in PROMPTS]
    assert alone == reference


def test_chunked_prefill_and_preemption_keep_greedy_tokens(checkpoints):
    model = checkpoints("qwen3_moe")
    reference = LLM(model, max_model_len=256, num_kv_blocks=128, dtype="float32").generate(PROMPTS, GREEDY)
    # 24 blocks of 4 tokens hold one longest sequence, not all eight; a 16-token budget chunks prompts.
    tight = LLM(model, max_model_len=96, num_kv_blocks=24, block_size=4, max_num_batched_tokens=16,
                dtype="float32")
    outputs = tight.generate(PROMPTS, GREEDY)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
    assert tight.engine.blocks.num_free == tight.engine.blocks.num_blocks


def test_sharded_checkpoint_gives_same_tokens(tmp_path, checkpoints):
    from hybridlb.model.make_model import make_model

    sharded = make_model("qwen3", "tiny", tmp_path / "sharded", seed=1, max_shard_mb=0.2)
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    single = LLM(checkpoints("qwen3"), max_model_len=256, num_kv_blocks=64,
                 dtype="float32").generate(PROMPTS[:3], GREEDY)
    split = LLM(str(sharded), max_model_len=256, num_kv_blocks=64, dtype="float32").generate(PROMPTS[:3], GREEDY)
    assert [o.token_ids for o in split] == [o.token_ids for o in single]


def test_repetition_penalty_matches_transformers(checkpoints):
    import torch
    from transformers import AutoModelForCausalLM

    model = checkpoints("llama")
    llm = LLM(model, max_model_len=256, num_kv_blocks=64, dtype="float32")
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, repetition_penalty=1.5)
    ours = llm.generate(PROMPTS[:4], params)
    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    for out in ours:
        expected = reference.generate(torch.tensor([out.prompt_token_ids]), max_new_tokens=MAX_NEW, do_sample=False,
                                      repetition_penalty=1.5, eos_token_id=None, pad_token_id=0)
        assert out.token_ids == expected[0, len(out.prompt_token_ids):].tolist()
    plain = llm.generate(PROMPTS[:4], GREEDY)
    assert [o.token_ids for o in ours] != [p.token_ids for p in plain]  # the penalty changed something
