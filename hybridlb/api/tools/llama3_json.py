"""Llama 3.1 / 3.2 JSON calls: the whole output is ``{"name": ..., "parameters": {...}}``
(``arguments`` accepted too), optionally after ``<|python_tag|>``, several separated by
``;``. Output that does not start that way is content."""

from __future__ import annotations

from hybridlb.api.tools.base import Scan, ToolParser
from hybridlb.api.tools.json_calls import json_call
from hybridlb.api.tools.json_scan import scan_object, skip_ws

TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    skip_special_tokens = False  # <|python_tag|> is a special token

    def scan(self, text: str, final: bool) -> Scan:
        start = skip_ws(text, 0)
        rest = text[start:]
        if rest.startswith(TAG):
            start = skip_ws(text, start + len(TAG))
        elif not final and (not rest or TAG.startswith(rest)):
            return Scan("", undecided=True)
        if start >= len(text):
            return Scan("" if not final else text, undecided=True)
        if text[start] != "{":
            return Scan(text)
        calls = []
        while start < len(text):
            found = scan_object(text, start, final)
            calls.append(json_call(text, found, ("parameters", "arguments")))
            if found.end is None:
                break
            start = skip_ws(text, found.end)
            if start < len(text) and text[start] in ";,":
                start = skip_ws(text, start + 1)
            elif start < len(text):
                raise ValueError(f"unexpected text after a call: {text[start:start + 20]!r}")
        return Scan("", calls)
