"""The grammar layer without a server: constraints checked (the API's 400s), compiled once per
distinct constraint off the caller's thread, matchers that mask and finish."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from hybridlb.checkpoint.tokenizer import Tokenizer, read_eos_token_ids
from hybridlb.config import StructuredOutputsConfig
from hybridlb.grammar import GrammarCache, GrammarError, check, make_backend
from hybridlb.grammar.backend import ascii_digits, json_schema
from hybridlb.params import Constraint
from tests.conftest import SMOLLM2

OPTIONS = StructuredOutputsConfig()


@pytest.mark.parametrize(("constraint", "says"), [
    (Constraint("json", '{"type": "objectt"}'), "Invalid type"),
    (Constraint("json", '{"type": "integer", "minimum": 5, "maximum": 1}'), "minimum"),
    (Constraint("json", '{"$ref": "#/$defs/missing"}'), "missing"),
    (Constraint("json", '{"type": "object", '), "not JSON"),
    (Constraint("regex", "(ab"), "unclosed group"),
    (Constraint("regex", r"(a)\1"), "backreferences"),
    (Constraint("choice", "[]"), "non-empty list"),
    (Constraint("grammar", "start: foo"), "unknown name"),
    (Constraint("structural_tag", '{"structures": []}'), "structures"),
])
def test_a_constraint_the_library_refuses_says_why(constraint, says):
    with pytest.raises(GrammarError, match=says):
        check(constraint, OPTIONS)


def test_digits_mean_ascii_digits():
    assert ascii_digits(r"\d{3}-\d{4}") == "[0-9]{3}-[0-9]{4}"
    assert ascii_digits(r"[\d.]+\D") == "[0-9.]+[^0-9]"
    assert ascii_digits(r"\\d") == r"\\d"  # an escaped backslash, then a letter


def test_objects_with_properties_are_closed_unless_they_say_otherwise():
    def closed(schema: dict, **options) -> dict:
        return json_schema(Constraint("json", json.dumps(schema)), StructuredOutputsConfig(**options))

    person = {"type": "object", "properties": {"name": {"type": "string"}, "properties": {
        "type": "object", "properties": {"pattern": {"type": "string", "pattern": "\\d"}}}}}
    got = closed(person)
    assert got["additionalProperties"] is False
    assert got["properties"]["properties"]["additionalProperties"] is False  # a property named "properties"
    assert "additionalProperties" not in got["properties"]  # ... is not a schema
    assert got["properties"]["properties"]["properties"]["pattern"]["pattern"] == "[0-9]"
    assert "additionalProperties" not in closed({"type": "object"})  # JSON mode stays open
    assert closed({"type": "object", "properties": {}, "additionalProperties": True})["additionalProperties"] is True
    combined = closed({"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]})
    assert all("additionalProperties" not in member for member in combined["allOf"])
    assert "additionalProperties" not in closed(person, disable_additional_properties=False)
    request_opens = json_schema(Constraint("json", json.dumps(person), closed=False), OPTIONS)  # a request's own choice
    assert "additionalProperties" not in request_opens
    with pytest.raises(GrammarError, match="nested too deeply"):
        check(Constraint("json", '{"items":' * 100_000 + "{}" + "}" * 100_000), OPTIONS)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(SMOLLM2)


@pytest.fixture(scope="module", params=["llguidance", "xgrammar"])
def backend(request, tokenizer):
    """Both libraries the engine can use (``engine.structured_outputs.backend``)."""
    options = StructuredOutputsConfig(backend=request.param)
    return make_backend(options, tokenizer, tokenizer.vocab_size), tokenizer


def _allowed(matcher, vocab: int) -> set[int]:
    bitmask = np.zeros((1, (vocab + 31) // 32), dtype=np.int32)
    matcher.fill(bitmask, 0)
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, count=vocab, bitorder="little")[0]
    return set(np.flatnonzero(bits).tolist())


def test_a_matcher_allows_only_what_the_grammar_can_continue_with(backend):
    engine_backend, tokenizer = backend
    matcher = engine_backend.matcher(engine_backend.compile(Constraint("choice", json.dumps(["yes", "no"]))))
    allowed = _allowed(matcher, tokenizer.vocab_size)
    texts = {tokenizer.decode([t]) for t in allowed}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts), texts
    for token in tokenizer.encode("yes", add_special_tokens=False):
        assert not matcher.done
        assert matcher.accept(token)
    assert matcher.done  # nothing may follow "yes": the request finishes without waiting for eos


def test_each_distinct_constraint_compiles_once_and_requests_share_it():
    made = []

    class Slow:
        name = "slow"

        def compile(self, constraint):
            time.sleep(0.2)
            made.append(constraint.value)
            return constraint.value

        def matcher(self, compiled):
            return object()

    cache = GrammarCache(Slow, size=2)
    started = time.perf_counter()
    futures = [cache.matcher(Constraint("regex", "a+")) for _ in range(5)]
    assert time.perf_counter() - started < 0.1  # compiling happens on the grammar thread, not the caller's
    matchers = [f.result(5) for f in futures]
    assert made == ["a+"] and len({id(m) for m in matchers}) == 5  # one compile, a matcher per request
    assert cache.matcher(Constraint("regex", "a+")).done()  # cached: ready at once
    for value in ("b+", "c+"):
        cache.matcher(Constraint("regex", value)).result(5)
    cache.matcher(Constraint("regex", "a+")).result(5)  # evicted by the two newer ones: compiled again
    assert made == ["a+", "b+", "c+", "a+"]
    assert cache.compiled == 4 and cache.hits == 1
    cache.close()


def test_a_failed_compile_fails_only_its_requests():
    class Picky:
        name = "picky"

        def compile(self, constraint):
            if constraint.value == "bad":
                raise GrammarError("regex", "no")
            return constraint.value

        def matcher(self, compiled):
            return compiled

    cache = GrammarCache(Picky, size=4)
    bad, good = cache.matcher(Constraint("regex", "bad")), cache.matcher(Constraint("regex", "good"))
    with pytest.raises(GrammarError, match="no"):
        bad.result(5)
    assert good.result(5) == "good"
    assert threading.active_count() < 50
    cache.close()


def test_a_json_schema_matcher_takes_a_valid_document_and_refuses_a_wrong_key(backend):
    engine_backend, tokenizer = backend
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    compiled = engine_backend.compile(Constraint("json", json.dumps(schema)))
    matcher = engine_backend.matcher(compiled)
    for token in tokenizer.encode('{"name": "Ann", "age": 41}', add_special_tokens=False):
        assert token in _allowed(matcher, tokenizer.vocab_size)
        assert matcher.accept(token)
    assert matcher.done or not _allowed(matcher, tokenizer.vocab_size) - {*read_eos_token_ids(SMOLLM2)}
    wrong = engine_backend.matcher(compiled)
    prefix = tokenizer.encode('{"', add_special_tokens=False)
    for token in prefix:
        assert wrong.accept(token)
    bad = tokenizer.encode('{"colour', add_special_tokens=False)[len(prefix)]
    assert bad not in _allowed(wrong, tokenizer.vocab_size)  # closed object: no key beyond name and age
