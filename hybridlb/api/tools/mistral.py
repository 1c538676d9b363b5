"""Mistral calls: ``[TOOL_CALLS]`` then a JSON list ``[{"name": ..., "arguments": {...}}, ...]``
(v3 tokenizers), or ``[TOOL_CALLS]name[ARGS]{...}`` per call (v11 and later). Text before the
first marker is content. Call ids are 9 letters and digits, as Mistral's templates require."""

from __future__ import annotations

import secrets
import string

from hybridlb.api.tools.base import CallSoFar, Scan, ToolParser, content_before
from hybridlb.api.tools.json_calls import json_call_list
from hybridlb.api.tools.json_scan import skip_ws, value_end

MARK = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_ID_CHARS = string.ascii_letters + string.digits


class MistralParser(ToolParser):
    name = "mistral"
    skip_special_tokens = False  # [TOOL_CALLS] is a special token

    def call_id(self) -> str:
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))

    def scan(self, text: str, final: bool) -> Scan:
        first = text.find(MARK)
        if first < 0:
            return Scan(content_before(text, MARK, final))
        start = skip_ws(text, first + len(MARK))
        if start >= len(text):
            return Scan(text[:first])
        calls = json_call_list(text, start, final) if text[start] == "[" else self._named(text, first, final)
        return Scan(text[:first], calls)

    def _named(self, text: str, at: int, final: bool) -> list[CallSoFar]:
        calls = []
        while at >= 0:
            name_start = at + len(MARK)
            args_at = text.find(ARGS, name_start)
            if args_at < 0:
                if final:
                    raise ValueError(f"{MARK} without {ARGS}")
                break
            name = text[name_start:args_at].strip()
            start = skip_ws(text, args_at + len(ARGS))
            end = value_end(text, start, final) if start < len(text) else None
            calls.append(CallSoFar(name, text[start:end] if end is not None else text[start:], end is not None))
            if end is None:
                break
            at = text.find(MARK, end)
        return calls
