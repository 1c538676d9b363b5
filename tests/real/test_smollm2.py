"""A real checkpoint, SmolLM2-135M-Instruct, loaded from its GGUF file and from the Hugging Face
directory transformers 5 saves (tied embeddings, chat_template.jinja): greedy tokens, the
tokenizer and the chat template all equal transformers'. Compared with transformers, which
dequantizes the file, the engine does too (``quantization="none"``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from hybridlb import LLM, SamplingParams
from hybridlb.checkpoint.tokenizer import Tokenizer
from tests.conftest import PROMPTS, REAL_NEW_TOKENS, SMOLLM2, reference_greedy

GREEDY = SamplingParams(max_tokens=REAL_NEW_TOKENS, temperature=0, ignore_eos=True)
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Colour of the sky?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke about GPUs, café owners and 中文."}],
]


@pytest.fixture(scope="module", params=["gguf", "hf-dir"])
def real_model(request, smollm2_hf_dir) -> str:
    return SMOLLM2 if request.param == "gguf" else smollm2_hf_dir


def test_greedy_tokens_equal_transformers_alone_and_batched(real_model, smollm2_reference):
    llm = LLM(real_model, max_model_len=512, num_kv_blocks=256, dtype="float32", quantization="none")
    batched = llm.generate(PROMPTS, GREEDY)
    expected = [smollm2_reference[p] for p in PROMPTS]
    assert sum(len(set(tokens)) for tokens in expected) / len(expected) >= 5, "the reference is degenerate"
    assert [r.token_ids for r in batched] == expected
    alone = [llm.generate(prompt, GREEDY)[0].token_ids for prompt in PROMPTS]
    assert alone == expected


def test_long_prompts_whole_and_chunked_equal_transformers(smollm2_transformers):
    """Past the CPU kernels' short-prompt limit a fresh prompt attends on torch SDPA; chunked,
    each later chunk reads its cached context through the kernel. Both keep the greedy tokens,
    and so does a batch mixing those chunks with short prompts and decodes."""
    model, tokenizer = smollm2_transformers
    prompts = [tokenizer.encode(PROMPTS[1] * 3), tokenizer.encode(PROMPTS[6] * 8), tokenizer.encode(PROMPTS[0])]
    assert len(prompts[0]) > 96 and len(prompts[1]) > 96
    expected = reference_greedy(model, prompts, 16)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    for budget in (2048, 40):  # whole prompts; 40-token chunks (a later chunk shares its step with decodes)
        llm = LLM(SMOLLM2, max_model_len=512, num_kv_blocks=64, dtype="float32", max_num_batched_tokens=budget,
                  quantization="none")
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected, f"budget {budget}"


def test_logprobs_equal_transformers_log_softmax(smollm2_transformers):
    """Sampled-token, top-k and prompt log-probabilities (float32) are transformers' log_softmax
    of the same logits within 1e-4, whether the prompt is prefilled whole or in chunks."""
    import torch

    model, tokenizer = smollm2_transformers
    prompt = tokenizer.encode(PROMPTS[1])
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True, logprobs=5, prompt_logprobs=3)
    for budget in (2048, 16):
        llm = LLM(SMOLLM2, max_model_len=512, num_kv_blocks=64, dtype="float32", max_num_batched_tokens=budget,
                  quantization="none")
        out = llm.generate([prompt], params)[0]
        with torch.no_grad():
            expected = torch.log_softmax(model(torch.tensor([prompt + out.token_ids])).logits[0].float(), dim=-1)
        scored = [(len(prompt) - 1 + i, lp, 5) for i, lp in enumerate(out.logprobs)]
        scored += [(p - 1, lp, 3) for p, lp in enumerate(out.prompt_logprobs) if p > 0]
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        assert [lp.token_id for lp in out.logprobs] == out.token_ids
        assert [lp.token_id for lp in out.prompt_logprobs[1:]] == prompt[1:]
        for row, lp, k in scored:
            want = expected[row].topk(k)
            assert abs(lp.logprob - expected[row, lp.token_id].item()) < 1e-4, (budget, row)
            assert lp.top_ids == want.indices.tolist(), (budget, row)
            assert max(abs(a - b) for a, b in zip(lp.top_logprobs, want.values.tolist(), strict=True)) < 1e-4


def test_openai_penalties_and_logit_bias_follow_their_definition(smollm2_transformers):
    """presence / frequency penalties (over generated tokens) and logit_bias, greedy, against the
    same arithmetic on transformers' logits one token at a time; min_p=1 keeps only the top token."""
    from collections import Counter

    import torch

    model, tokenizer = smollm2_transformers
    prompt, biased = tokenizer.encode(PROMPTS[6]), tokenizer.encode(" the")[0]
    llm = LLM(SMOLLM2, max_model_len=512, num_kv_blocks=64, dtype="float32", quantization="none")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, presence_penalty=0.8,
                            frequency_penalty=0.6, logit_bias={biased: 6.0})
    got = llm.generate([prompt], params)[0].token_ids
    want: list[int] = []
    with torch.no_grad():
        for _ in range(12):
            logits = model(torch.tensor([prompt + want])).logits[0, -1].float()
            for token, count in Counter(want).items():
                logits[token] -= 0.8 + 0.6 * count
            logits[biased] += 6.0
            want.append(int(logits.argmax()))
    plain = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].token_ids
    assert got == want
    assert got != plain, "the penalties changed nothing"
    top_only = SamplingParams(max_tokens=12, temperature=1.0, min_p=1.0, seed=5, ignore_eos=True)
    assert llm.generate([prompt], top_only)[0].token_ids == plain


