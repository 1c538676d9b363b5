"""A request's structured-output fields, in any of their spellings, as the one ``Constraint``
its engine compiles: OpenAI's ``response_format``, vLLM's ``structured_outputs`` and the
older ``guided_*`` fields, and the grammar a forced tool call needs (``tools.forced_constraint``).

A request may ask for one constraint. Each is checked here with the server's grammar
backend (``hybridlb.grammar.check``, cached per distinct constraint): a schema, regex or
grammar the library refuses is a 400 naming the field and quoting the library, before any
engine sees the request.
"""

from __future__ import annotations

import functools
import json

from hybridlb.api.errors import APIError
from hybridlb.api.openai.schemas import SamplingRequest
from hybridlb.config import StructuredOutputsConfig
from hybridlb.grammar import GrammarError, check
from hybridlb.params import Constraint

ANY_JSON_OBJECT = '{"type": "object"}'


def requested(body: SamplingRequest, backend: str) -> tuple[str, Constraint] | None:
    """(the field that asked, its constraint) or None; a 400 when more than one field asks."""
    found: list[tuple[str, Constraint]] = []
    fmt = body.response_format
    if fmt is not None and fmt.type != "text":
        found.append(("response_format", _response_format(fmt)))
    so = body.structured_outputs
    if so is not None:
        found += _structured_outputs(so)
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        value = getattr(body, name)
        if value is not None:
            found.append((name, Constraint(kind, _text(value, kind))))
    if body.guided_decoding_backend not in (None, "auto", backend):
        raise APIError(400, f"guided_decoding_backend {body.guided_decoding_backend!r}: this server compiles "
                            f"grammars with {backend}; drop the field", param="guided_decoding_backend")
    if len(found) > 1:
        raise APIError(400, f"one output constraint per request; this one sets {', '.join(f for f, _ in found)}",
                       param=found[1][0])
    return found[0] if found else None


def _text(value, kind: str) -> str:
    if kind == "json":
        return value if isinstance(value, str) else json.dumps(value)
    if kind == "choice":
        return json.dumps(value)
    return value


def _response_format(fmt) -> Constraint:
    if fmt.type == "json_object":
        return Constraint("json", ANY_JSON_OBJECT)
    if fmt.type == "structural_tag":
        if not fmt.structures or not fmt.triggers:
            raise APIError(400, "a structural_tag response_format needs structures and triggers",
                           param="response_format")
        return Constraint("structural_tag", json.dumps({"structures": fmt.structures, "triggers": fmt.triggers}))
    spec = fmt.json_schema
    if spec is None:
        raise APIError(400, "response_format of type json_schema needs json_schema: {name, schema}",
                       param="response_format.json_schema")
    return Constraint("json", json.dumps(spec.schema_) if spec.schema_ is not None else ANY_JSON_OBJECT)


def _structured_outputs(so) -> list[tuple[str, Constraint]]:
    found = []
    values = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
              "structural_tag": so.structural_tag}
    for kind, value in values.items():
        if value is not None:
            found.append((f"structured_outputs.{kind}", Constraint(kind, _text(value, kind))))
    if so.json_object:
        found.append(("structured_outputs.json_object", Constraint("json", ANY_JSON_OBJECT)))
    if not found:
        raise APIError(400, "structured_outputs needs one of json, regex, choice, grammar, json_object, "
                            "structural_tag", param="structured_outputs")
    compact, closed = so.disable_any_whitespace, so.disable_additional_properties
    return [(field, Constraint(c.kind, c.value, compact=compact, closed=closed)) for field, c in found]


def constraint_for(body: SamplingRequest, options: StructuredOutputsConfig) -> Constraint | None:
    """The request's checked constraint, or None."""
    asked = requested(body, _backend(options))
    if asked is None:
        return None
    field, constraint = asked
    validate(constraint, options, field)
    return constraint


def validate(constraint: Constraint, options: StructuredOutputsConfig, field: str) -> None:
    if (problem := constraint.problem()) is not None:
        raise APIError(400, f"{field}: {problem}", param=field)
    error = _checked(constraint.kind, constraint.value, constraint.compact, constraint.closed, options)
    if error is not None:
        raise APIError(400, f"{field}: {error}", param=field)


def _backend(options: StructuredOutputsConfig) -> str:
    return "xgrammar" if options.backend == "xgrammar" else "llguidance"


@functools.lru_cache(maxsize=512)
def _checked(kind: str, value: str, compact: bool, closed: bool, options: StructuredOutputsConfig) -> str | None:
    """The library's complaint about a constraint, or None (cached: clients resend the same schemas)."""
    try:
        check(Constraint(kind, value, compact=compact, closed=closed), options)
    except GrammarError as exc:
        return str(exc)
    return None
