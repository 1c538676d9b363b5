"""Mistral calls: ``[TOOL_CALLS]`` then a JSON list ``[{"name": ..., "arguments": {...}}, ...]``
(v3 tokenizers), or ``[TOOL_CALLS]name[ARGS]{...}`` per call (v11 and later). Text before the
first marker is content. Call ids are 9 letters and digits, as Mistral's templates require."""

from __future__ import annotations

import secrets
import string

from hybridlb.api.openai.tools.base import CallSoFar, MarkerSearch, Scan, ToolParser, content_before
from hybridlb.api.openai.tools.json_calls import JsonCalls
from hybridlb.api.openai.tools.json_scan import ValueScan, skip_ws

MARK = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_ID_CHARS = string.ascii_letters + string.digits


class MistralParser(ToolParser):
    name = "mistral"
    skip_special_tokens = False  # [TOOL_CALLS] is a special token

    def reset(self) -> None:
        self.search = MarkerSearch(MARK)
        self.first: int | None = None  # where the first marker is
        self.content = ""  # the text before it
        self.calls: JsonCalls | NamedCalls | None = None  # once the first call's form is known

    def call_id(self) -> str:
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))

    def scan(self, text: str, final: bool) -> Scan:
        if self.first is None:
            self.first = self.search.find(text)
            if self.first < 0:
                self.first = None
                return Scan(content_before(text, MARK, final))
            self.content = text[: self.first]
        if self.calls is None:
            start = skip_ws(text, self.first + len(MARK))
            if start >= len(text):
                return Scan(self.content)
            self.calls = JsonCalls(start + 1, ("arguments",)) if text[start] == "[" else NamedCalls(self.first)
        return Scan(self.content, self.calls.advance(text, final))


class NamedCalls:
    """``[TOOL_CALLS]name[ARGS]{...}`` calls from the marker at ``text[at]`` on, the last one
    perhaps unfinished."""

    def __init__(self, at: int):
        self.calls: list[CallSoFar] = []  # the whole ones
        self.name_start: int | None = at + len(MARK)  # None: looking for the next marker
        self.args = MarkerSearch(ARGS, at + len(MARK))
        self.marks = MarkerSearch(MARK)
        self.name = ""
        self.arguments: ValueScan | None = None  # the current call's, once past [ARGS]
        self.arguments_at: int | None = None  # where they may begin, before any text is there

    def advance(self, text: str, final: bool) -> list[CallSoFar]:
        while True:
            if self.arguments is not None:
                end = self.arguments.advance(text, final)
                start = self.arguments.start
                if end is None:
                    return [*self.calls, CallSoFar(self.name, text[start:])]
                self.calls.append(CallSoFar(self.name, text[start:end], True))
                self.arguments, self.marks.start = None, end
            if self.name_start is None:
                at = self.marks.find(text)
                if at < 0:
                    return list(self.calls)
                self.name_start = at + len(MARK)
                self.args = MarkerSearch(ARGS, self.name_start)
            if self.arguments_at is None and not self._read_name(text, final):
                return list(self.calls)
            self.arguments_at = skip_ws(text, self.arguments_at)
            if self.arguments_at >= len(text):
                return [*self.calls, CallSoFar(self.name, "")]
            self.arguments, self.arguments_at, self.name_start = ValueScan(self.arguments_at), None, None

    def _read_name(self, text: str, final: bool) -> bool:
        """The name up to [ARGS]; False while [ARGS] has not come."""
        args_at = self.args.find(text)
        if args_at < 0:
            if final:
                raise ValueError(f"{MARK} without {ARGS}")
            return False
        self.name, self.arguments_at = text[self.name_start : args_at].strip(), args_at + len(ARGS)
        return True
