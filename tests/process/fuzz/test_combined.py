"""A fuzzer that combines: whole requests, 2 to 5 fields at once from `/openapi.json`, values at
and past each field's limits (real token ids and out-of-range ones; LoRA adapters that are
served, truncated on disk, or unknown), against a live dense DP=2 node while victim streams
run. A careless or hostile client must cost only its own request.

The property, for every fuzzed request: it gets a response — 2xx, or 4xx with an OpenAI
error body; never a 5xx, never a stream that ends in a server error or without ``[DONE]``.
Over the whole run: every victim stream completes with the text it gives with nothing else
running, every engine still runs with the pid it started with, and nothing stays in flight.
A fixed seed (``derandomize``) and ``EXAMPLES`` examples in CI; a longer run is a benchmark
(``HYBRIDLB_FUZZ_EXAMPLES``).
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hybridlb.testing.adapters import write_adapter
from hybridlb.testing.servers import Server, start_servers
from tests.process.fuzz.test_http import by_schema, check, nothing_in_flight

EXAMPLES = int(os.environ.get("HYBRIDLB_FUZZ_EXAMPLES", "300"))
MAX_MODEL_LEN = 128
VICTIM_TOKENS = 48
ENDPOINTS = ["/v1/completions", "/v1/chat/completions"]


# -- the node and its victims --------------------------------------------------------------
def _victim_body(model: str, prompt: int) -> dict:
    return {"model": model, "prompt": f"Story number {prompt}:", "max_tokens": VICTIM_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}


def _stream_text(client: httpx.Client, body: dict) -> str:
    """A streamed completion's text; raises if it does not complete."""
    text, done = [], False
    with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read()[:300]!r}")
        for line in response.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"error event: {event['error']}")
                text.append(event["choices"][0]["text"])
    if not done:
        raise RuntimeError("the stream ended without [DONE]")
    return "".join(text)


@dataclass
class Victims:
    """Closed-loop greedy streams for as long as the fuzzer runs, each checked against its clean text."""

    url: str
    model: str
    clean: dict[int, str]
    count: int = 2
    done: int = 0
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(self.count)]
        for thread in self.threads:
            thread.start()

    def _loop(self, worker: int) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as client:
            turn = worker
            while not self.stop.is_set():
                prompt = turn % len(self.clean)
                try:
                    text = _stream_text(client, _victim_body(self.model, prompt))
                    if text != self.clean[prompt]:
                        self.failures.append(f"prompt {prompt}: {text[:60]!r} != {self.clean[prompt][:60]!r}")
                except Exception as exc:
                    self.failures.append(f"prompt {prompt}: {type(exc).__name__}: {exc}"[:400])
                self.done += 1
                turn += self.count

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(150)


def _engines(server: Server) -> dict[str, int]:
    return {title: pid for title, pid in server.children().items() if title.startswith("hybridlb:engine")}


@pytest.fixture(scope="module")
def node(tiny_qwen3, tmp_path_factory):
    adapters = tmp_path_factory.mktemp("fuzz-adapters")
    for i, name in enumerate(("good", "truncated")):
        write_adapter(adapters / name, tiny_qwen3, ["q_proj", "v_proj"], seed=i)
    server = start_servers(Server(tiny_qwen3, "--data-parallel-size", "2", "--max-model-len", str(MAX_MODEL_LEN),
                                  "--enable-lora", "--lora-modules", f"good={adapters / 'good'}",
                                  f"truncated={adapters / 'truncated'}", "--max-loras", "2"))[0]
    weights = adapters / "truncated" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-16])  # its header still reads; its tensors do not
    with httpx.Client(base_url=server.url, timeout=120) as client:
        server.clean = {i: _stream_text(client, _victim_body(server.model, i)) for i in range(4)}
    server.vocab = json.loads((Path(tiny_qwen3) / "config.json").read_text())["vocab_size"]
    server.engines = _engines(server)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(node):
    with httpx.Client(base_url=node.url, timeout=httpx.Timeout(120, connect=5)) as client:
        yield client


