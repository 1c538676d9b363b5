"""Speculative decoding by n-gram prompt lookup on the real SmolLM2-135M-Instruct: outputs are
exactly what they are without it (greedy and seeded sampling, float32, the file dequantized: kept
4-bit, each projection rounds its inputs to bfloat16, which turns the last-bit differences between a
decode step and a verify step's attention into logprob differences of ~1e-3), batched with requests
that draft nothing, through chunked prefill, preemption, a JSON schema and logprobs; unseeded
sampling keeps its distribution; and `hybridlb serve --speculative-config` serves the same text
through the openai SDK and counts drafts in vLLM's metrics."""

from __future__ import annotations

import json
from collections import Counter

import httpx
import openai
import pytest

from hybridlb import LLM, SamplingParams
from hybridlb.params import Constraint
from hybridlb.testing.servers import start_server
from tests.conftest import PROMPTS, SMOLLM2

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
TEXT = ("The committee met on Tuesday to review the budget. After a long discussion, it agreed to fund the new "
        "library, repair the bridge over the river, and hire two more teachers for the primary school.")
COPY_PROMPTS = [
    f"<|im_start|>user\nRepeat this text exactly: {TEXT}<|im_end|>\n<|im_start|>assistant\n",
    f"<|im_start|>user\nFix the spelling: {TEXT.replace('library', 'libary')}<|im_end|>\n<|im_start|>assistant\n",
]
JSON_PROMPT = (f"<|im_start|>user\nPut this text in a JSON object under the key \"text\": {TEXT}<|im_end|>\n"
               "<|im_start|>assistant\n")
GREEDY = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def base():
    return LLM(SMOLLM2, max_model_len=512, num_kv_blocks=128, dtype="float32", quantization="none")


@pytest.fixture(scope="module")
def spec():
    """Drafts as long as the config allows: how long they pay is the machine's own step-time curve
    (unit-tested in tests/unit/test_speculative.py); these tests are about what a draft must never change."""
    llm = LLM(SMOLLM2, max_model_len=512, num_kv_blocks=128, dtype="float32", quantization="none", speculative=SPEC)
    llm.engine.scheduler.proposer.cost.threshold = lambda batch: 0.0  # every row free
    return llm


def _tokens(outputs) -> list[list[int]]:
    return [o.token_ids for o in outputs]


def test_greedy_equals_no_speculation_alone_and_batched(base, spec):
    prompts = COPY_PROMPTS + PROMPTS[:3]  # copy-heavy ones, and ones whose drafts rarely hold
    expected = _tokens(base.generate(prompts, GREEDY))
    assert _tokens(spec.generate(prompts, GREEDY)) == expected
    stats = spec.engine.scheduler.spec_stats
    assert stats.accepted_tokens > 0
    steps = spec.engine.num_steps
    assert _tokens(spec.generate(COPY_PROMPTS[0], GREEDY)) == expected[:1]
    # One prefill step, then decode steps: fewer than one per token when drafts hold.
    assert spec.engine.num_steps - steps <= 0.7 * GREEDY.max_tokens, "the copy prompt's drafts did not hold"


def test_seeded_sampling_equals_no_speculation(base, spec):
    """A seeded request draws the same noise per output token with or without drafts."""
    params = [SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, seed=seed, ignore_eos=True, logprobs=2)
              for seed in range(6)]
    prompts = [COPY_PROMPTS[seed % 2] for seed in range(6)]
    before = spec.engine.scheduler.spec_stats.accepted_tokens
    expected, got = base.generate(prompts, params), spec.generate(prompts, params)
    assert _tokens(got) == _tokens(expected)
    assert spec.engine.scheduler.spec_stats.accepted_tokens > before
    for want, have in zip(expected, got, strict=True):
        for a, b in zip(want.logprobs, have.logprobs, strict=True):
            assert a.top_ids == b.top_ids and abs(a.logprob - b.logprob) < 1e-4


