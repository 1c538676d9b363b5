"""Pythonic calls (Llama 3.2 / 4, ToolACE): the output is a Python list of calls with literal
keyword arguments, ``[get_weather(city="Paris"), get_time()]`` (Llama 4 wraps it in
``<|python_start|>`` / ``<|python_end|>``). Arguments become a JSON object. Streamed, each
call is sent once its closing parenthesis arrives: ``CallEnds`` follows the brackets as the
text grows and only the text since the last call read is parsed, so a stream costs time
linear in its length.
"""

from __future__ import annotations

import ast
import json
import re

from hybridlb.api.openai.tools.base import CallSoFar, Scan, ToolParser

START, END = "<|python_start|>", "<|python_end|>"
_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}
# ast.parse costs about 1 us and 500 bytes per character of dense tokens: a list of calls
# longer than this (far past what a model writes as calls) is returned as content.
MAX_SOURCE = 64 * 1024
# Arguments nested deeper than this (tools' parameters nest a few levels) are returned as
# content: reading them recurses, once per level.
MAX_DEPTH = 32
_NONSPACE = re.compile(r"\S")  # what str.strip() keeps


class PythonicParser(ToolParser):
    name = "pythonic"
    skip_special_tokens = False  # Llama 4's <|python_start|> is a special token

    def reset(self) -> None:
        self.body_at: int | None = None  # where the list of calls begins, once the output starts with one
        self.is_content = False  # once the output starts otherwise
        self.ends: CallEnds | None = None
        self.calls: list[CallSoFar] = []  # those read so far
        self.read_to = 0  # where the text still to read as calls begins
        self.retry_size = 0  # text that did not parse is tried again once it has doubled

    def scan(self, text: str, final: bool) -> Scan:
        if self.body_at is None and not self.is_content:
            start = self._list_start(text, final)
            if isinstance(start, Scan):
                return start
            self.body_at = self.read_to = start
            self.ends = CallEnds(start)
        if self.is_content:
            return Scan(text)
        if final:
            return Scan("", self._all_calls(text))
        if len(text) - self.body_at <= MAX_SOURCE:  # longer: the whole output will be content
            for end in self.ends.advance(text):
                self._read_calls_to(text, end)
        return Scan("", list(self.calls), undecided=True)

    def _list_start(self, text: str, final: bool) -> int | Scan:
        """Where the list of calls begins; a Scan while that is not known, or for content."""
        body = text.strip()
        opened = body.startswith(START)
        if opened:
            body = body[len(START) :].strip()
        elif not final and (not body or START.startswith(body)):
            return Scan("", undecided=True)
        if body.endswith(END):
            body = body[: -len(END)].strip()
        if not body and not final:
            return Scan("", undecided=True)
        start = _nonspace(text, _nonspace(text, 0) + (len(START) if opened else 0))
        if body.startswith("["):
            return start
        # Content for good once no later text can make the output's start a marker.
        lead = text[start : start + len(START) + 1].rstrip()
        self.is_content = not START.startswith(lead) and not END.startswith(lead)
        return Scan(text)

    def _read_calls_to(self, text: str, end: int) -> None:
        """Read the calls between the last one read and the ``)`` at ``text[end]``."""
        source = text[self.read_to : end + 1]
        if len(source) < self.retry_size:
            return
        try:
            self.calls += _calls(source + "]", after_call=bool(self.calls))
        except ValueError:  # perhaps no call ends here: wait for more text
            self.retry_size = 2 * len(source)
            return
        self.read_to, self.retry_size = end + 1, 0

    def _all_calls(self, text: str) -> list[CallSoFar]:
        body_end = len(text.rstrip())
        if text.endswith(END, self.body_at, body_end):
            body_end = len(text[: body_end - len(END)].rstrip())
        if body_end - self.body_at > MAX_SOURCE:
            raise ValueError(f"a list of calls longer than {MAX_SOURCE} characters")
        return self.calls + _calls(text[self.read_to : body_end], after_call=bool(self.calls))


