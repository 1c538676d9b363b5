"""Where JSON values begin and end in text that is still arriving.

Tool-call parsers stream a call's arguments as the model writes them, so they need to know,
at any point, how much of the text belongs to a value: ``value_end`` finds the end of the
value at a position (``None`` while it is incomplete), ``scan_object`` the keys of an
object seen so far and the span of each key's value. Only the structure is read (strings
with their escapes, nesting); ``json.loads`` reads the values once they are whole.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

WHITESPACE = " \t\n\r"
_CLOSE = {"{": "}", "[": "]"}
_SCALAR_END = set(WHITESPACE) | set(",}]:")


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """``text[i]`` is a quote: the index after the closing quote, or None."""
    j = i + 1
    while j < len(text):
        char = text[j]
        if char == "\\":
            j += 2
            continue
        if char == '"':
            return j + 1
        j += 1
    return None


def value_end(text: str, i: int, final: bool = False) -> int | None:
    """The end (exclusive) of the JSON value starting at ``text[i]``, or None while it is
    incomplete (a number at the very end is complete only when ``final``). Raises ValueError
    for text that cannot be JSON."""
    if i >= len(text):
        return None
    char = text[i]
    if char == '"':
        return _string_end(text, i)
    if char in _CLOSE:
        stack = [_CLOSE[char]]
        j = i + 1
        while j < len(text):
            char = text[j]
            if char == '"':
                end = _string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if char in _CLOSE:
                stack.append(_CLOSE[char])
            elif char in "}]":
                if char != stack.pop():
                    raise ValueError(f"mismatched {char!r} at {j}")
                if not stack:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] not in _SCALAR_END:
        j += 1
    if j == i:
        raise ValueError(f"no JSON value at {i}: {text[i:i + 20]!r}")
    if j == len(text) and not final:
        return None
    return j


@dataclass
class ObjectScan:
    """A JSON object seen so far: each key's value span (end None: still arriving)."""

    fields: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    end: int | None = None  # after the closing brace, once there

    def value(self, text: str, key: str):
        """A complete value, parsed; None when absent or incomplete."""
        span = self.fields.get(key)
        if span is None or span[1] is None:
            return None
        return json.loads(text[span[0] : span[1]])

    def raw(self, text: str, key: str) -> str | None:
        """The value's text so far (a prefix of its final text), or None when absent."""
        span = self.fields.get(key)
        if span is None:
            return None
        return text[span[0] : span[1]] if span[1] is not None else text[span[0] :]


def scan_object(text: str, i: int, final: bool = False) -> ObjectScan:
    """Scan the object starting at ``text[i]`` (a ``{``) as far as the text goes. Raises
    ValueError for text that cannot be a JSON object."""
    if text[i] != "{":
        raise ValueError(f"expected a JSON object at {i}")
    scan = ObjectScan()
    j = skip_ws(text, i + 1)
    if j < len(text) and text[j] == "}":
        scan.end = j + 1
        return scan
    while j < len(text):
        if text[j] != '"':
            raise ValueError(f"expected a key at {j}")
        key_end = _string_end(text, j)
        if key_end is None:
            return scan
        key = json.loads(text[j:key_end])
        j = skip_ws(text, key_end)
        if j >= len(text):
            return scan
        if text[j] != ":":
            raise ValueError(f"expected ':' at {j}")
        start = skip_ws(text, j + 1)
        if start >= len(text):
            return scan
        end = value_end(text, start, final)
        scan.fields[key] = (start, end)
        if end is None:
            return scan
        j = skip_ws(text, end)
        if j >= len(text):
            return scan
        if text[j] == "}":
            scan.end = j + 1
            return scan
        if text[j] != ",":
            raise ValueError(f"expected ',' or '}}' at {j}")
        j = skip_ws(text, j + 1)
    return scan
