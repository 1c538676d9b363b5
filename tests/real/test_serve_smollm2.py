"""`hybridlb serve --model SmolLM2.gguf` through the openai SDK: completions and chat,
streamed and not, return transformers' greedy tokens and a correct answer."""

from __future__ import annotations

import httpx
import openai
import pytest

from hybridlb.api.status import describe
from tests.api.test_load import metric
from tests.conftest import PROMPTS, REAL_NEW_TOKENS, reference_greedy

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(smollm2_server):
    return openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="unused")


def _expected_text(smollm2_transformers, tokens: list[int]) -> str:
    return smollm2_transformers[1].decode(tokens, skip_special_tokens=True)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_return_transformers_greedy_text(client, smollm2_transformers, smollm2_reference, stream):
    for prompt in PROMPTS[:4]:
        args = dict(model="smollm2", prompt=prompt, max_tokens=REAL_NEW_TOKENS, temperature=0,
                    extra_body={"ignore_eos": True})
        if stream:
            text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **args) if c.choices)
        else:
            out = client.completions.create(**args)
            assert out.usage.completion_tokens == REAL_NEW_TOKENS
            text = out.choices[0].text
        assert text == _expected_text(smollm2_transformers, smollm2_reference[prompt])


def test_a_batch_of_token_prompts_returns_each_prompts_tokens(client, smollm2_transformers, smollm2_reference):
    tokenizer = smollm2_transformers[1]
    out = client.completions.create(model="smollm2", prompt=[tokenizer.encode(p) for p in PROMPTS],
                                    max_tokens=REAL_NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    texts = [choice.text for choice in sorted(out.choices, key=lambda c: c.index)]
    assert texts == [_expected_text(smollm2_transformers, smollm2_reference[p]) for p in PROMPTS]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_transformers_and_names_paris(client, smollm2_transformers, stream):
    model, tokenizer = smollm2_transformers
    ids = tokenizer.apply_chat_template(CAPITAL, add_generation_prompt=True, tokenize=True, return_dict=False)
    expected = reference_greedy(model, [list(ids)], REAL_NEW_TOKENS)[0]
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    expected_text = tokenizer.decode(expected[: expected.index(eos)] if eos in expected else expected)
    args = dict(model="smollm2", messages=CAPITAL, max_tokens=REAL_NEW_TOKENS, temperature=0)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **args))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        out = client.chat.completions.create(**args)
        text, finish = out.choices[0].message.content, [out.choices[0].finish_reason]
    assert text == expected_text
    assert "Paris" in text and finish == ["stop"]


def test_each_engine_reports_its_resident_memory(client, smollm2_server):
    """/ranks, /metrics and `hybridlb status` show what the engine process holds: at least the
    float32 weights (135M parameters, 540 MB) and at most a few times them."""
    client.completions.create(model="smollm2", prompt="Hello", max_tokens=2)  # stats ride along with a step
    engine = httpx.get(f"{smollm2_server.url}/ranks").json()["engines"][0]
    assert 500 < engine["rss_mib"] < 3000, engine
    assert 500 * 2**20 < metric(smollm2_server.url, "hybridlb:engine_resident_memory_bytes") < 3000 * 2**20
    table, _ = describe(smollm2_server.url)
    assert table.splitlines()[1].split()[-1] == "MiB" and int(table.splitlines()[2].split()[-1]) > 500
