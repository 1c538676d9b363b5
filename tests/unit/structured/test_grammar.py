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
from hybridlb.params import Constraint, SamplingParams
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

        def size_of(self, compiled):
            return 0

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

        def size_of(self, compiled):
            return 0

    cache = GrammarCache(Picky, size=4)
    bad, good = cache.matcher(Constraint("regex", "bad")), cache.matcher(Constraint("regex", "good"))
    with pytest.raises(GrammarError, match="no"):
        bad.result(5)
    assert good.result(5) == "good"
    assert threading.active_count() < 50
    cache.close()


class _Gated:
    """A backend whose compilations wait for ``gate``; each compiled grammar 'holds' 100 bytes."""

    name = "gated"

    def __init__(self):
        self.gate, self.made = threading.Event(), []

    def compile(self, constraint):
        self.gate.wait(5)
        self.made.append(constraint.value)
        return constraint.value

    def matcher(self, compiled):
        return compiled

    def size_of(self, compiled):
        return 100


def test_an_aborted_request_drops_its_queued_compilation():
    """Compilations nobody waits for any more never run (a flood of distinct grammars, aborted)."""
    backend = _Gated()
    cache = GrammarCache(lambda: backend, size=8)
    first = cache.matcher(Constraint("regex", "a+"))  # runs: the thread waits on the gate
    queued = [cache.matcher(Constraint("regex", f"b{i}+")) for i in range(5)]
    shared = [cache.matcher(Constraint("regex", "c+")) for _ in range(2)]
    for future in queued:
        cache.cancel(future)
    cache.cancel(shared[0])  # the other request still waits for c+
    backend.gate.set()
    assert first.result(5) == "a+" and shared[1].result(5) == "c+"
    assert backend.made == ["a+", "c+"] and cache.cancelled == 5
    cache.close()


def test_the_cache_keeps_no_more_bytes_than_it_may():
    backend = _Gated()
    backend.gate.set()
    cache = GrammarCache(lambda: backend, size=100, max_bytes=250)
    for value in ("a+", "b+", "c+"):
        cache.matcher(Constraint("regex", value)).result(5)
    assert cache.held_bytes == 200
    assert cache.matcher(Constraint("regex", "c+")).done()  # kept
    cache.matcher(Constraint("regex", "a+")).result(5)  # evicted for c+: compiled again
    assert backend.made == ["a+", "b+", "c+", "a+"]
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


def test_a_grammar_that_does_not_compile_in_time_fails_its_request_and_is_not_compiled(tiny_qwen3):
    """engine.structured_outputs.compile_timeout_s: the request fails (400), and a compilation
    still queued for it is dropped."""
    from hybridlb.config import EngineConfig
    from hybridlb.engine.constraints import Constraints
    from hybridlb.engine.request import Request

    config = EngineConfig(model=tiny_qwen3, structured_outputs={"compile_timeout_s": 0.2})
    constraints = Constraints(config, 1024, 0, set())
    backend = _Gated()
    constraints.grammars = GrammarCache(lambda: backend, size=8)
    slow, queued = (Request(name, [1], SamplingParams(constraint=Constraint("regex", f"{name}+")), 4, None)
                    for name in ("slow", "queued"))
    for request in (slow, queued):
        constraints.add(request)
    time.sleep(0.3)
    ready, failed = constraints.admit()
    assert not ready and {(o.request_id, o.error_kind) for o in failed} == {("slow", "invalid"), ("queued", "invalid")}
    assert "compile_timeout_s" in failed[0].error and not constraints.compiling
    backend.gate.set()
    time.sleep(0.1)
    assert backend.made == ["slow+"]  # the one that had started; the queued one never ran
    constraints.grammars.close()