def test_composes_with_chunked_prefill_preemption_grammar_and_logprobs(base):
    """Small step budgets chunk the prompts and cut drafts short; a small KV cache preempts
    requests (their drafts' blocks included); a JSON-schema request's drafts pass its grammar."""
    schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    constrained = SamplingParams(max_tokens=120, temperature=0, constraint=Constraint("json", json.dumps(schema)))
    scored = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=3)
    prompts = [JSON_PROMPT, *COPY_PROMPTS, COPY_PROMPTS[0], PROMPTS[0]]
    params = [constrained, GREEDY, scored, GREEDY, GREEDY]
    expected = base.generate(prompts, params)
    json.loads(expected[0].text)
    tight = LLM(SMOLLM2, max_model_len=256, num_kv_blocks=24, max_num_batched_tokens=40, dtype="float32",
                quantization="none", speculative=SPEC)
    got = tight.generate(prompts, params)
    assert _tokens(got) == _tokens(expected)
    assert tight.engine.scheduler.num_preemptions > 0, "the cache was not tight enough to preempt"
    assert tight.engine.scheduler.spec_stats.accepted_tokens > 0
    for a, b in zip(expected[2].logprobs, got[2].logprobs, strict=True):
        assert a.top_ids == b.top_ids and abs(a.logprob - b.logprob) < 1e-4


def test_unseeded_sampling_keeps_its_distribution():
    """Many unseeded samples at temperature 0.7: at each position, every common token is as
    frequent as without speculation (within 4 standard errors), though with it many tokens came
    from drafts."""
    samples = 160
    params = SamplingParams(max_tokens=16, temperature=0.7, ignore_eos=True)
    counts = []
    for speculative in (None, SPEC):
        # auto: bfloat16 where the CPU multiplies it natively (AMX), float32 where it would be emulated.
        llm = LLM(SMOLLM2, max_model_len=256, num_kv_blocks=512, dtype="auto", max_num_seqs=samples,
                  seed=1 if speculative else 2, speculative=speculative)
        if speculative:  # drafts whatever the machine's step curve says they cost: this is about their effect
            llm.engine.scheduler.proposer.cost.threshold = lambda batch: 0.0
        # the prompt cached first, so the batch's prefills are hits (160 whole prefills cost most of the test)
        llm.generate([COPY_PROMPTS[0]], SamplingParams(max_tokens=1))
        outputs = llm.generate([COPY_PROMPTS[0]] * samples, params)
        counts.append([Counter(o.token_ids[i] for o in outputs) for i in range(params.max_tokens)])
        if speculative:
            assert llm.engine.scheduler.spec_stats.accepted_tokens > samples, "too few drafts held to test"
    compared = 0
    for position, (plain, drafted) in enumerate(zip(*counts, strict=True)):
        for token in plain | drafted:
            p = (plain[token] + drafted[token]) / (2 * samples)
            if p < 0.1:
                continue
            compared += 1
            error = 4 * (2 * p * (1 - p) / samples) ** 0.5
            assert abs(plain[token] - drafted[token]) / samples <= error, (
                f"position {position}: token {token} in {plain[token]} samples without drafts, {drafted[token]} "
                "with")
    assert compared >= params.max_tokens


def test_serve_speculative_config_through_the_sdk(smollm2_server):
    server = start_server(SMOLLM2, "--served-model-name", "smollm2", "--dtype", "float32", "--quantization", "none",
                          "--speculative-config", json.dumps(SPEC))  # smollm2_server's weights
    try:
        messages = [{"role": "user", "content": f"Repeat this text exactly: {TEXT}"}]
        texts = []
        for url in (smollm2_server.url, server.url):
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
            stream = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=48,
                                                    temperature=0, stream=True)
            texts.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
        assert texts[1] == texts[0] and "committee" in texts[0]
        metrics = httpx.get(f"{server.url}/metrics").text
        accepted = [line for line in metrics.splitlines()
                    if line.startswith("vllm:spec_decode_num_accepted_tokens_total{")]
        assert accepted and float(accepted[0].split()[-1]) > 0, metrics
        assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="smollm2",position="0"}' \
            in metrics
    finally:
        server.stop()