class CallEnds:
    """The ``)`` that close a call of the list starting at ``text[start]``, found as the text
    grows: brackets counted outside strings and comments. (An f-string's nested quotes are
    not followed: an f-string is no literal, so its call never parses anyway.)"""

    def __init__(self, start: int):
        self.at = start
        self.depth = 0
        self.quote = ""  # inside a string: its quote, one character or three
        self.comment = False

    def advance(self, text: str) -> list[int]:
        ends: list[int] = []
        while self.at < len(text):
            if self.comment:
                newline = text.find("\n", self.at)
                if newline < 0:
                    self.at = len(text)
                    break
                self.comment, self.at = False, newline + 1
            elif not (self._string(text) if self.quote else self._code(text, ends)):
                break  # the next characters decide what the last ones are
        return ends

    def _code(self, text: str, ends: list[int]) -> bool:
        found = _CODE.search(text, self.at)
        if found is None:
            self.at = len(text)
            return True
        char, at = found.group(), found.start()
        if char in "'\"":
            if _may_be_triple(text, at, char):
                self.at = at
                return False
            self.quote = char * 3 if text.startswith(char * 3, at) else char
            self.at = at + len(self.quote)
            return True
        self.at = at + 1
        if char == "#":
            self.comment = True
        elif char in "([{":
            self.depth += 1
        else:
            self.depth -= 1
            if char == ")" and self.depth == 1:
                ends.append(at)
        return True

    def _string(self, text: str) -> bool:
        found = _STRING_STOP[self.quote[0]].search(text, self.at)
        if found is None:
            self.at = len(text)
            return True
        at = found.start()
        if found.group() == "\\":
            self.at = at + 2  # past the end while the escaped character is to come
        elif len(self.quote) == 1 or text.startswith(self.quote, at):
            self.quote, self.at = "", at + len(self.quote)
        elif _may_be_triple(text, at, self.quote[0]):
            self.at = at
            return False
        else:
            self.at = at + 1
        return True


_CODE = re.compile(r"""[()\[\]{}'"#]""")
_STRING_STOP = {quote: re.compile(rf"[\\{quote}]") for quote in "'\""}


def _may_be_triple(text: str, at: int, quote: str) -> bool:
    """Whether the quotes at ``text[at]`` run to the end of the text, short of three: the next
    characters decide whether they are three."""
    rest = text[at:]
    return len(rest) < 3 and rest == quote * len(rest)


def _nonspace(text: str, at: int) -> int:
    found = _NONSPACE.search(text, at)
    return found.start() if found else len(text)


def _calls(source: str, after_call: bool) -> list[CallSoFar]:
    """The calls of a list written in ``source``; ``after_call``: its text follows calls read
    before, so it is read after a stand-in element (``None``) that no text can join."""
    try:
        tree = ast.parse(("[None" if after_call else "") + source, mode="eval").body
        if not isinstance(tree, ast.List):
            raise ValueError("not a list of calls")
        elements = tree.elts
        if after_call:
            if not (isinstance(elements[0], ast.Constant) and elements[0].value is None):
                raise ValueError("not a list of calls")
            elements = elements[1:]
        return [CallSoFar(_name(call.func), _arguments(call), True) for call in _checked(elements)]
    except SyntaxError as exc:
        raise ValueError(f"not a list of calls: {exc.msg}") from None
    except (RecursionError, MemoryError):  # ast.parse on chains of operators or attributes
        raise ValueError("calls nested too deep to read") from None


def _checked(elements: list[ast.expr]) -> list[ast.Call]:
    if not all(isinstance(e, ast.Call) for e in elements):
        raise ValueError("not a list of calls")
    if any(call.args or any(kw.arg is None for kw in call.keywords) for call in elements):
        raise ValueError("tool calls take keyword arguments only")
    return elements


def _name(func: ast.expr) -> str:
    attributes = []
    while isinstance(func, ast.Attribute):
        attributes.append(func.attr)
        func = func.value
    if not isinstance(func, ast.Name):
        raise ValueError("a call's function must be a name")
    return ".".join([func.id, *reversed(attributes)])


def _arguments(call: ast.Call) -> str:
    try:
        return json.dumps({kw.arg: _literal(kw.value, 1) for kw in call.keywords}, ensure_ascii=False)
    except TypeError:  # a set, bytes or a complex number; a key that is a list or has no JSON form
        raise ValueError("an argument has no JSON form") from None


def _literal(node: ast.expr | None, depth: int):
    if depth > MAX_DEPTH:
        raise ValueError(f"an argument nested deeper than {MAX_DEPTH}")
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, ast.List):
        return [_literal(e, depth + 1) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_literal(k, depth + 1): _literal(v, depth + 1) for k, v in zip(node.keys, node.values, strict=True)}
    if node is None:  # the key of a ** in a dict
        raise ValueError("an argument is not a literal")
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise ValueError("an argument is not a literal") from None
