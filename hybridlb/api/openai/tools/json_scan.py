"""Where JSON values begin and end in text that is still arriving.

Tool-call parsers stream a call's arguments as the model writes them, so they need to know,
at any point, how much of the text belongs to a value: ``ValueScan`` finds the end of the
value at a position (``None`` while it is incomplete), ``ObjectScan`` the keys of an object
seen so far and the span of each key's value. Both keep where they stopped and go on from
there when the text has grown (``advance``), so each character is read once however many
deltas it came in. Only the structure is read (strings with their escapes, nesting);
``json.loads`` reads the values once they are whole.
"""

from __future__ import annotations

import json
import re

_CLOSE = {"{": "}", "[": "]"}
_NOT_WS = re.compile(r"[^ \t\n\r]")
_IN_STRING = re.compile(r'["\\]')  # what ends a string or escapes its next character
_IN_CONTAINER = re.compile(r'["{}\[\]]')  # what changes the nesting between strings
_SCALAR_END = re.compile(r"[ \t\n\r,}\]:]")


def skip_ws(text: str, i: int) -> int:
    found = _NOT_WS.search(text, i)
    return found.start() if found else max(i, len(text))


class ValueScan:
    """The JSON value starting at ``text[start]``, read as far as the text goes."""

    def __init__(self, start: int):
        self.start = start
        self.end: int | None = None  # exclusive, once the value is whole
        self._at = start  # the next character to read
        self._kind = ""  # "string", "container" or "scalar", once the first character is read
        self._closers: list[str] = []  # a container's closing brackets still to come
        self._in_string = False

    def advance(self, text: str, final: bool = False) -> int | None:
        """The value's end, or None while it is incomplete (a number at the very end is
        complete only when ``final``). Raises ValueError for text that cannot be JSON."""
        if self.end is None and self._at < len(text):
            self.end = self._read(text, final)
        elif self.end is None and final and self._kind == "scalar":
            self.end = len(text)
        return self.end

    def _read(self, text: str, final: bool) -> int | None:
        if not self._kind:
            char = text[self.start]
            self._kind = "string" if char == '"' else "container" if char in _CLOSE else "scalar"
            self._in_string = char == '"'
            self._closers = [_CLOSE[char]] if char in _CLOSE else []
            self._at = self.start + (self._kind != "scalar")
        if self._kind == "scalar":
            return self._scalar_end(text, final)
        while self._at < len(text):
            if self._in_string:
                self._string_step(text)
            elif (end := self._container_step(text)) is not None:
                return end
            if self._kind == "string" and not self._in_string:
                return self._at
        return None

    def _string_step(self, text: str) -> None:
        found = _IN_STRING.search(text, self._at)
        if found is None:
            self._at = len(text)
        elif found.group() == "\\":
            self._at = found.start() + 2  # past the end while the escaped character is to come
        else:
            self._in_string, self._at = False, found.end()

    def _container_step(self, text: str) -> int | None:
        found = _IN_CONTAINER.search(text, self._at)
        if found is None:
            self._at = len(text)
            return None
        char, self._at = found.group(), found.end()
        if char == '"':
            self._in_string = True
        elif char in _CLOSE:
            self._closers.append(_CLOSE[char])
        elif char != self._closers.pop():
            raise ValueError(f"mismatched {char!r} at {found.start()}")
        elif not self._closers:
            return self._at
        return None

    def _scalar_end(self, text: str, final: bool) -> int | None:
        found = _SCALAR_END.search(text, self._at)
        if found is None:
            self._at = len(text)
            return len(text) if final else None
        if found.start() == self.start:
            raise ValueError(f"no JSON value at {self.start}: {text[self.start:self.start + 20]!r}")
        return found.start()


class ObjectScan:
    """The JSON object starting at ``text[start]`` (a ``{``), read as far as the text goes:
    each key's value span (end None: still arriving)."""

    def __init__(self, start: int):
        self.start = start
        self.fields: dict[str, tuple[int, int | None]] = {}
        self.end: int | None = None  # after the closing brace, once there
        self._at = start
        self._step = self._open
        self._key = ""
        self._part: ValueScan | None = None  # the key or value being read

    def advance(self, text: str, final: bool = False) -> ObjectScan:
        """Read on as far as the text goes. Raises ValueError for text that cannot be a JSON object."""
        while self.end is None and self._step(text, final):
            pass
        return self

    # Each step reads one part of the object and says whether the text goes on past it.

    def _open(self, text: str, final: bool) -> bool:
        if self.start >= len(text):
            return False
        if text[self.start] != "{":
            raise ValueError(f"expected a JSON object at {self.start}")
        self._at, self._step = self.start + 1, self._first_key
        return True

    def _first_key(self, text: str, final: bool) -> bool:
        self._at = skip_ws(text, self._at)
        if self._at >= len(text):
            return False
        if text[self._at] == "}":
            self.end = self._at + 1
        self._step = self._key_start
        return True

    def _key_start(self, text: str, final: bool) -> bool:
        self._at = skip_ws(text, self._at)
        if self._at >= len(text):
            return False
        if text[self._at] != '"':
            raise ValueError(f"expected a key at {self._at}")
        self._part, self._step = ValueScan(self._at), self._key_end
        return True

    def _key_end(self, text: str, final: bool) -> bool:
        end = self._part.advance(text, final)
        if end is None:
            return False
        self._key, self._at, self._step = json.loads(text[self._part.start : end]), end, self._colon
        return True

    def _colon(self, text: str, final: bool) -> bool:
        self._at = skip_ws(text, self._at)
        if self._at >= len(text):
            return False
        if text[self._at] != ":":
            raise ValueError(f"expected ':' at {self._at}")
        self._at, self._step = self._at + 1, self._value_start
        return True

    def _value_start(self, text: str, final: bool) -> bool:
        self._at = skip_ws(text, self._at)
        if self._at >= len(text):
            return False
        self._part, self._step = ValueScan(self._at), self._value_end
        return True

    def _value_end(self, text: str, final: bool) -> bool:
        end = self._part.advance(text, final)
        self.fields[self._key] = (self._part.start, end)
        if end is None:
            return False
        self._at, self._step = end, self._after_value
        return True

    def _after_value(self, text: str, final: bool) -> bool:
        self._at = skip_ws(text, self._at)
        if self._at >= len(text):
            return False
        if text[self._at] == "}":
            self.end = self._at + 1
            return False
        if text[self._at] != ",":
            raise ValueError(f"expected ',' or '}}' at {self._at}")
        self._at, self._step = self._at + 1, self._key_start
        return True

    def raw(self, text: str, key: str) -> str | None:
        """The value's text so far (a prefix of its final text), or None when absent."""
        span = self.fields.get(key)
        if span is None:
            return None
        return text[span[0] : span[1]] if span[1] is not None else text[span[0] :]