@pytest.fixture(scope="module")
def victims(node):
    victims = Victims(node.url, node.model, node.clean)
    victims.start()
    yield victims
    victims.finish()


# -- values at and past each field's limits ----------------------------------------------------
def at_the_limits(vocab: int, model: str) -> dict[str, st.SearchStrategy]:
    """Per field, values at and just past its limits (hybridlb.params, hybridlb.api.openai.schemas)."""
    token = st.sampled_from([0, 1, vocab - 1, vocab, vocab + 1, 10**9, -1, 2**63 - 1])
    tokens = st.lists(token, min_size=1, max_size=4)
    floats = st.sampled_from
    texts = st.sampled_from(["", "a", "the", " x", "\n", "é中🚀", "ab" * 600, "x" * 1024, "\ud800"])
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    hard = {"type": "string", "pattern": "(a|b)*c{9999}"}
    return {
        "model": st.sampled_from([model, "good", "truncated", "unknown-adapter"]),
        "prompt": texts | tokens | st.just(list(range(MAX_MODEL_LEN))) | st.just(["x"] * 1025)
        | st.lists(tokens, min_size=1, max_size=3),
        "max_tokens": st.sampled_from([1, 2, 8, 0, -1, MAX_MODEL_LEN - 1, MAX_MODEL_LEN, 10**6, 2**63]),
        "max_completion_tokens": st.sampled_from([1, 4, 0, 10**6]),
        "min_tokens": st.sampled_from([0, 1, 4, 8, MAX_MODEL_LEN, -1, 10**6]),
        "temperature": floats([0.0, 1e-6, 0.7, 2.0, 100.0, -0.1, 1e308]),
        "top_p": floats([1e-9, 0.5, 1.0, 0.0, 1.0001, -1.0]),
        "top_k": st.sampled_from([-1, 0, 1, vocab, vocab + 1, 2**31, -2]),
        "min_p": floats([0.0, 0.5, 1.0, 1.01, -0.01]),
        "repetition_penalty": floats([1e-6, 1.0, 2.0, 100.0, 100.1, 0.0]),
        "presence_penalty": floats([-2.0, 0.0, 2.0, 2.01, -2.01]),
        "frequency_penalty": floats([-2.0, 0.0, 2.0, 2.01, -2.01]),
        "seed": st.sampled_from([0, 1, -1, 2**63 - 1, -(2**63), 2**64]),
        "n": st.sampled_from([1, 2, 4, 0, 129]),
        "best_of": st.sampled_from([1, 2, 3, 0, 129]),
        "stop": texts | st.lists(texts, max_size=3) | st.just(["a"] * 65) | st.just("s" * 1025),
        "stop_token_ids": tokens | st.just([1] * 1025),
        "logit_bias": st.dictionaries(token.map(str), floats([-100.0, 100.0, 100.5, -101.0, 0.0]), max_size=4)
        | st.just({str(i): 1.0 for i in range(1025)}),
        "allowed_token_ids": tokens | st.just([]) | st.just(list(range(65537))),
        "bad_words": st.lists(texts, max_size=3) | st.just(["w"] * 129) | st.just(["ab" * (3 * 2**19)]),
        "logprobs": st.sampled_from([0, 1, 20, 21, -1, True, False]),
        "top_logprobs": st.sampled_from([0, 20, 21, -1]),
        "prompt_logprobs": st.sampled_from([0, 1, 20, 21, -1]),
        "truncate_prompt_tokens": st.sampled_from([-1, 0, 1, MAX_MODEL_LEN - 1, MAX_MODEL_LEN, 10**6, -2]),
        "response_format": st.sampled_from([
            {"type": "json_object"}, {"type": "text"}, {"type": "bogus"},
            {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
            {"type": "json_schema", "json_schema": {"name": "x", "schema": hard}},
        ]),
        "structured_outputs": st.sampled_from([
            {"regex": "[a-z]+"}, {"choice": ["yes", "no"]}, {"grammar": 'root ::= "x"'}, {"json": schema},
            {"regex": "("}, {"regex": "a" * 300_000}, {"json": {"type": "bogus"}}, {"choice": []},
        ]),
        "guided_regex": st.sampled_from(["[0-9]{1,3}", "(", "a" * 300_000]),
        "guided_choice": st.sampled_from([["a", "b"], [], ["x" * 10_000]]),
        "tool_choice": st.sampled_from(["auto", "required", "none", {"type": "function", "function": {"name": "f"}},
                                        {"type": "function", "function": {"name": "missing"}}, "bogus"]),
        "tools": st.sampled_from([[{"type": "function", "function": {"name": "f", "parameters": schema}}], [],
                                  [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}]]),
    }


