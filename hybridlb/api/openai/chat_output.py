"""How one chat choice's generated text becomes the assistant message's fields: the
reasoning split off (``reasoning.py``), tool calls read out of the rest (``tools/``), the
echoed last message in front. ``ChatShape.whole`` does it for a whole response,
``ChatShape.push`` chunk by chunk for a stream; both read the text the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridlb.api.openai import reasoning
from hybridlb.api.openai.tools import ToolParser, ToolStream, extract


@dataclass(frozen=True)
class ChatOutput:
    """What a chat job does with its choices' text (one per job; ``shape()`` per choice)."""

    reasoning_parser: str | None = None
    tool_parser: type[ToolParser] | None = None
    tool_parser_args: tuple = ()
    include_reasoning: bool = True
    echo: str = ""  # the last message's text, shown before the output (chat echo)
    thinking: bool = False  # the prompt opened <think>: the output starts as reasoning

    def shape(self) -> ChatShape:
        parser = self.tool_parser(*self.tool_parser_args) if self.tool_parser is not None else None
        return ChatShape(self, parser)


class ChatShape:
    def __init__(self, output: ChatOutput, parser: ToolParser | None):
        self.output = output
        self.parser = parser
        self.reasoning = reasoning.ReasoningStream(output.reasoning_parser, output.thinking) \
            if output.reasoning_parser else None
        self.tools = ToolStream(parser) if parser is not None else None
        self.echoed = False

    def whole(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """(the message, the choice's finish reason) for the whole output."""
        thought, content = (reasoning.split(self.output.reasoning_parser, text, self.output.thinking)
                            if self.output.reasoning_parser else (None, text))
        message: dict = {"role": "assistant", "content": content}
        if self.parser is not None:
            message["content"], calls = extract(self.parser, content or "")
            if calls:
                message["tool_calls"] = calls
                finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        if self.output.echo:
            message["content"] = self.output.echo + (message["content"] or "")
        if self.output.reasoning_parser and self.output.include_reasoning:
            message["reasoning_content"] = thought
        return message, finish_reason

    def push(self, text: str, final: bool) -> dict:
        """The delta fields for new text (``final``: the output ended); empty when nothing is sure yet."""
        thought, content = self.reasoning.push(text, final) if self.reasoning is not None else ("", text)
        fields: dict = {}
        if thought and self.output.include_reasoning:
            fields["reasoning_content"] = thought
        calls: list[dict] = []
        if self.tools is not None:
            content, calls = self.tools.push(content, final)
        if self.output.echo and not self.echoed:
            content, self.echoed = self.output.echo + content, True
        if content:
            fields["content"] = content
        if calls:
            fields["tool_calls"] = calls
        return fields

    def finish_reason(self, reason: str | None) -> str | None:
        if reason == "stop" and self.tools is not None and self.tools.called:
            return "tool_calls"
        return reason
