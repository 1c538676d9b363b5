"""The grammar libraries behind one small interface.

A ``Backend`` compiles a ``Constraint`` once (the engine caches the result per constraint)
and makes a ``Matcher`` per request from it. Each step the engine asks every constrained
request's matcher to ``fill`` its row of a token bitmask (int32 words, bit ``t % 32`` of
word ``t // 32`` set when token ``t`` is allowed), masks the logits with it, samples, and
tells the matcher the token (``accept``). ``done`` says the grammar is complete and cannot
go on: the request finishes with ``stop``.

``check`` validates a constraint without a tokenizer (the API server's 400, before any
engine sees the request); a constraint it accepts compiles in the engine.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import numpy as np

    from hybridlb.checkpoint.tokenizer import Tokenizer
    from hybridlb.config import StructuredOutputsConfig
    from hybridlb.params import Constraint



# Between JSON tokens: a space, or a line break and an indent. Unbounded whitespace (JSON's
# own rule) lets a small model write newlines until max_tokens: SmolLM2-135M, forced to call a
# tool, did so in 2 of 3 tries, and in none with this rule.
WHITESPACE = r"[ ]?|\n[ ]{0,20}"
MAX_WHITESPACE = 21


class GrammarError(ValueError):
    """A constraint the grammar library refuses, with its message."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{_WHAT[kind]} cannot be compiled: {message.strip()}")
        self.kind = kind


_WHAT = {"json": "the JSON schema", "regex": "the regex", "choice": "the choice list", "grammar": "the grammar",
         "structural_tag": "the structural tag"}


class Matcher(Protocol):
    def fill(self, bitmask: np.ndarray, row: int) -> None: ...
    def accept(self, token: int) -> bool: ...
    @property
    def done(self) -> bool: ...


class Backend(Protocol):
    name: str

    def compile(self, constraint: Constraint) -> object: ...
    def matcher(self, compiled: object) -> Matcher: ...
    def size_of(self, compiled: object) -> int: ...


def _choice(request: bool | None, server: bool) -> bool:
    """A request's own setting, else the server's."""
    return server if request is None else request


def json_schema(constraint: Constraint, options: StructuredOutputsConfig) -> dict | bool:
    """The schema of a ``json`` constraint with the server's options applied."""
    try:
        schema = json.loads(constraint.value)
    except json.JSONDecodeError as exc:
        raise GrammarError("json", f"not JSON: {exc}") from None
    except RecursionError:
        raise GrammarError("json", "nested too deeply") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError("json", f"a schema is a JSON object, got {type(schema).__name__}")
    try:
        if _choice(constraint.closed, options.disable_additional_properties):
            _close_objects(schema)
        _ascii_patterns(schema)
    except RecursionError:
        raise GrammarError("json", "nested too deeply") from None
    return schema


def _close_objects(schema: object) -> None:
    """disable_additional_properties: every object schema that lists properties and does not
    say otherwise gets ``additionalProperties: false`` (``{"type": "object"}`` stays open)."""
    nodes = list(_subschemas(schema))
    # allOf's members combine: closing each would forbid the others' keys
    combined = {id(member) for node in nodes if isinstance(node.get("allOf"), list) for member in node["allOf"]}
    for node in nodes:
        if isinstance(node.get("properties"), dict) and "additionalProperties" not in node and id(node) not in combined:
            node["additionalProperties"] = False


def _subschemas(schema: object):
    """Every schema object inside ``schema`` (itself included), by JSON Schema's keywords: a
    property named ``pattern`` or ``properties`` is a name, not a keyword."""
    if not isinstance(schema, dict):
        return
    yield schema
    for key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
        if isinstance(schema.get(key), dict):
            for value in schema[key].values():
                yield from _subschemas(value)
    for key in ("items", "prefixItems", "anyOf", "oneOf", "allOf"):
        value = schema.get(key)
        for item in value if isinstance(value, list) else [value]:
            yield from _subschemas(item)
    for key in ("additionalProperties", "additionalItems", "unevaluatedProperties", "contains", "not", "if",
                "then", "else", "propertyNames"):
        yield from _subschemas(schema.get(key))


def ascii_digits(regex: str) -> str:
    """``regex`` with ``\\d`` meaning 0-9. The libraries read it as Unicode's digits (hundreds of
    characters: a model asked for a phone number may write 🯵🯵🯵), which nobody asking for
    digits means."""
    out, i, in_class = [], 0, False
    while i < len(regex):
        char = regex[i]
        if char == "\\" and i + 1 < len(regex):
            escaped = regex[i + 1]
            if escaped == "d":
                out.append("0-9" if in_class else "[0-9]")
            elif escaped == "D" and not in_class:
                out.append("[^0-9]")
            else:
                out.append(regex[i : i + 2])
            i += 2
            continue
        if char == "[" and not in_class:
            in_class = True
            out.append(char)
            if regex[i + 1 : i + 2] == "^":
                out.append("^")
                i += 1
            if regex[i + 1 : i + 2] == "]":  # a leading ] is a literal
                out.append("]")
                i += 1
        elif char == "]" and in_class:
            in_class = False
            out.append(char)
        else:
            out.append(char)
        i += 1
    return "".join(out)


