"""Tool calls written as JSON objects (``{"name": ..., "arguments": {...}}``), alone or several
in a row, read as far as the text goes: the shared part of the Hermes, Llama 3, Mistral and
forced-call parsers. Like the scanners underneath, each reader goes on from where it stopped;
a call is read into a ``CallSoFar`` once it is whole, never again."""

from __future__ import annotations

import json

from hybridlb.api.openai.tools.base import CallSoFar
from hybridlb.api.openai.tools.json_scan import ObjectScan, skip_ws


class JsonCall:
    """The call in the object starting at ``text[start]``: its name and the raw JSON under the
    first of ``keys`` it has (``{}`` when a complete object has none)."""

    def __init__(self, start: int, keys: tuple[str, ...] = ("arguments",)):
        self.found = ObjectScan(start)
        self.keys = keys
        self.whole: CallSoFar | None = None  # the call, once its object has ended
        self._name_span: tuple[int, int | None] | None = None
        self._name: str | None = None

    @property
    def end(self) -> int | None:
        return self.found.end

    def advance(self, text: str, final: bool) -> CallSoFar:
        if self.whole is not None:
            return self.whole
        found = self.found.advance(text, final)
        key = next((k for k in self.keys if k in found.fields), self.keys[0])
        arguments = found.raw(text, key)
        if found.end is not None and arguments is None:
            arguments = "{}"
        call = CallSoFar(self._read_name(text), arguments or "", found.end is not None)
        if call.complete:
            self.whole = call
        return call

    def _read_name(self, text: str) -> str | None:
        span = self.found.fields.get("name")
        if span != self._name_span:  # parsed once whole (a repeated key starts it over)
            self._name_span, self._name = span, None
            if span is not None and span[1] is not None:
                if text[span[0]] in "[{":  # never a name, and json.loads would nest without bound
                    raise ValueError("a tool call's name must be a string")
                self._name = json.loads(text[span[0] : span[1]])
                if self._name is not None and not isinstance(self._name, str):
                    raise ValueError("a tool call's name must be a string")
        return self._name


class JsonCalls:
    """Calls one after another from ``text[at]``, the last one perhaps unfinished: the items of a
    JSON list (``at`` just past its ``[``, ``close`` its ``]``), or, with no ``close``, Llama 3's
    calls, which need one of ``separators`` between two."""

    def __init__(self, at: int, keys: tuple[str, ...], separators: str = ",", close: str | None = "]"):
        self.keys = keys
        self.separators = separators
        self.close = close
        self.calls: list[CallSoFar] = []  # the whole ones
        self._at = at
        self._current: JsonCall | None = None
        self._after_call = False  # a separator may come next
        self._closed = False

    def advance(self, text: str, final: bool) -> list[CallSoFar]:
        while not self._closed:
            if self._current is not None:
                call = self._current.advance(text, final)
                if not call.complete:
                    return [*self.calls, call]
                self.calls.append(call)
                self._at, self._current, self._after_call = self._current.end, None, True
            self._at = skip_ws(text, self._at)
            if self._at >= len(text):
                break
            if self._after_call and not self._separator(text):
                continue
            if text[self._at] == self.close:
                self._closed = True
            else:
                self._current = JsonCall(self._at, self.keys)
        return list(self.calls)

    def _separator(self, text: str) -> bool:
        """Past the separator after a call; False when the text ends right after it."""
        self._after_call = False
        if text[self._at] in self.separators:
            self._at = skip_ws(text, self._at + 1)
        elif self.close is None:
            raise ValueError(f"unexpected text after a call: {text[self._at:self._at + 20]!r}")
        return self._at < len(text)
