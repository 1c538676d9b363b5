"""Property-based fuzzing of the OpenAI endpoints of one real `hybridlb serve`.

Whatever arrives — random JSON, wrong types, huge numbers, bad unicode, extra fields,
the wrong content type — the answer is a 2xx or a 4xx with an OpenAI error body, never
a 5xx and never a hang; every field `/openapi.json` lists is tried, and after each case
nothing stays in flight; afterwards the server still generates.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridlb.testing.servers import completion, start_server

ENDPOINTS = ["/v1/completions", "/v1/chat/completions"]
FUZZ = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def server(tiny_qwen3):
    # A short max_model_len bounds the work of any request the fuzzer gets right.
    server = start_server(tiny_qwen3, "--max-model-len", "32")
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=httpx.Timeout(30, connect=5)) as client:
        yield client


# -- strategies -----------------------------------------------------------------------------
surrogates = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF, categories=["Cs"])
texts = st.lists(st.characters() | surrogates, max_size=8).map("".join)  # st.text() drops surrogates
# Bounded, so hypothesis draws large magnitudes often (unbounded integers stay mostly small).
ints = st.integers(-(2**70), 2**70) | st.sampled_from([0, -1, 1, 47, 2**63 - 1, 2**63, 2**64, -(2**63) - 1])
floats = st.floats() | st.sampled_from([0.0, -0.0, 1e-300, 1e308])
scalars = st.none() | st.booleans() | ints | floats | texts
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(texts, inner, max_size=4), max_leaves=12)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"]) | texts,
     "content": texts | st.none() | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}))}),
    max_size=3)
# Each field: values of roughly its type (so the rest of the request stays valid), or anything.
FIELDS = {
    "model": texts, "prompt": texts | st.lists(texts, max_size=3) | st.lists(ints, max_size=3)
    | st.lists(st.lists(ints, max_size=3), max_size=2), "messages": messages,
    "max_tokens": ints, "max_completion_tokens": ints, "top_k": ints, "n": ints, "seed": ints, "best_of": ints,
    "temperature": floats | ints, "top_p": floats, "frequency_penalty": floats, "presence_penalty": floats,
    "stop": texts | st.lists(texts, max_size=3), "stop_token_ids": st.lists(ints, max_size=3),
    "ignore_eos": st.booleans(), "stream": st.booleans(), "echo": st.booleans(), "logprobs": ints | st.booleans(),
    "suffix": texts, "stream_options": st.dictionaries(st.just("include_usage"), scalars),
}


def _base(model: str, endpoint: str) -> dict:
    if endpoint == "/v1/completions":
        return {"model": model, "prompt": "GPU", "max_tokens": 2}
    return {"model": model, "messages": [{"role": "user", "content": "GPU"}], "max_tokens": 2}


@st.composite
def one_field_changed(draw, model: str, endpoint: str) -> dict:
    """A valid request with one field set to a value of about its type: the rest stays
    valid, so the value gets as far into the server as it can."""
    name = draw(st.sampled_from(sorted(FIELDS)))
    return {**_base(model, endpoint), name: draw(FIELDS[name])}


@st.composite
def mutated_bodies(draw, model: str, endpoint: str) -> dict:
    """A valid request with a few fields replaced, dropped or added."""
    body = _base(model, endpoint)
    for name in draw(st.lists(st.sampled_from(sorted(FIELDS)), min_size=1, max_size=3, unique=True)):
        choice = draw(st.integers(0, 7))
        if choice == 0:
            body.pop(name, None)
        else:
            body[name] = draw(json_values if choice == 1 else FIELDS[name])
    body.update(draw(st.dictionaries(texts, json_values, max_size=2)))
    return body


def _encode(value) -> bytes:
    # allow_nan: NaN and Infinity tokens are invalid JSON, but Python's parser takes them.
    return json.dumps(value, allow_nan=True).encode()


raw_bodies = (st.binary(max_size=64) | st.sampled_from([
    b"", b"{", b'{"model": ', b"null", b"[]", b'"text"', b"\xff\xfe{}", b'{"model": "\xff"}',
    b'{"prompt": "\\ud800"}', b"{" * 5000, b"[" * 100_000, b'{"a": 1e99999}', b"NaN",
]))
content_types = st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded",
                                 "multipart/form-data", "application/json; charset=latin-1", "", "*/*"])


# -- checks ---------------------------------------------------------------------------------
def check(response: httpx.Response) -> None:
    """No 5xx, and every error is an OpenAI error object."""
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"]
        assert isinstance(error["type"], str)


def post(client: httpx.Client, endpoint: str, content: bytes, content_type: str | None) -> None:
    headers = {"content-type": content_type} if content_type is not None else {}
    with client.stream("POST", endpoint, content=content, headers=headers) as response:
        response.read()  # a stream must end, not hang, within the client's timeout
    check(response)
    if response.status_code == 200 and "text/event-stream" in response.headers["content-type"]:
        assert response.text.rstrip().endswith("data: [DONE]"), response.text


def nothing_in_flight(client: httpx.Client) -> None:
    """Every request the server took has let go of its engine (released on every exit path)."""
    deadline = time.monotonic() + 5
    while counts := [e["in_flight_here"] for e in client.get("/ranks").json()["engines"] if e["in_flight_here"]]:
        assert time.monotonic() < deadline, f"left in flight: {counts}"
        time.sleep(0.05)


def by_schema(schema: dict, components: dict) -> st.SearchStrategy:
    """Values of about the type a property's JSON schema gives (``anyOf`` each way), or anything."""
    if "$ref" in schema:
        return by_schema(components[schema["$ref"].rsplit("/", 1)[1]], components) | json_values
    if "anyOf" in schema:
        return st.one_of([by_schema(option, components) for option in schema["anyOf"]])
    kind = schema.get("type")
    if kind == "array":
        return st.lists(by_schema(schema.get("items", {}), components), max_size=3)
    if kind == "object":
        values = schema.get("additionalProperties")
        return st.dictionaries(texts | ints.map(str), by_schema(values, components) if isinstance(values, dict)
                               else json_values, max_size=3)
    return {"integer": ints, "number": floats | ints, "boolean": st.booleans(), "string": texts,
            "null": st.none()}.get(kind, json_values)


