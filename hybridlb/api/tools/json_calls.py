"""Tool calls written as JSON objects (``{"name": ..., "arguments": {...}}``), alone or in a
list, read as far as the text goes: the shared part of the Hermes, Llama 3, Mistral and
forced-call parsers."""

from __future__ import annotations

from hybridlb.api.tools.base import CallSoFar
from hybridlb.api.tools.json_scan import ObjectScan, scan_object, skip_ws


def json_call(text: str, found: ObjectScan, keys: tuple[str, ...] = ("arguments",)) -> CallSoFar:
    """The call in a scanned object: its name and the raw JSON under the first of ``keys`` it
    has (``{}`` when a complete object has none)."""
    name = found.value(text, "name") if "name" in found.fields else None
    if name is not None and not isinstance(name, str):
        raise ValueError("a tool call's name must be a string")
    key = next((k for k in keys if k in found.fields), keys[0])
    arguments = found.raw(text, key)
    if found.end is not None and arguments is None:
        arguments = "{}"
    return CallSoFar(name, arguments or "", found.end is not None)


def json_call_list(text: str, at: int, final: bool, keys: tuple[str, ...] = ("arguments",)) -> list[CallSoFar]:
    """The calls of a JSON list whose ``[`` is at ``text[at]``, the last one perhaps unfinished."""
    calls = []
    at = skip_ws(text, at + 1)
    while at < len(text) and text[at] != "]":
        found = scan_object(text, at, final)
        calls.append(json_call(text, found, keys))
        if found.end is None:
            break
        at = skip_ws(text, found.end)
        if at < len(text) and text[at] == ",":
            at = skip_ws(text, at + 1)
    return calls
