"""Each tool-call parser on outputs of its model family (written by hand from the formats'
documentation): the whole output and the same output streamed in random chunks give the same
content and calls, as the ``openai`` SDK accumulates the stream."""

from __future__ import annotations

import json
import random
import re

import pytest

from hybridlb.api.openai.tools import ToolStream, extract, make_parser
from hybridlb.api.openai.tools.forced import NamedParser, RequiredParser

CALL = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}
NESTED = {"q": 'brace } and " quote {', "opts": {"depth": [1, {"k": None}], "on": True}, "city": "Zürich"}

# (parser, output, expected content, expected [(name, arguments)])
CASES = [
    ("hermes", 'I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
               "</tool_call>", "I will check.", [("get_weather", CALL["arguments"])]),
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n'
               '{"name": "b", "arguments": ' + json.dumps(NESTED) + "}\n</tool_call>", None,
     [("a", {"x": 1}), ("b", NESTED)]),
    ("hermes", '<tool_call>\n{"arguments": {"x": [1, 2]}, "name": "late_name"}\n</tool_call>', None,
     [("late_name", {"x": [1, 2]})]),
    ("hermes", '<tool_call>{"name": "no_args"}</tool_call>', None, [("no_args", {})]),
    ("hermes", "The weather in Paris is mild, <tool maybe> not a call.",
     "The weather in Paris is mild, <tool maybe> not a call.", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}', None,
     [("get_weather", CALL["arguments"])]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": '
                    + json.dumps(NESTED) + "}", None, [("a", {"x": 1}), ("b", NESTED)]),
    ("llama3_json", '{"name": "c", "arguments": {}}', None, [("c", {})]),
    ("llama3_json", "It is sunny in Paris today.", "It is sunny in Paris today.", []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}]', None,
     [("get_weather", CALL["arguments"])]),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": '
                + json.dumps(NESTED) + "}]", "Sure.", [("a", {}), ("b", NESTED)]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "c"}', None,
     [("get_weather", CALL["arguments"])]),
    ("mistral", '[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[ARGS]' + json.dumps(NESTED), None,
     [("a", {"x": 1}), ("b", NESTED)]),
    ("mistral", "No tools needed [TOOL maybe].", "No tools needed [TOOL maybe].", []),
    ("pythonic", '[get_weather(city="Paris", unit="c")]', None, [("get_weather", CALL["arguments"])]),
    ("pythonic", '[a(x=1), b(y=[1, 2], z={"k": true}, w=None)]', None,
     [("a", {"x": 1}), ("b", {"y": [1, 2], "z": {"k": True}, "w": None})]),
    ("pythonic", '<|python_start|>[tools.search(query="a) b", limit=3)]<|python_end|>', None,
     [("tools.search", {"query": "a) b", "limit": 3})]),
    ("pythonic", "The answer is [4] apples.", "The answer is [4] apples.", []),
]
MALFORMED = [
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>'),
    ("hermes", "<tool_call>\n{'name': 'f'}\n</tool_call>"),
    ("llama3_json", '{"name": "f", "parameters": {"x": 1} trailing'),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"x": }]'),
    ("pythonic", "[f(1, 2)]"),
    ("pythonic", "[f(x=open('file'))]"),
]


def _calls(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize(("family", "output", "content", "calls"), CASES)
def test_the_whole_output(family, output, content, calls):
    got_content, got_calls = extract(make_parser(family), output)
    assert got_content == content
    assert _calls(got_calls) == calls
    for call in got_calls:
        assert call["type"] == "function" and call["id"]
        assert isinstance(json.loads(call["function"]["arguments"]), dict)
    if family == "mistral":
        assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c["id"]) for c in got_calls)


def stream(parser, output: str, rng: random.Random) -> tuple[str, list[dict]]:
    """The output in random chunks through a ToolStream, accumulated as the openai SDK does."""
    tools = ToolStream(parser)
    content, calls, at = "", {}, 0
    while at < len(output):
        size = rng.randint(1, 7)
        piece, at = output[at : at + size], at + size
        fresh, deltas = tools.push(piece, final=at >= len(output))
        content += fresh
        for delta in deltas:
            call = calls.setdefault(delta["index"], {"id": None, "name": "", "arguments": ""})
            assert delta["index"] == len(calls) - 1 or "id" not in delta  # a new call takes the next index
            if "id" in delta:
                assert call["id"] is None and delta["type"] == "function"  # the id and name come once, first
                call["id"], call["name"] = delta["id"], delta["function"]["name"]
            call["arguments"] += delta["function"].get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize(("family", "output", "content", "calls"), CASES)
def test_streamed_in_random_chunks(family, output, content, calls):
    for seed in range(8):
        got_content, got_calls = stream(make_parser(family), output, random.Random(seed))
        assert (got_content.strip() or None) == content, seed
        assert [(c["name"], json.loads(c["arguments"])) for c in got_calls] == calls, seed
        assert all(c["id"] for c in got_calls)


@pytest.mark.parametrize(("family", "output"), MALFORMED)
def test_a_call_that_does_not_parse_is_returned_as_content(family, output):
    assert extract(make_parser(family), output) == (output, [])


def test_forced_calls_read_back():
    required = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": ' + json.dumps(NESTED) + "}]"
    assert _calls(extract(RequiredParser(), required)[1]) == [("a", {"x": 1}), ("b", NESTED)]
    named = '{"city": "Paris", "unit": "c"}'
    assert _calls(extract(NamedParser("get_weather"), named)[1]) == [("get_weather", CALL["arguments"])]
    for seed in range(5):
        rng = random.Random(seed)
        _, calls = stream(RequiredParser(), required, rng)
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("a", {"x": 1}), ("b", NESTED)]
        _, calls = stream(NamedParser("get_weather"), named, rng)
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", CALL["arguments"])]


def test_arguments_stream_as_the_model_writes_them():
    """Not held until the call ends: a long argument arrives in pieces."""
    tools = ToolStream(make_parser("hermes"))
    sent = []
    text = '<tool_call>\n{"name": "write", "arguments": {"text": "' + "word " * 40 + '"}}\n</tool_call>'
    for at in range(0, len(text), 10):
        sent += tools.push(text[at : at + 10], final=at + 10 >= len(text))[1]
    fragments = [d["function"]["arguments"] for d in sent if "id" not in d]
    assert len(fragments) > 10