@pytest.fixture(scope="module")
def documented(client) -> dict[str, dict[str, st.SearchStrategy]]:
    """endpoint → every request field `/openapi.json` lists → a strategy for its values."""
    spec = client.get("/openapi.json").json()
    components = spec["components"]["schemas"]
    fields = {}
    for endpoint in ENDPOINTS:
        ref = spec["paths"][endpoint]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        properties = components[ref.rsplit("/", 1)[1]]["properties"]
        fields[endpoint] = {name: FIELDS.get(name, st.nothing()) | by_schema(prop, components)
                            for name, prop in properties.items()}
    return fields


# -- the fuzzing ----------------------------------------------------------------------------
@pytest.mark.parametrize("endpoint", ENDPOINTS)
@settings(FUZZ, max_examples=250)
@given(data=st.data())
def test_every_documented_field_leaves_nothing_in_flight(server, client, documented, endpoint, data):
    """Each case sets one or two fields of the schema to values of about their type (a
    tools list, logit_bias keys up to 2**70, chat_template_kwargs, ...) and streams or not."""
    names = data.draw(st.lists(st.sampled_from(sorted(documented[endpoint])), min_size=1, max_size=2, unique=True))
    body = {**_base(server.model, endpoint), **{name: data.draw(documented[endpoint][name]) for name in names}}
    post(client, endpoint, _encode(body), "application/json")
    nothing_in_flight(client)

@pytest.mark.parametrize("endpoint", ENDPOINTS)
@settings(FUZZ, max_examples=100)
@given(data=st.data())
def test_one_field(server, client, endpoint, data):
    body = data.draw(one_field_changed(server.model, endpoint))
    post(client, endpoint, _encode(body), "application/json")


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@FUZZ
@given(data=st.data())
def test_mutated_requests(server, client, endpoint, data):
    body = data.draw(mutated_bodies(server.model, endpoint))
    post(client, endpoint, _encode(body), "application/json")


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@FUZZ
@given(body=json_values)
def test_random_json(client, endpoint, body):
    post(client, endpoint, _encode(body), "application/json")


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@FUZZ
@given(content=raw_bodies, content_type=content_types | st.none())
def test_raw_bytes_and_content_types(client, endpoint, content, content_type):
    post(client, endpoint, content, content_type)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@settings(FUZZ, max_examples=20)
@given(data=st.data(), content_type=content_types)
def test_valid_json_with_wrong_content_type(server, client, endpoint, data, content_type):
    body = data.draw(mutated_bodies(server.model, endpoint))
    post(client, endpoint, _encode(body), content_type)


def test_still_serving_after_the_fuzzing(server):
    assert server.process.poll() is None, server.output
    result = completion(server.url, server.model, prompt="The weather today", max_tokens=4)
    assert result["usage"]["completion_tokens"] == 4 and result["choices"][0]["text"]
    assert "Traceback" not in server.output, server.output
