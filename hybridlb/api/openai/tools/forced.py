"""Calls a grammar forced (``tool_choice`` required or a named function), as vLLM forces them:

* a named function: the output is its arguments object, valid against its ``parameters``;
* required: the output is a JSON list ``[{"name": ..., "parameters": {...}}, ...]`` of at
  least one call (at most one without ``parallel_tool_calls``), each naming a given tool
  with arguments valid against that tool's schema.

``constraint`` builds the JSON schema the engine compiles; the parsers read the output back.
"""

from __future__ import annotations

import json

from hybridlb.api.openai.tools.base import CallSoFar, Scan, ToolParser
from hybridlb.api.openai.tools.json_calls import JsonCalls
from hybridlb.api.openai.tools.json_scan import skip_ws

ANY_OBJECT = {"type": "object"}


def arguments_schema(tool) -> dict:
    """A tool's ``parameters`` (no parameters: an empty object)."""
    return tool.function.parameters if tool.function.parameters is not None else {"type": "object", "properties": {}}


def named_schema(tool) -> dict:
    return arguments_schema(tool)


def required_schema(tools: list, parallel: bool) -> dict:
    calls = [{"type": "object", "properties": {"name": {"const": tool.function.name},
                                               "parameters": arguments_schema(tool)},
              "required": ["name", "parameters"], "additionalProperties": False} for tool in tools]
    schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def schema_text(schema: dict) -> str:
    return json.dumps(schema)


class NamedParser(ToolParser):
    name = "named"

    def __init__(self, function: str):
        self.function = function
        super().__init__()

    def scan(self, text: str, final: bool) -> Scan:
        return Scan("", [CallSoFar(self.function, text.strip() if final else text.lstrip(), final)])


class RequiredParser(ToolParser):
    name = "required"

    def reset(self) -> None:
        self.calls: JsonCalls | None = None  # once the list has begun

    def scan(self, text: str, final: bool) -> Scan:
        if self.calls is None:
            at = skip_ws(text, 0)
            if at >= len(text):
                return Scan("")
            if text[at] != "[":
                raise ValueError("expected a list of calls")
            self.calls = JsonCalls(at + 1, ("parameters",))
        return Scan("", self.calls.advance(text, final))