class Fields(dict):
    def __repr__(self) -> str:  # hypothesis prints a failing example's arguments: not megabytes of strategies
        return f"<strategies for {sum(len(v) for v in self.values())} fields>"


@pytest.fixture(scope="module")
def fields(node, client) -> dict[str, dict[str, st.SearchStrategy]]:
    """endpoint → every request field `/openapi.json` lists → its values: at and past its limits
    where the table above knows them, else of about its schema's type."""
    spec = client.get("/openapi.json").json()
    components = spec["components"]["schemas"]
    limits = at_the_limits(node.vocab, node.model)
    found = Fields()
    for endpoint in ENDPOINTS:
        ref = spec["paths"][endpoint]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        properties = components[ref.rsplit("/", 1)[1]]["properties"]
        found[endpoint] = {name: limits[name] if name in limits else by_schema(prop, components)
                           for name, prop in properties.items()}
    return found


def _base(model: str, endpoint: str) -> dict:
    if endpoint == "/v1/completions":
        return {"model": model, "prompt": "GPU", "max_tokens": 4}
    return {"model": model, "messages": [{"role": "user", "content": "GPU"}], "max_tokens": 4}


def _send(client: httpx.Client, endpoint: str, body: dict) -> None:
    """One fuzzed request, checked: a 2xx or a 4xx OpenAI error, a stream that ends in [DONE]
    and carries no server error."""
    content = json.dumps(body, allow_nan=True).encode()
    with client.stream("POST", endpoint, content=content, headers={"content-type": "application/json"}) as response:
        response.read()
    check(response)
    event(f"HTTP {response.status_code}")
    if response.status_code == 200 and "text/event-stream" in response.headers["content-type"]:
        events = [json.loads(line[6:]) for line in response.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        errors = [e["error"] for e in events if "error" in e]
        assert not any(e.get("type") == "internal_error" or (e.get("code") or 0) in range(500, 600)
                       for e in errors if isinstance(e.get("code"), int) or e.get("type")), errors
        assert response.text.rstrip().endswith("data: [DONE]"), response.text[-300:]


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=False,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_combined_requests_cost_only_themselves(node, client, fields, victims, data):
    endpoint = data.draw(st.sampled_from(ENDPOINTS))
    names = data.draw(st.lists(st.sampled_from(sorted(fields[endpoint])), min_size=2, max_size=5, unique=True))
    body = {**_base(node.model, endpoint), **{name: data.draw(fields[endpoint][name]) for name in names}}
    try:
        _send(client, endpoint, body)
    except AssertionError as failed:  # name the request without printing megabytes of it
        raise AssertionError(f"{endpoint} {_short(body)}: {str(failed)[:2000]}") from None


def _short(body: dict) -> str:
    return json.dumps({k: v if len(json.dumps(v, allow_nan=True)) < 200 else f"<{type(v).__name__} of "
                       f"{len(json.dumps(v, allow_nan=True))} bytes>" for k, v in body.items()}, allow_nan=True)


def test_the_victims_and_the_engines_came_through(node, client, victims):
    """After the fuzzing: every victim stream had its clean text, every engine its first pid."""
    victims.finish()
    assert victims.done >= 4, "the victims never ran"
    assert not victims.failures, victims.failures[:5]
    assert _engines(node) == node.engines, node.output[-3000:]
    nothing_in_flight(client)
    deadline = time.monotonic() + 10
    while any(e["num_running"] + e["num_waiting"] for e in client.get("/ranks").json()["engines"]):
        assert time.monotonic() < deadline, client.get("/ranks").json()
        time.sleep(0.2)
