"""Hermes-style calls (Qwen2.5, Qwen3, SmolLM3, Hermes 2/3): each call is a JSON object
``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``; text
before the first call is content."""

from __future__ import annotations

from hybridlb.api.tools.base import Scan, ToolParser, content_before
from hybridlb.api.tools.json_calls import json_call
from hybridlb.api.tools.json_scan import scan_object, skip_ws

START = "<tool_call>"


class HermesParser(ToolParser):
    name = "hermes"

    def scan(self, text: str, final: bool) -> Scan:
        first = text.find(START)
        if first < 0:
            return Scan(content_before(text, START, final))
        calls = []
        at = first
        while at >= 0:
            start = skip_ws(text, at + len(START))
            if start >= len(text):
                break
            found = scan_object(text, start, final)
            calls.append(json_call(text, found))
            if found.end is None:
                break
            at = text.find(START, found.end)
        return Scan(text[:first], calls)
