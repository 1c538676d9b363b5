"""The official openai SDK, sync and async, against a running `hybridlb serve`."""

from __future__ import annotations

import asyncio

import openai
import pytest

from hybridlb import LLM, SamplingParams


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


@pytest.fixture(scope="module")
def reference(tiny_qwen3):
    llm = LLM(tiny_qwen3, max_model_len=512, num_kv_blocks=64, dtype="float32")
    return llm.generate("The weather today", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]


def test_models_lists_the_served_name(client, server):
    assert [m.id for m in client.models.list().data] == [server.model]


def test_completion_matches_the_offline_engine(client, server, reference):
    out = client.completions.create(model=server.model, prompt="The weather today", max_tokens=20,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].text == reference.text
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 20
    assert out.usage.prompt_tokens == len(reference.prompt_token_ids)


def test_streamed_completion_equals_non_streamed(client, server):
    args = dict(model=server.model, prompt="Zürich café 中文 🚀", max_tokens=24, temperature=0,
                extra_body={"ignore_eos": True})
    whole = client.completions.create(**args).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == whole
    assert [c.choices[0].finish_reason for c in text_chunks].count("length") == 1
    assert chunks[-1].usage.completion_tokens == 24 and not chunks[-1].choices


def test_chat_streamed_equals_non_streamed(client, server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about GPUs"}]
    args = dict(model=server.model, messages=messages, max_tokens=16, temperature=0)
    whole = client.chat.completions.create(**args)
    assert whole.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(stream=True, **args))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed == whole.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks]
    assert reasons.count(whole.choices[0].finish_reason) == 1


def test_stop_strings_and_seeds(client, server):
    base = client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=20,
                                     temperature=0, extra_body={"ignore_eos": True}).choices[0].text
    stop = base[5:8]
    cut = client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=20,
                                    temperature=0, stop=[stop]).choices[0]
    assert cut.text == base[: base.index(stop)] and cut.finish_reason == "stop"
    sampled = [client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=12,
                                         temperature=1.0, seed=42, extra_body={"top_k": 50}).choices[0].text
               for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_async_client_concurrent_streams(server):
    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused")

        async def one(i: int) -> tuple[str, str]:
            stream = await client.chat.completions.create(
                model=server.model, messages=[{"role": "user", "content": f"Question {i}"}],
                max_tokens=8, temperature=0, stream=True)
            text, reason = "", None
            async for chunk in stream:
                text += chunk.choices[0].delta.content or ""
                reason = chunk.choices[0].finish_reason or reason
            return text, reason

        results = await asyncio.gather(*(one(i) for i in range(20)))
        await client.close()
        return results

    results = asyncio.run(main())
    assert all(reason in ("length", "stop") for _, reason in results)
    assert len({text for text, _ in results}) > 1