def _ascii_patterns(schema: object) -> None:
    for node in _subschemas(schema):
        if isinstance(node.get("pattern"), str):
            node["pattern"] = ascii_digits(node["pattern"])


def choices(constraint: Constraint) -> list[str]:
    try:
        values = json.loads(constraint.value)
    except json.JSONDecodeError as exc:
        raise GrammarError("choice", f"not JSON: {exc}") from None
    if not isinstance(values, list) or not values or not all(isinstance(v, str) for v in values):
        raise GrammarError("choice", "give a non-empty list of strings")
    return values


def structural_tags(constraint: Constraint) -> tuple[list[str], list[dict]]:
    """vLLM's structural tag: ``{"type": "structural_tag", "structures": [{"begin", "schema",
    "end"}, ...], "triggers": [...]}`` as (triggers, structures)."""
    try:
        tag = json.loads(constraint.value)
    except json.JSONDecodeError as exc:
        raise GrammarError("structural_tag", f"not JSON: {exc}") from None
    structures = tag.get("structures") if isinstance(tag, dict) else None
    triggers = tag.get("triggers") if isinstance(tag, dict) else None
    if not isinstance(structures, list) or not structures or not isinstance(triggers, list) or not triggers:
        raise GrammarError("structural_tag", 'give {"structures": [{"begin", "schema", "end"}, ...], '
                                             '"triggers": [...]}')
    for structure in structures:
        if not isinstance(structure, dict) or not {"begin", "end"} <= structure.keys():
            raise GrammarError("structural_tag", "each structure needs begin, schema and end")
        if not any(isinstance(t, str) and structure["begin"].startswith(t) for t in triggers):
            raise GrammarError("structural_tag", f"begin {structure['begin']!r} starts with none of the triggers")
    return triggers, structures


# -- llguidance ---------------------------------------------------------------------------
def llguidance_grammar(constraint: Constraint, options: StructuredOutputsConfig) -> str:
    """The llguidance grammar of a constraint (not yet validated)."""
    import llguidance

    kind, value = constraint.kind, constraint.value
    if kind == "json":
        if _choice(constraint.compact, options.disable_any_whitespace):
            layout = {"whitespace_flexible": False}
        else:
            layout = {"whitespace_pattern": WHITESPACE}
        return llguidance.LLMatcher.grammar_from_json_schema(json_schema(constraint, options), defaults=layout)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(ascii_digits(value))
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(choices(constraint)))
    if kind == "grammar":
        try:
            return llguidance.grammar_from("grammar", value)
        except Exception as exc:  # GBNF it cannot translate
            raise GrammarError(kind, str(exc)) from None
    triggers, structures = structural_tags(constraint)
    tags = [llguidance.StructTag(trigger=next(t for t in triggers if s["begin"].startswith(t)), begin=s["begin"],
                                 grammar=s.get("schema", {}), end=s["end"]) for s in structures]
    return llguidance.StructTag.to_grammar(tags)


def check(constraint: Constraint, options: StructuredOutputsConfig) -> None:
    """Raise GrammarError if ``constraint`` cannot compile (no tokenizer needed)."""
    xgr = _xgrammar() if options.backend == "xgrammar" else None
    try:  # a library's complaint while building, whatever its type (e.g. a schema of `false`): the request's fault
        if xgr is not None:
            _xgrammar_grammar(xgr, constraint, options)
            return
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(llguidance_grammar(constraint, options))
    except GrammarError:
        raise
    except Exception as exc:
        raise GrammarError(constraint.kind, str(exc)) from None
    if error:
        raise GrammarError(constraint.kind, error)


class _LLGuidanceMatcher:
    def __init__(self, matcher):
        self._m = matcher

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        words = bitmask[row]
        self._m.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)

    def accept(self, token: int) -> bool:
        return self._m.consume_token(token)

    @property
    def done(self) -> bool:
        return self._m.is_stopped()


