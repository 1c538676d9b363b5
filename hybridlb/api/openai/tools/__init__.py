"""Tool calls in a model's output, as OpenAI's API returns them.

A parser (one module per model family: ``hermes``, ``llama3_json``, ``mistral``,
``pythonic``; ``forced`` for the calls a grammar forced) reads the text generated so far
and says what is surely content and which calls it holds so far (``Scan``): each call's
name once it is whole and its arguments' JSON text so far, which only ever grows. A parser
goes on from where its last scan stopped, so a stream costs time linear in its length (it
runs on the API server's event loop); output nested deeper or longer than a parser reads
safely is content (``pythonic.MAX_SOURCE``, ``MAX_DEPTH``), never an error.
Both shapes of the response come from that one reading:

* ``extract(parser, text)``: the whole output as ``(content, tool_calls)``; text that does
  not parse as the family's calls is returned as content, as vLLM does;
* ``ToolStream``: chunk by chunk, the deltas the ``openai`` SDK accumulates (a call's first
  delta carries its index, id, type and name, the next ones fragments of its arguments).
"""

from __future__ import annotations

import json

from hybridlb.api.openai.tools.base import CallSoFar, Scan, ToolParser, content_before, held_back

__all__ = ["CallSoFar", "Scan", "ToolParser", "ToolStream", "content_before", "extract", "held_back", "make_parser"]


def _valid_arguments(arguments: str) -> bool:
    try:
        return isinstance(json.loads(arguments), dict)
    except (json.JSONDecodeError, RecursionError):  # RecursionError: nested deeper than json.loads goes
        return False


def extract(parser: ToolParser, text: str) -> tuple[str | None, list[dict]]:
    """The whole output as (content, tool_calls); (text, []) when it holds no well-formed calls."""
    parser.reset()
    try:
        scan = parser.scan(text, final=True)
    except ValueError:
        return text or None, []
    calls = scan.calls
    if not calls or any(c.name is None or not c.complete or not _valid_arguments(c.arguments) for c in calls):
        return text or None, []
    content = scan.content.strip()
    return content or None, [_call(parser.call_id(), c.name, c.arguments) for c in calls]


def _call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


class ToolStream:
    """One choice's streamed output: ``push`` each text delta, get (content delta, tool-call deltas)."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        parser.reset()
        self.text = ""
        self.content_sent = 0
        self.sent: list[list] = []  # per call: [id, characters of its arguments sent]
        self.settled = 0  # the calls before this one are whole and sent: a push skips them
        self.as_content = False  # the calls did not parse: everything from there on is content

    @property
    def called(self) -> bool:
        return bool(self.sent)

    def push(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        self.text += delta
        if self.as_content:
            return self._content(self.text), []
        try:
            scan = self.parser.scan(self.text, final)
        except ValueError:
            self.as_content = True
            return self._content(self.text), []
        if final and (scan.undecided or (scan.calls and not self.sent and any(c.name is None for c in scan.calls))):
            return self._content(self.text), []  # it never became a call: it was content
        deltas = []
        for index in range(self.settled, len(scan.calls)):
            call = scan.calls[index]
            if call.name is None:
                break  # a later call's deltas wait for this one's name
            if index == len(self.sent):
                call_id = self.parser.call_id()
                self.sent.append([call_id, 0])
                deltas.append({"index": index, "id": call_id, "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            fresh = call.arguments[self.sent[index][1] :]
            if fresh:
                self.sent[index][1] = len(call.arguments)
                deltas.append({"index": index, "function": {"arguments": fresh}})
            if call.complete and index == self.settled:
                self.settled += 1
        return self._content(scan.content), deltas

    def _content(self, content: str) -> str:
        fresh = content[self.content_sent :]
        self.content_sent = max(self.content_sent, len(content))
        return fresh


def make_parser(name: str) -> ToolParser:
    from hybridlb.api.openai.tools import hermes, llama3_json, mistral, pythonic

    parsers = {"hermes": hermes.HermesParser, "llama3_json": llama3_json.Llama3JsonParser,
               "mistral": mistral.MistralParser, "pythonic": pythonic.PythonicParser}
    return parsers[name]()
