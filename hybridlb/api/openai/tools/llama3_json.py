"""Llama 3.1 / 3.2 JSON calls: the whole output is ``{"name": ..., "parameters": {...}}``
(``arguments`` accepted too), optionally after ``<|python_tag|>``, several separated by
``;``. Output that does not start that way is content."""

from __future__ import annotations

from hybridlb.api.openai.tools.base import Scan, ToolParser
from hybridlb.api.openai.tools.json_calls import JsonCalls
from hybridlb.api.openai.tools.json_scan import skip_ws

TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    skip_special_tokens = False  # <|python_tag|> is a special token

    def reset(self) -> None:
        self.calls: JsonCalls | None = None  # once the output starts as calls
        self.is_content = False  # once it starts otherwise

    def scan(self, text: str, final: bool) -> Scan:
        if self.calls is None and not self.is_content:
            start = self._first_call(text, final)
            if isinstance(start, Scan):
                return start
            self.calls = JsonCalls(start, ("parameters", "arguments"), separators=";,", close=None)
        if self.is_content:
            return Scan(text)
        return Scan("", self.calls.advance(text, final))

    def _first_call(self, text: str, final: bool) -> int | Scan:
        """Where the first call's object begins; a Scan while that is not known, or for content."""
        start = skip_ws(text, 0)
        if text.startswith(TAG, start):
            start = skip_ws(text, start + len(TAG))
        elif not final and len(text) - start <= len(TAG) and TAG.startswith(text[start:]):
            return Scan("", undecided=True)
        if start >= len(text):
            return Scan("" if not final else text, undecided=True)
        if text[start] != "{":
            self.is_content = True  # decided by the output's start, which no later text changes
            return Scan(text)
        return start
