"""Reasoning models' ``<think>...</think>``, split off as ``reasoning_content`` (vLLM's
``--reasoning-parser``):

* ``deepseek_r1``: everything up to ``</think>`` is reasoning (the chat template usually
  writes the opening ``<think>`` itself); an output that never closes it is all reasoning;
* ``qwen3``: the same when the output opens with ``<think>``; one that does not is content
  (thinking switched off).

Structured output and tool calls apply to the part after the reasoning: the engine starts a
request's grammar after the end marker's tokens (``Constraint.after``), and tool parsers
read only the content.
"""

from __future__ import annotations

from hybridlb.api.openai.tools.base import held_back

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


def split(kind: str, text: str, opened: bool = False) -> tuple[str | None, str | None]:
    """The whole output as (reasoning, content)."""
    stream = ReasoningStream(kind, opened)
    reasoning, content = stream.push(text, final=True)
    return reasoning or None, content or None


class ReasoningStream:
    """Streamed: ``push`` each text delta, get (reasoning delta, content delta)."""

    def __init__(self, kind: str, opened: bool = False):
        """``opened``: the prompt ended inside ``<think>`` (the template opened it), so the output
        starts as reasoning whatever the parser."""
        self.kind = kind
        self.text = ""
        # qwen3: decided by how the output starts, unless the prompt already opened the reasoning
        self.thinking: bool | None = None if kind == "qwen3" and not opened else True
        self.reasoning_sent = 0
        self.content_sent = 0

    def push(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.text += delta
        text = self.text
        if self.thinking is None:
            stripped = text.lstrip()
            if stripped.startswith(START):
                self.thinking = True
            elif final or not START.startswith(stripped):
                self.thinking = False
            else:
                return "", ""
        if not self.thinking:
            reasoning, content = "", text
        elif (end := text.find(END)) >= 0:
            reasoning, content = _strip_start(text[:end]), text[end + len(END) :]
        elif not final and START.startswith(text.lstrip()):  # perhaps the opening tag, still arriving
            reasoning, content = "", ""
        else:
            reasoning, content = _strip_start(text if final else text[: len(text) - held_back(text, END)]), ""
        fresh_reasoning = reasoning[self.reasoning_sent :]
        fresh_content = content[self.content_sent :]
        self.reasoning_sent, self.content_sent = len(reasoning), len(content)
        return fresh_reasoning, fresh_content


def _strip_start(text: str) -> str:
    stripped = text.lstrip()
    return stripped[len(START) :] if stripped.startswith(START) else text


def reasoning_ended(prompt: str) -> bool:
    """Whether the prompt already closed the reasoning (a template that switches thinking off
    writes an empty ``<think></think>``): the output's constraint then applies from its start."""
    end = prompt.rfind(END)
    return end >= 0 and end > prompt.rfind(START)


def reasoning_opened(prompt: str) -> bool:
    """Whether the prompt ends inside ``<think>`` (DeepSeek-R1's template, Qwen3's thinking ones)."""
    start = prompt.rfind(START)
    return start >= 0 and start > prompt.rfind(END)
