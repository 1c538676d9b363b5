"""What every tool-call parser shares: the calls read so far, a scan's result, the parser's
interface, and holding back a possible marker while streaming."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import ClassVar


@dataclass
class CallSoFar:
    name: str | None  # known once whole
    arguments: str  # the arguments' JSON text so far: a prefix of the final text
    complete: bool = False


@dataclass
class Scan:
    content: str  # text that is surely content (streaming: a possible start of a call is held back)
    calls: list[CallSoFar] = field(default_factory=list)
    undecided: bool = False  # not yet known whether this output is calls or content


class ToolParser:
    """Reads the calls of one output, going on from where its last scan stopped."""

    name: ClassVar[str]
    skip_special_tokens: ClassVar[bool] = True  # False where a family's markers are special tokens

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget the output read so far: the next scan reads a new one from its start."""

    def scan(self, text: str, final: bool) -> Scan:
        """Read ``text``, the output so far, which extends the text of the previous scan since
        ``reset`` (``final``: the whole output). Raises ValueError for calls that cannot parse."""
        raise NotImplementedError

    def call_id(self) -> str:
        return f"call_{secrets.token_hex(12)}"


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def content_before(text: str, marker: str, final: bool) -> str:
    return text if final else text[: len(text) - held_back(text, marker)]


class MarkerSearch:
    """Finds a marker in text that grows, never searching the same characters twice."""

    def __init__(self, marker: str, start: int = 0):
        self.marker = marker
        self.start = start

    def find(self, text: str) -> int:
        """The marker's position from ``start`` on, or -1 (the next search starts where one
        could still begin)."""
        at = text.find(self.marker, self.start)
        if at < 0:
            self.start = max(self.start, len(text) - len(self.marker) + 1)
        return at
