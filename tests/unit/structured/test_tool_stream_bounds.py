"""Bounds on reading tool calls out of what one request makes the model write. The parsers run
on the API server's event loop, between every stream's chunks, so a long call must cost time
linear in its length; output nested too deep to read is returned as content, never an error."""

from __future__ import annotations

import json
import random
import time

import pytest

from hybridlb.api.openai.tools import ToolStream, extract, make_parser
from hybridlb.api.openai.tools.forced import NamedParser, RequiredParser

DELTAS = 8000  # a long call: a file the model writes through a tool
WINDOW = 1000  # the first and the last deltas timed
REPEATS = 3  # the best of a few runs: the machine is shared


def long_arguments(rng: random.Random) -> dict:
    """A long string with quotes, escapes and brackets in it, then many keys with nested values."""
    words = ["the", "tool", "call", "(x)", "{y}", "[z]", 'say "hi"', "back\\slash", "line\n", "é", ")", "],"]
    arguments = {"path": "notes.md", "text": " ".join(rng.choice(words) for _ in range(3500))}
    arguments.update({f"key_{i}": [i, {"value": f"v{i}", "on": i % 2 == 0, "off": None}] for i in range(400)})
    return arguments


def pythonic(name: str, arguments: dict) -> str:
    return f"[{name}(" + ", ".join(f"{key}={value!r}" for key, value in arguments.items()) + ")]"


OUTPUTS = {  # family: (a fresh parser, the output as that family writes one call)
    "required": (RequiredParser, lambda a: json.dumps([{"name": "write", "parameters": a}])),
    "named": (lambda: NamedParser("write"), json.dumps),
    "hermes": (lambda: make_parser("hermes"),
               lambda a: "<tool_call>\n" + json.dumps({"name": "write", "arguments": a}) + "\n</tool_call>"),
    "llama3_json": (lambda: make_parser("llama3_json"), lambda a: json.dumps({"name": "write", "parameters": a})),
    "mistral": (lambda: make_parser("mistral"),
                lambda a: "[TOOL_CALLS]" + json.dumps([{"name": "write", "arguments": a}])),
    "mistral_v11": (lambda: make_parser("mistral"), lambda a: "[TOOL_CALLS]write[ARGS]" + json.dumps(a)),
    "pythonic": (lambda: make_parser("pythonic"), lambda a: pythonic("write", a)),
}


def deltas_of(output: str, rng: random.Random) -> list[str]:
    """The output in pieces of a few characters, as a model's tokens arrive."""
    pieces, at = [], 0
    while at < len(output):
        size = rng.randint(2, 6)
        pieces.append(output[at : at + size])
        at += size
    return pieces


def timed_stream(parser, deltas: list[str]) -> tuple[float, float, dict]:
    """Seconds spent in the first and in the last WINDOW pushes, and the call as streamed. The
    last two pushes, which end the call, are not timed: a pythonic call is parsed there, once."""
    tools, first, last, call = ToolStream(parser), 0.0, 0.0, {"name": "", "arguments": ""}
    for index, delta in enumerate(deltas):
        start = time.perf_counter()
        _, calls = tools.push(delta, final=index == len(deltas) - 1)
        spent = time.perf_counter() - start
        if index < WINDOW:
            first += spent
        elif len(deltas) - WINDOW - 2 <= index < len(deltas) - 2:
            last += spent
        for fragment in calls:
            call["name"] += fragment["function"].get("name", "")
            call["arguments"] += fragment["function"].get("arguments", "")
    return first, last, call


@pytest.mark.parametrize("family", OUTPUTS)
def test_a_long_call_streams_in_linear_time(family):
    make, write = OUTPUTS[family]
    rng = random.Random(0)
    arguments = long_arguments(rng)
    deltas = deltas_of(write(arguments), rng)
    assert len(deltas) >= DELTAS
    best_first = best_last = float("inf")
    for _ in range(REPEATS):
        first, last, call = timed_stream(make(), deltas)
        assert call["name"] == "write" and json.loads(call["arguments"]) == arguments
        best_first, best_last = min(best_first, first), min(best_last, last)
        if best_last <= min(WINDOW * 1e-3, 3 * best_first):
            break
    per_delta = f"first {best_first / WINDOW * 1e6:.0f} us, last {best_last / WINDOW * 1e6:.0f} us per delta"
    assert best_last / WINDOW <= 1e-3, per_delta
    assert best_last <= 3 * best_first, per_delta


