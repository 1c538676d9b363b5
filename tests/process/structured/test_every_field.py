"""No request field is accepted and ignored: the test walks the completions and chat request
schemas of /openapi.json and, for every field listed there, sends a request that sets it and
checks what a user would notice (a different output, a field in the response, or a 400 naming
it). A field added to the schema without a check here fails the test."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from hybridlb.testing.servers import start_server

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Tell me about Paris."}]
NUMBER = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}


class Api:
    def __init__(self, url: str):
        self.url = url

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json={"model": "smollm2", **body}, timeout=120)

    def complete(self, **body) -> dict:
        response = self.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, **body})
        assert response.status_code == 200, response.text
        return response.json()

    def chat(self, **body) -> dict:
        response = self.post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 12, "temperature": 0, **body})
        assert response.status_code == 200, response.text
        return response.json()

    def stream(self, path: str, **body) -> list[dict]:
        defaults = {"messages": CHAT} if "chat" in path else {"prompt": PROMPT}
        payload = {"model": "smollm2", "max_tokens": 6, "temperature": 0, "stream": True, **defaults, **body}
        with httpx.stream("POST", f"{self.url}{path}", json=payload, timeout=120) as response:
            assert response.status_code == 200, response.read()
            lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        return [json.loads(line) for line in lines if line != "[DONE]"]

    def refused(self, path: str, field: str, value) -> None:
        body = {"prompt": PROMPT} if path.endswith("/completions") and "chat" not in path else {"messages": CHAT}
        response = self.post(path, {**body, "max_tokens": 2, field: value})
        assert response.status_code in (400, 422), (field, response.text)
        assert field in json.dumps(response.json()), response.text


def text(response: dict) -> str:
    choice = response["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"] or ""


def tokens(response: dict) -> int:
    return response["usage"]["completion_tokens"]


def baseline(api: Api, **body) -> str:
    return text(api.complete(**body))


def sampling_checks(api: Api, call: Callable[..., dict]) -> dict[str, Callable[[], None]]:
    """Checks of the fields completions and chat share, made with ``call`` (one or the other)."""
    greedy = text(call(max_tokens=30))
    said = text(call())
    first_word = said.split()[0]
    return {
        "model": lambda: None if api.post("/v1/completions", {"prompt": "x", "model": "other"}).status_code == 404
        else pytest.fail("model"),
        "max_tokens": lambda: _eq(tokens(call(max_tokens=3)), 3),
        "temperature": lambda: _ne(text(call(max_tokens=30, temperature=1.5, seed=1)), greedy),
        "top_p": lambda: _eq(text(call(max_tokens=30, temperature=1.0, seed=1, top_p=1e-6)), greedy),
        "top_k": lambda: _eq(text(call(max_tokens=30, temperature=1.0, seed=1, top_k=1)), greedy),
        "min_p": lambda: _eq(text(call(max_tokens=30, temperature=1.0, seed=1, min_p=1.0)), greedy),
        "repetition_penalty": lambda: _ne(text(call(max_tokens=30, repetition_penalty=3.0)), greedy),
        "presence_penalty": lambda: _ne(text(call(max_tokens=30, presence_penalty=2.0)), greedy),
        "frequency_penalty": lambda: _ne(text(call(max_tokens=30, frequency_penalty=2.0)), greedy),
        "n": lambda: _eq(len(call(n=3)["choices"]), 3),
        "seed": lambda: _eq(text(call(temperature=1.0, seed=5)), text(call(temperature=1.0, seed=5)))
        or _ne(text(call(max_tokens=30, temperature=1.0, seed=5)), text(call(max_tokens=30, temperature=1.0, seed=6))),
        "stop": lambda: _eq(text(call(stop=[first_word]))[: len(said)].find(first_word), -1),
        "stop_token_ids": lambda: _check(call(stop_token_ids=[_token(api, said)])),
        "ignore_eos": lambda: _eq(tokens(call(max_tokens=40, ignore_eos=True, logit_bias={"2": 100})), 40),
        "stream": lambda: _eq(bool(api.stream(_path(call))), True),
        "stream_options": lambda: _eq([bool(c.get("usage")) for c in api.stream(
            _path(call), stream_options={"include_usage": True, "continuous_usage_stats": True})][-3:], [True] * 3),
        "logit_bias": lambda: _eq(set(text(call(max_tokens=4, logit_bias={str(_token(api, " Paris")): 100}))
                                      .split()), {"Paris"}),
        "min_tokens": lambda: _eq(tokens(call(max_tokens=40, min_tokens=40, logit_bias={"2": 50})), 40),
        "allowed_token_ids": lambda: _eq(text(call(max_tokens=3, allowed_token_ids=[_token(api, " Paris")])),
                                         " Paris Paris Paris"),
        "bad_words": lambda: _eq(first_word in text(call(bad_words=[first_word])), False),
        "include_stop_str_in_output": lambda: _eq(text(call(stop=[first_word], include_stop_str_in_output=True))
                                                  .endswith(first_word), True),
        "skip_special_tokens": lambda: _eq(text(call(max_tokens=2, allowed_token_ids=[1],
                                                     skip_special_tokens=False)), "<|im_start|><|im_start|>"),
        "spaces_between_special_tokens": lambda: api.refused(_path(call), "spaces_between_special_tokens", False),
        "truncate_prompt_tokens": lambda: _eq(call(truncate_prompt_tokens=2)["usage"]["prompt_tokens"], 2),
        "response_format": lambda: _eq(type(json.loads(text(call(max_tokens=60, response_format={
            "type": "json_schema", "json_schema": {"name": "n", "schema": NUMBER}})))["n"]), int),
        "structured_outputs": lambda: _match(r"[0-9]{4}", text(call(structured_outputs={"regex": r"\d{4}"}))),
        "guided_json": lambda: _eq(type(json.loads(text(call(max_tokens=60, guided_json=NUMBER)))["n"]), int),
        "guided_regex": lambda: _match(r"[a-c]{3}", text(call(guided_regex="[a-c]{3}"))),
        "guided_choice": lambda: _eq(text(call(guided_choice=["alpha", "beta"])) in {"alpha", "beta"}, True),
        "guided_grammar": lambda: _match(r"(yes|no)!", text(call(max_tokens=12,
                                                                   guided_grammar='start: ("yes" | "no") "!"'))),
        "guided_decoding_backend": lambda: api.refused(_path(call), "guided_decoding_backend", "outlines"),
        "request_id": lambda: _eq(call(request_id="abc123")["id"].endswith("-abc123"), True),
    }


def _path(call) -> str:
    return "/v1/chat/completions" if call.__name__ == "chat" else "/v1/completions"


def _token(api: Api, word: str) -> int:
    ids = httpx.post(f"{api.url}/tokenize", json={"prompt": word, "add_special_tokens": False}).json()["tokens"]
    return ids[0]


def _calls(response: dict) -> int:
    """The calls made, counting those of an array that max_tokens cut off."""
    message = response["choices"][0]["message"]
    return len(message.get("tool_calls") or []) or (message["content"] or "").count('"name"')


def _eq(a, b):
    assert a == b, (a, b)


def _ne(a, b):
    assert a != b, (a, b)


def _match(pattern: str, value: str):
    assert re.fullmatch(pattern, value), (pattern, value)


def _check(response: dict) -> None:
    """It stopped at the first token (the one named), which the text does not show."""
    assert response["choices"][0]["finish_reason"] == "stop" and tokens(response) == 1 and not text(response), response


def completion_checks(api: Api) -> dict[str, Callable[[], None]]:
    return {
        **sampling_checks(api, api.complete),
        "prompt": lambda: _ne(baseline(api, prompt="Water boils at"), baseline(api)),
        "logprobs": lambda: _eq(len(api.complete(logprobs=2)["choices"][0]["logprobs"]["top_logprobs"][0]), 2),
        "echo": lambda: _eq(text(api.complete(echo=True)).startswith(PROMPT), True),
        "suffix": lambda: api.refused("/v1/completions", "suffix", "end"),
        "best_of": lambda: _eq(tokens(api.complete(best_of=3, max_tokens=4, temperature=1.0, seed=1)), 12),
        "add_special_tokens": lambda: None,  # SmolLM2's tokenizer adds no special tokens: see the tiny llama check
    }


def chat_checks(api: Api) -> dict[str, Callable[[], None]]:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}]
    plain = api.chat()
    return {
        **sampling_checks(api, api.chat),
        "messages": lambda: _ne(text(api.chat(messages=[{"role": "user", "content": "Name a color."}])), text(plain)),
        "max_completion_tokens": lambda: _eq(tokens(api.chat(max_completion_tokens=3)), 3),
        "logprobs": lambda: _eq(len(api.chat(logprobs=True)["choices"][0]["logprobs"]["content"]), tokens(plain)),
        "top_logprobs": lambda: _eq(len(api.chat(logprobs=True, top_logprobs=3)["choices"][0]["logprobs"]["content"][0]
                                        ["top_logprobs"]), 3),
        "tools": lambda: _ne(api.chat(tools=tools, tool_choice="none")["usage"]["prompt_tokens"],
                             plain["usage"]["prompt_tokens"]),
        "tool_choice": lambda: _eq(api.chat(tools=tools, tool_choice="required", max_tokens=100)["choices"][0]
                                   ["finish_reason"], "tool_calls"),
        "parallel_tool_calls": lambda: _eq([_calls(api.chat(
            tools=tools, tool_choice="required", parallel_tool_calls=flag, max_tokens=60,
            logit_bias={str(_token(api, ",")): 20})) > 1 for flag in (True, False)], [True, False]),
        "documents": lambda: _ne(api.chat(documents=[{"text": "Paris has 2 million people."}])["usage"]
                                 ["prompt_tokens"], plain["usage"]["prompt_tokens"]),
        "chat_template_kwargs": lambda: _ne(api.chat(chat_template_kwargs={"enable_thinking": False})["usage"]
                                            ["prompt_tokens"], plain["usage"]["prompt_tokens"]),
        "add_generation_prompt": lambda: _ne(api.chat(add_generation_prompt=False)["usage"]["prompt_tokens"],
                                             plain["usage"]["prompt_tokens"]),
        "continue_final_message": lambda: _eq(text(api.chat(
            messages=[*CHAT, {"role": "assistant", "content": "Paris is the capital of"}], add_generation_prompt=False,
            continue_final_message=True, max_tokens=3)).lstrip().startswith("France"), True),
        "add_special_tokens": lambda: None,  # SmolLM2's tokenizer adds no special tokens: see the tiny llama check
        "echo": lambda: _eq(text(api.chat(messages=[*CHAT, {"role": "assistant", "content": "Sure:"}], echo=True,
                                          add_generation_prompt=False, continue_final_message=True))
                            .startswith("Sure:"), True),
        "include_reasoning": lambda: _eq(
            ("reasoning_content" in api.chat(chat_template_kwargs={"enable_thinking": True})["choices"][0]["message"],
             "reasoning_content" in api.chat(chat_template_kwargs={"enable_thinking": True}, include_reasoning=False)
             ["choices"][0]["message"]), (True, False)),
        "reasoning_effort": lambda: _ne(api.chat(reasoning_effort="high")["usage"]["prompt_tokens"],
                                        plain["usage"]["prompt_tokens"]),
        "modalities": lambda: api.refused("/v1/chat/completions", "modalities", ["audio"]),
    }


def _fields(spec: dict, path: str) -> set[str]:
    ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    return set(spec["components"]["schemas"][ref.rsplit("/", 1)[1]]["properties"])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_every_listed_field_has_an_effect(structured_server, path):
    api = Api(structured_server.url)
    spec = httpx.get(f"{structured_server.url}/openapi.json").json()
    checks = completion_checks(api) if path == "/v1/completions" else chat_checks(api)
    listed = _fields(spec, path)
    assert listed <= set(checks), f"fields without a check: {sorted(listed - set(checks))}"
    def check(field: str) -> str | None:
        try:
            checks[field]()
        except Exception as exc:  # collect them all: one report names every field that misbehaves
            return f"{field}: {type(exc).__name__}: {exc}"
        return None

    # Four at a time, as clients share a server: the float32 server gives a request the same tokens
    # whatever shares its batch, so each check's comparison holds (and the walk takes half the time).
    with ThreadPoolExecutor(4) as pool:
        failed = [problem for problem in pool.map(check, sorted(listed)) if problem]
    assert not failed, "\n".join(failed)


@pytest.fixture(scope="module")
def bos_server(tiny_qwen3, tmp_path_factory):
    """A tiny checkpoint whose tokenizer adds a BOS token to every text (as Llama's does)."""
    from tokenizers import Tokenizer, processors

    directory = tmp_path_factory.mktemp("bos") / "model"
    shutil.copytree(tiny_qwen3, directory)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    bos = "<|endoftext|>"
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                             special_tokens=[(bos, tokenizer.token_to_id(bos))])
    tokenizer.save(str(directory / "tokenizer.json"))
    server = start_server(str(directory))
    yield server
    server.stop()


def test_add_special_tokens_reaches_the_tokenizer(bos_server):
    """On a checkpoint whose tokenizer adds a BOS token."""
    def prompt_tokens(path: str, **body) -> int:
        base = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": CHAT}
        response = httpx.post(f"{bos_server.url}{path}", timeout=60,
                              json={**base, "max_tokens": 1, **body})
        return response.json()["usage"]["prompt_tokens"]

    assert prompt_tokens("/v1/completions") == prompt_tokens("/v1/completions", add_special_tokens=False) + 1
    assert prompt_tokens("/v1/chat/completions", add_special_tokens=True) == prompt_tokens("/v1/chat/completions") + 1


def test_an_unknown_vllm_field_that_asks_for_something_is_refused(structured_server):
    api = Api(structured_server.url)
    for field, value in [("use_beam_search", True), ("priority", 3), ("cache_salt", "tenant-a"),
                         ("return_tokens_as_token_ids", True), ("functions", [{"name": "f"}])]:
        api.refused("/v1/chat/completions", field, value)