def test_tokenizer_and_chat_template_equal_transformers(real_model, smollm2_transformers):
    _, theirs = smollm2_transformers
    ours = Tokenizer(real_model)
    for text in [*PROMPTS, "<|im_start|>user\n  tabs\t\tand   spaces<|im_end|>\n", "1234567 ≤ π"]:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text), skip_special_tokens=True)
    for chat in CHATS:
        expected = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(chat) == expected
    assert ours.eos_token_ids == [theirs.convert_tokens_to_ids("<|im_end|>")]


def test_the_hf_directory_is_what_transformers_5_writes(smollm2_hf_dir):
    directory = Path(smollm2_hf_dir)
    config = json.loads((directory / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and "rope_parameters" in config and config["dtype"] == "float32"
    assert (directory / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((directory / "tokenizer_config.json").read_text())
    with safe_open(directory / "model.safetensors", framework="pt") as handle:
        assert "lm_head.weight" not in set(handle.keys())


def test_chat_answers_the_capital_of_france(smollm2_transformers):
    llm = LLM(SMOLLM2, max_model_len=512, num_kv_blocks=64)
    prompt = llm.tokenizer.apply_chat_template(CHATS[0])
    ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
    answer = llm.generate([ids], SamplingParams(max_tokens=32, temperature=0))[0]
    assert "Paris" in answer.text and answer.finish_reason == "stop"


def test_bfloat16_tokens_stay_in_transformers_bfloat16_top5(smollm2_transformers):
    """vLLM's rule for low-precision runs: until the first divergence from transformers' greedy
    token, every token we pick is in transformers' top 5 for the same context. With a long prompt
    too: on a CPU with AMX, prompts of 32 tokens and more attend on torch's flash attention."""
    import copy

    import torch

    reference = copy.deepcopy(smollm2_transformers[0]).to(torch.bfloat16)
    llm = LLM(SMOLLM2, max_model_len=512, num_kv_blocks=256, dtype="bfloat16", quantization="none")
    runner = llm.engine.runner
    assert runner.flash_prompts == (runner.kernels is not None and runner.kernels.tiles)
    for out in llm.generate([*PROMPTS, " ".join(PROMPTS)], GREEDY):
        start = len(out.prompt_token_ids)
        with torch.no_grad():
            logits = reference(torch.tensor([out.prompt_token_ids + out.token_ids])).logits[0, start - 1 : -1]
        top5, greedy = logits.topk(5).indices.tolist(), logits.argmax(-1).tolist()
        for position, token in enumerate(out.token_ids):
            assert token in top5[position], f"position {position}: {token} not in {top5[position]}"
            if token != greedy[position]:
                break


def _shared_prefix_prompts(tokenizer) -> list[list[int]]:
    system = tokenizer.encode("You are a careful assistant. " * 12 + PROMPTS[1])
    return [system + tokenizer.encode(question) for question in (PROMPTS[0], PROMPTS[3], PROMPTS[6], " Why?")]


@pytest.mark.parametrize("options", [
    dict(),  # whole prompts
    dict(max_num_batched_tokens=40),  # chunked prefill crossing the cached prefix's end
    dict(num_kv_blocks=12, max_model_len=192),  # a small pool: preemption and eviction
], ids=["whole", "chunked", "preempted"])
def test_prefix_caching_keeps_the_greedy_tokens(smollm2_transformers, options):
    """A shared system prompt, reused by later requests and by a batch at once: the tokens
    equal the uncached run's (float32), and the cache was really hit."""
    _, tokenizer = smollm2_transformers
    prompts = _shared_prefix_prompts(tokenizer)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    runs = {}
    for caching in (True, False):
        llm = LLM(SMOLLM2, **{"max_model_len": 512, "num_kv_blocks": 64, "dtype": "float32", **options},
                  prefix_caching=caching)
        first = llm.generate(prompts[:1], params)
        runs[caching] = [o.token_ids for o in first + llm.generate(prompts, params)]
        stats = llm.engine.stats()
        assert (stats.prefix_hits > 0) == caching
        if "num_kv_blocks" in options and caching:
            assert stats.num_preemptions > 0  # a preempted request came back through the cache
    assert runs[True] == runs[False]


def test_a_cached_512_token_prefix_computes_only_the_new_tokens(smollm2_transformers):
    import time

    _, tokenizer = smollm2_transformers
    prefix = tokenizer.encode(" ".join(PROMPTS * 12))[:512]
    llm = LLM(SMOLLM2, max_model_len=1024, num_kv_blocks=80, dtype="float32")
    one = SamplingParams(max_tokens=1, temperature=0)
    started = time.perf_counter()
    llm.generate([prefix + tokenizer.encode(" First question?")], one)
    cold = time.perf_counter() - started
    computed = []
    run = llm.engine.runner.run
    llm.engine.runner.run = lambda chunks: computed.extend(c.num_tokens for c in chunks) or run(chunks)
    question = tokenizer.encode(" Second question?")
    started = time.perf_counter()
    llm.generate([prefix + question], one)
    warm = time.perf_counter() - started
    assert computed == [len(question)]  # the 512 cached tokens were not computed again
    assert llm.engine.stats().prefix_hits == 512
    assert warm < cold / 3, (warm, cold)  # time to first token drops with the computed tokens