DEEP = 100_000
CHAIN = 10_000  # within pythonic's MAX_SOURCE: ast.parse itself gives up
PYTHONIC_TOO_DEEP = [  # the first four raised RecursionError or MemoryError out of the parser: a 500
    "[f(a=" + "+".join(["1"] * CHAIN) + ")]",
    "[f(a=" + "-" * CHAIN + "1)]",
    "[f(a=" + "not " * CHAIN + "1)]",
    "[" + ".".join(["a"] * CHAIN) + "()]",
    "[f(a=" + "[" * 5000 + "]" * 5000 + ")]",
    "[f(a=" + "[" * 150 + "]" * 150 + ")]",  # past MAX_DEPTH (32); it was read
    "[f(a=" + "+".join(["1"] * DEEP) + ")]",  # past MAX_SOURCE too
]
JSON_TOO_DEEP = [  # most raised RecursionError out of json.loads: a 500
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": ' + "[" * DEEP + "]" * DEEP + "}}</tool_call>"),
    ("hermes", '<tool_call>{"name": ' + "[" * DEEP + "]" * DEEP + "}</tool_call>"),
    ("hermes", "<tool_call>" + "[" * DEEP),
    ("llama3_json", '{"name": "f", "parameters": {"a": ' + "[" * DEEP + "]" * DEEP + "}}"),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"a": ' + "[" * DEEP + "]" * DEEP + "}"),
    ("required", '[{"name": "f", "parameters": {"a": ' + "[" * DEEP + "]" * DEEP + "}}]"),
    ("required", "[" * DEEP),
    ("named", '{"a": ' + "[" * DEEP + "]" * DEEP + "}"),
    ("named", "[" * DEEP),
]


def parser_for(family: str):
    return {"required": RequiredParser, "named": lambda: NamedParser("f")}.get(family, lambda: make_parser(family))()


def streamed_content(parser, output: str) -> tuple[str, list[dict]]:
    tools, content, calls = ToolStream(parser), "", []
    for at in range(0, len(output), 4096):
        fresh, deltas = tools.push(output[at : at + 4096], final=at + 4096 >= len(output))
        content, calls = content + fresh, calls + deltas
    return content, calls


@pytest.mark.parametrize("output", PYTHONIC_TOO_DEEP, ids=range(len(PYTHONIC_TOO_DEEP)))
def test_pythonic_calls_nested_too_deep_are_content(output):
    assert extract(make_parser("pythonic"), output) == (output, [])
    assert streamed_content(make_parser("pythonic"), output) == (output, [])


def test_pythonic_calls_past_the_size_bound_are_content():
    output = pythonic("write", {"text": "x" * 2_000_000})
    assert extract(make_parser("pythonic"), output) == (output, [])
    assert streamed_content(make_parser("pythonic"), output) == (output, [])


@pytest.mark.parametrize(("family", "output"), JSON_TOO_DEEP, ids=[f for f, _ in JSON_TOO_DEEP])
def test_json_calls_nested_too_deep_are_content(family, output):
    assert extract(parser_for(family), output) == (output, [])
    streamed_content(parser_for(family), output)  # no exception; what was streamed stays streamed


@pytest.mark.parametrize("output", ["[f(a={1})]", "[f(a=b'x')]", "[f(a=1j)]", "[f(a={[1]: 2})]", "[f(a={(1, 2): 3})]",
                                    "[f(a=1), g(b={**x})]"])
def test_pythonic_arguments_without_a_json_form_are_content(output):
    """Literals JSON has no form for raised TypeError or AttributeError: a 500."""
    assert extract(make_parser("pythonic"), output) == (output, [])
    assert streamed_content(make_parser("pythonic"), output)[0] == output
