"""`hybridlb serve --model SmolLM2.gguf` through the openai SDK: completions and chat,
streamed and not, return transformers' greedy tokens and a correct answer."""

from __future__ import annotations

import httpx
import openai
import pytest

from hybridlb.cli.server_status import server_status as describe
from tests.conftest import PROMPTS, REAL_NEW_TOKENS, reference_greedy
from tests.process.api.test_load import metric

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


def _log_softmax(model, ids: list[int]):
    import torch

    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_lm_eval_loglikelihood_request_gets_transformers_logprobs(smollm2_server, smollm2_transformers):
    """The body lm-evaluation-harness `local-completions` sends for every loglikelihood request,
    read the way it reads it: echo shows the prompt's log-probabilities, None first, then the one
    generated token; sum over the continuation equals transformers' within 1e-4 per token."""
    model, tokenizer = smollm2_transformers
    context, continuation = tokenizer.encode("The capital of France is"), tokenizer.encode(" Paris, a city")
    prompts = [context + continuation, tokenizer.encode(PROMPTS[1])]
    body = {"model": "smollm2", "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}
    out = httpx.post(f"{smollm2_server.url}/v1/completions", json=body, timeout=60).json()
    choices = sorted(out["choices"], key=lambda c: c["index"])
    for ids, choice in zip(prompts, choices, strict=True):
        logprobs = choice["logprobs"]
        assert len(logprobs["token_logprobs"]) == len(ids) + 1 and logprobs["token_logprobs"][0] is None
        assert logprobs["top_logprobs"][0] is None and all(len(t) >= 1 for t in logprobs["top_logprobs"][1:])
        expected = _log_softmax(model, ids)
        for position in range(1, len(ids)):
            assert abs(logprobs["token_logprobs"][position] - expected[position - 1, ids[position]].item()) < 1e-4
    ctxlen = len(context)
    logprobs = choices[0]["logprobs"]
    ours = sum(logprobs["token_logprobs"][ctxlen:-1])
    expected = _log_softmax(model, prompts[0])
    want = sum(expected[p - 1, prompts[0][p]].item() for p in range(ctxlen, len(prompts[0])))
    assert abs(ours - want) < 1e-3
    greedy = all(tok == max(top.values()) for tok, top in
                 zip(logprobs["token_logprobs"][ctxlen:-1], logprobs["top_logprobs"][ctxlen:-1], strict=True))
    assert greedy == all(expected[p - 1].argmax().item() == prompts[0][p] for p in range(ctxlen, len(prompts[0])))
    assert choices[0]["text"].startswith("The capital of France is Paris, a city")


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_are_the_sampled_tokens_and_their_alternatives(client, smollm2_transformers, stream):
    model, tokenizer = smollm2_transformers
    # 5 tokens: "The capital of France is", no end-of-turn token (whose text the content leaves out)
    args = dict(model="smollm2", messages=CAPITAL, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **args))
        content = [entry for c in chunks if c.choices and c.choices[0].logprobs
                   for entry in c.choices[0].logprobs.content]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content
    else:
        out = client.chat.completions.create(**args)
        content, text = out.choices[0].logprobs.content, out.choices[0].message.content
    assert "".join(entry.token for entry in content) == text and len(content) == 5
    prompt = list(tokenizer.apply_chat_template(CAPITAL, add_generation_prompt=True, tokenize=True, return_dict=False))
    ids = prompt + reference_greedy(model, [prompt], 5)[0]
    expected = _log_softmax(model, ids)
    for i, entry in enumerate(content):
        row = expected[len(prompt) - 1 + i]
        assert abs(entry.logprob - row.max().item()) < 1e-4  # greedy: the top token's
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)
        assert entry.top_logprobs[0].token == entry.token and entry.bytes == list(entry.token.encode())


@pytest.mark.parametrize(("path", "body", "param"), [
    ("completions", {"prompt": "Hi", "logprobs": 21}, "logprobs"),
    ("chat/completions", {"messages": CAPITAL, "top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"messages": CAPITAL, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
])
def test_out_of_range_logprobs_get_a_400_naming_the_field(smollm2_server, path, body, param):
    response = httpx.post(f"{smollm2_server.url}/v1/{path}", json={"model": "smollm2", **body}, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert param in (error.get("param") or "") + error["message"]


def test_tokenizer_endpoints_answer_as_lm_eval_reads_them(smollm2_server, smollm2_transformers):
    """What lm-evaluation-harness's remote tokenizer calls, against transformers' tokenizer."""
    url, tokenizer = smollm2_server.url, smollm2_transformers[1]
    info = httpx.get(f"{url}/tokenizer_info").json()
    assert info["eos_token"] == tokenizer.eos_token and "im_start" in info["chat_template"]
    plain = httpx.post(f"{url}/tokenize", json={"prompt": "test Zürich", "add_special_tokens": False}).json()
    assert plain["tokens"] == tokenizer.encode("test Zürich", add_special_tokens=False)
    assert plain["count"] == len(plain["tokens"]) and plain["max_model_len"] > 0
    chat = httpx.post(f"{url}/tokenize", json={"model": "smollm2", "messages": CAPITAL}).json()
    assert chat["tokens"] == list(tokenizer.apply_chat_template(CAPITAL, add_generation_prompt=True, tokenize=True,
                                                                return_dict=False))
    ids = tokenizer.encode(PROMPTS[4])
    assert httpx.post(f"{url}/detokenize", json={"tokens": ids}).json()["prompt"] == tokenizer.decode(ids)
    bad = httpx.post(f"{url}/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    neither = httpx.post(f"{url}/tokenize", json={"model": "smollm2"})
    assert neither.status_code == 400 and "prompt and messages" in neither.json()["error"]["message"]
    assert httpx.get(f"{url}/ping").status_code == 200
