"""n and best_of: several sequences per prompt, through the openai SDK."""

from __future__ import annotations

import json

import httpx
import openai
import pytest


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


def test_n_returns_n_seeded_choices_per_prompt(client, server):
    args = dict(model=server.model, max_tokens=6, temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    out = client.completions.create(prompt=["GPU", "The weather"], n=3, **args)
    assert sorted(c.index for c in out.choices) == list(range(6))
    assert out.usage.completion_tokens == 6 * 6 and out.usage.prompt_tokens < 10
    texts = {c.index: c.text for c in out.choices}
    alone = client.completions.create(prompt="GPU", **args).choices[0].text
    assert texts[0] == alone  # the first sequence of a seeded request is the request alone
    assert len({texts[0], texts[1], texts[2]}) > 1  # the others draw from their own seeds
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], n=2, **args)
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_streamed_n_interleaves_choices_each_starting_once(client, server):
    chunks = list(client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Hi"}],
                                                 n=2, max_tokens=5, temperature=1.0, seed=3, stream=True,
                                                 extra_body={"ignore_eos": True}))
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role]
    finished = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(roles) == [0, 1] and sorted(finished) == [0, 1]


def test_best_of_returns_the_most_likely_candidates(client, server):
    args = dict(model=server.model, prompt="GPU", max_tokens=6, temperature=1.0, seed=7, logprobs=0,
                extra_body={"ignore_eos": True})
    candidates = client.completions.create(n=4, **args).choices
    totals = {c.text: sum(c.logprobs.token_logprobs) for c in candidates}
    best = client.completions.create(n=2, best_of=4, **args)
    assert len(best.choices) == 2 and best.usage.completion_tokens == 4 * 6
    assert [c.text for c in best.choices] == sorted(totals, key=totals.get, reverse=True)[:2]
    no_logprobs = client.completions.create(n=1, best_of=4, **{**args, "logprobs": None}).choices[0]
    assert no_logprobs.logprobs is None and no_logprobs.text == best.choices[0].text


@pytest.mark.parametrize(("body", "param"), [
    ({"n": 2, "best_of": 1}, "best_of"),
    ({"best_of": 3, "stream": True}, "best_of"),
    ({"n": 0}, "n"),
    ({"n": 200}, "n"),
])
def test_impossible_choice_counts_get_a_400(server, body, param):
    response = httpx.post(f"{server.url}/v1/completions", json={"model": server.model, "prompt": "x", **body})
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_a_streamed_line_separator_in_the_text_stays_inside_its_event(server):
    """U+2028, U+2029 and U+0085 are plain text in JSON, but clients that split lines the way
    str.splitlines() does (httpx's aiter_lines) would cut an event holding them raw in two."""
    prompt = "one\u2028two\u2029three\x85four"
    body = {"model": server.model, "prompt": prompt, "max_tokens": 2, "echo": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]  # each line a whole event
    assert "".join(e["choices"][0]["text"] for e in events).startswith(prompt)
