"""Hermes-style calls (Qwen2.5, Qwen3, SmolLM3, Hermes 2/3): each call is a JSON object
``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``; text
before the first call is content."""

from __future__ import annotations

from hybridlb.api.openai.tools.base import CallSoFar, MarkerSearch, Scan, ToolParser, content_before
from hybridlb.api.openai.tools.json_calls import JsonCall
from hybridlb.api.openai.tools.json_scan import skip_ws

START = "<tool_call>"


class HermesParser(ToolParser):
    name = "hermes"

    def reset(self) -> None:
        self.search = MarkerSearch(START)  # for the next call's marker
        self.content: str | None = None  # the text before the first marker, once there
        self.calls: list[CallSoFar] = []  # the whole ones
        self.current: JsonCall | None = None
        self.object_at: int | None = None  # where the next call's object may begin, after a marker

    def scan(self, text: str, final: bool) -> Scan:
        if self.content is None:
            first = self.search.find(text)
            if first < 0:
                return Scan(content_before(text, START, final))
            self.content, self.object_at = text[:first], first + len(START)
        return Scan(self.content, self._calls(text, final))

    def _calls(self, text: str, final: bool) -> list[CallSoFar]:
        while True:
            if self.current is not None:
                call = self.current.advance(text, final)
                if not call.complete:
                    return [*self.calls, call]
                self.calls.append(call)
                self.search.start, self.current = self.current.end, None
            if self.object_at is None:
                at = self.search.find(text)
                if at < 0:
                    return list(self.calls)
                self.object_at = at + len(START)
            self.object_at = skip_ws(text, self.object_at)
            if self.object_at >= len(text):
                return list(self.calls)
            self.current, self.object_at = JsonCall(self.object_at), None
