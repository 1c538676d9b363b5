"""Pythonic calls (Llama 3.2 / 4, ToolACE): the output is a Python list of calls with literal
keyword arguments, ``[get_weather(city="Paris"), get_time()]`` (Llama 4 wraps it in
``<|python_start|>`` / ``<|python_end|>``). Arguments become a JSON object. Streamed, each
call is sent once its closing parenthesis arrives."""

from __future__ import annotations

import ast
import json

from hybridlb.api.tools.base import CallSoFar, Scan, ToolParser

START, END = "<|python_start|>", "<|python_end|>"
_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


class PythonicParser(ToolParser):
    name = "pythonic"
    skip_special_tokens = False  # Llama 4's <|python_start|> is a special token

    def scan(self, text: str, final: bool) -> Scan:
        body = text.strip()
        if body.startswith(START):
            body = body[len(START) :].strip()
        elif not final and (not body or START.startswith(body)):
            return Scan("", undecided=True)
        if body.endswith(END):
            body = body[: -len(END)].strip()
        if not body and not final:
            return Scan("", undecided=True)
        if not body.startswith("["):
            return Scan(text)
        if final:
            return Scan("", [CallSoFar(n, a, True) for n, a in _calls(body)])
        for cut in _call_ends(body):  # the longest prefix of whole calls
            try:
                return Scan("", [CallSoFar(n, a, True) for n, a in _calls(body[: cut + 1] + "]")], undecided=True)
            except ValueError:
                continue
        return Scan("", undecided=True)


def _call_ends(body: str) -> list[int]:
    """Positions of the last few ')' (candidate ends of the last whole call), latest first."""
    ends, at = [], len(body)
    while len(ends) < 4 and (at := body.rfind(")", 0, at)) >= 0:
        ends.append(at)
    return ends


def _calls(source: str) -> list[tuple[str, str]]:
    try:
        tree = ast.parse(source, mode="eval").body
    except SyntaxError as exc:
        raise ValueError(f"not a list of calls: {exc.msg}") from None
    if not isinstance(tree, ast.List) or not all(isinstance(e, ast.Call) for e in tree.elts):
        raise ValueError("not a list of calls")
    if any(call.args or any(kw.arg is None for kw in call.keywords) for call in tree.elts):
        raise ValueError("tool calls take keyword arguments only")
    return [(_name(call.func), json.dumps({kw.arg: _literal(kw.value) for kw in call.keywords}, ensure_ascii=False))
            for call in tree.elts]


def _name(func: ast.expr) -> str:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return f"{_name(func.value)}.{func.attr}"
    raise ValueError("a call's function must be a name")


def _literal(node: ast.expr):
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values, strict=True)}
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise ValueError(f"argument {ast.unparse(node)!r} is not a literal") from None