class LLGuidanceBackend:
    name = "llguidance"

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, options: StructuredOutputsConfig):
        import llguidance

        self._llg = llguidance
        self.options = options
        self.tokenizer = llguidance.LLTokenizer(tokenizer.rust.to_str(), n_vocab=vocab_size,
                                                eos_token=tokenizer.eos_token_ids or None)

    def compile(self, constraint: Constraint):
        matcher = self._llg.LLMatcher(self.tokenizer, llguidance_grammar(constraint, self.options), log_level=0)
        if matcher.is_error():
            raise GrammarError(constraint.kind, matcher.get_error())
        return matcher  # a template: each request gets a copy

    def matcher(self, compiled) -> Matcher:
        return _LLGuidanceMatcher(compiled.deep_copy())

    def size_of(self, compiled) -> int:
        """0: llguidance does not say; its own limits (lexer states, grammar size) bound each one."""
        return 0


# -- xgrammar -----------------------------------------------------------------------------
def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise GrammarError("json", "the xgrammar backend is not installed (pip install 'hybridlb[xgrammar]'), "
                                   "or choose the llguidance backend") from None
    return xgrammar


def _xgrammar_grammar(xgr, constraint: Constraint, options: StructuredOutputsConfig):
    kind, value = constraint.kind, constraint.value
    if kind == "json":
        schema = json_schema(constraint, options)
        compact = _choice(constraint.compact, options.disable_any_whitespace)
        return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=not compact, strict_mode=False,
                                            max_whitespace_cnt=None if compact else MAX_WHITESPACE)
    if kind == "regex":
        return xgr.Grammar.from_regex(ascii_digits(value))
    if kind == "choice":
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in choices(constraint)))
    if kind == "grammar":
        return xgr.Grammar.from_ebnf(value)
    triggers, structures = structural_tags(constraint)
    tags = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"])
            for s in structures]
    return xgr.Grammar.from_structural_tag(tags, triggers)


class _XGrammarMatcher:
    def __init__(self, matcher, stop_token_ids: list[int], vocab_size: int):
        self._m = matcher
        self._stops = stop_token_ids
        self._vocab_size = vocab_size

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        import torch  # xgrammar fills torch tensors; only engines (which have torch) get here

        self._m.fill_next_token_bitmask(torch.from_numpy(bitmask), row)

    def accept(self, token: int) -> bool:
        return self._m.accept_token(token)

    @property
    def done(self) -> bool:
        """Terminated, or complete with only a stop token allowed next (xgrammar waits for that
        token; llguidance stops by itself: the same answer from both)."""
        if self._m.is_terminated():
            return True
        if not self._m.is_completed():
            return False
        import numpy as np

        bitmask = np.zeros((1, (self._vocab_size + 31) // 32), dtype=np.int32)
        self.fill(bitmask, 0)
        words = bitmask[0].view(np.uint32).copy()
        for token in self._stops:
            words[token // 32] &= ~np.uint32(1 << (token % 32))
        return not words.any()


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, options: StructuredOutputsConfig):
        xgr = _xgrammar()
        self._xgr = xgr
        self.options = options
        rust = tokenizer.rust
        eos = set(tokenizer.eos_token_ids)
        spec = json.loads(rust.to_str())
        special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
        # Special tokens other than eos never match text: blank them (xgrammar would take their text literally).
        vocab = ["" if i in special and i not in eos else (rust.id_to_token(i) or "") for i in range(vocab_size)]
        info = xgr.TokenizerInfo(vocab, _vocab_type(xgr, spec), vocab_size=vocab_size, stop_token_ids=sorted(eos))
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._stops, self._vocab_size = sorted(eos), vocab_size

    def compile(self, constraint: Constraint):
        try:
            return self._compiler.compile_grammar(_xgrammar_grammar(self._xgr, constraint, self.options))
        except GrammarError:
            raise
        except Exception as exc:
            raise GrammarError(constraint.kind, str(exc)) from None

    def matcher(self, compiled) -> Matcher:
        return _XGrammarMatcher(self._xgr.GrammarMatcher(compiled), self._stops, self._vocab_size)

    def size_of(self, compiled) -> int:
        return compiled.memory_size_bytes


def _vocab_type(xgr, spec: dict):
    decoder = json.dumps(spec.get("decoder") or {})
    if '"ByteLevel"' in decoder:
        return xgr.VocabType.BYTE_LEVEL
    if '"ByteFallback"' in decoder:
        return xgr.VocabType.BYTE_FALLBACK
    return xgr.VocabType.RAW


def make_backend(options: StructuredOutputsConfig, tokenizer: Tokenizer, vocab_size: int) -> Backend:
    """The engine's backend (``vocab_size``: the model's logits, which may exceed the tokenizer's)."""
    if options.backend == "xgrammar":
        return XGrammarBackend(tokenizer, vocab_size, options)
    return LLGuidanceBackend(tokenizer, vocab_size, options)
