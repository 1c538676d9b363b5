"""The kernels' interface checked: ``csrc/abi.h`` read by a small strict parser and compared with
bindings.py's tables (functions, constants, the decode program's operations and step).

The header is the one declaration of what the C side exports (the compiler holds the C
definitions to it); bindings.py has to repeat it for ctypes. ``check`` runs when the library is
loaded (about a millisecond) and turns any difference into an ``ABIError`` naming the
function or member, the side and the difference, where ctypes would pass the wrong arguments.

The parser takes only the restricted C the header is written in: ``#define NAME <integer>``
(other directives: include guards and includes), ``enum name { A = 1, ... };`` with every value
written, ``struct name { type field; ... };`` and prototypes ``type name(type arg, ...);`` whose
types are pointers, ``int64_t`` or ``float`` (and ``void`` returns). Anything else is an error.
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

from hybridlb.kernels import bindings

HEADER = Path(__file__).parent / "csrc" / "abi.h"
_SCALARS = {"int64_t": ctypes.c_int64, "float": ctypes.c_float}
_NAMES = {ctypes.c_void_p: "pointer", ctypes.c_int64: "int64_t", ctypes.c_float: "float", None: "void"}
_WORD = re.compile(r"[A-Za-z_]\w*|\*")
_SPACE = re.compile(r"\s*")
_ITEM = re.compile(r"(?P<kind>enum|struct)\s+(?P<name>[A-Za-z_]\w*)\s*\{(?P<body>[^{}]*)\}\s*;"
                   r"|(?P<declarator>[^;{}()]+?)\s*\((?P<arguments>[^;{}()]*)\)\s*;")


class ABIError(TypeError):
    """The header and the bindings disagree, or the header is outside the parser's grammar."""


@dataclass(frozen=True)
class Prototype:
    """A function as the header declares it, its types as ctypes'."""

    restype: type | None
    args: tuple[tuple[str, type], ...]  # (name, ctypes type)


@dataclass(frozen=True)
class Header:
    """What a header declares: prototypes, #define constants, enums and structs by name."""

    functions: dict[str, Prototype]
    constants: dict[str, int]
    enums: dict[str, dict[str, int]]
    structs: dict[str, tuple[tuple[str, type], ...]]


def read() -> Header:
    """The installed abi.h, parsed."""
    return parse(HEADER.read_text())


def parse(text: str) -> Header:
    """The declarations of a header in the restricted C above; ABIError where it strays."""
    code, constants = _preprocess(text)
    header = Header({}, constants, {}, {})
    at = _SPACE.match(code).end()
    while at < len(code):
        found, line = _ITEM.match(code, at), code.count("\n", 0, at) + 1
        if found is None:
            raise ABIError(f"abi.h line {line}: not a #define, enum, struct or prototype: "
                           f"{' '.join(code[at:].split(';')[0].split())[:80]!r}")
        kind, name, body = found.group("kind"), found.group("name"), found.group("body")
        if kind == "enum":
            declared, header.enums[name] = name in header.enums, _members(body, line, name)
        elif kind == "struct":
            *fields, rest = body.split(";")
            if rest.strip():
                raise ABIError(f"abi.h line {line}: struct {name}: {' '.join(rest.split())!r} lacks its ';'")
            declared = name in header.structs
            header.structs[name] = tuple(_declaration(field, line, f"struct {name}") for field in fields)
        else:
            name, restype = _declaration(found.group("declarator"), line, "a prototype", void=True)
            arguments = found.group("arguments")
            args = [] if arguments.strip() == "void" else arguments.split(",")
            declared, header.functions[name] = name in header.functions, Prototype(restype, tuple(
                _declaration(arg, line, f"{name}'s argument {i}") for i, arg in enumerate(args)))
        if declared:
            raise ABIError(f"abi.h line {line}: {name} is declared twice")
        at = _SPACE.match(code, found.end()).end()
    return header


def check(header: Header | None = None, functions: dict | None = None, constants: dict | None = None,
          ops: type[IntEnum] = bindings.Op, step: type[ctypes.Structure] = bindings.ProgramStep) -> None:
    """Raise ABIError listing every difference between ``header`` (default: the installed abi.h) and
    the bindings (default: bindings.py's tables)."""
    header = read() if header is None else header
    functions = bindings.FUNCTIONS if functions is None else functions
    constants = bindings.CONSTANTS if constants is None else constants
    problems = []
    for name in sorted(functions.keys() | header.functions.keys()):
        problems += _compare_function(name, header.functions.get(name), functions.get(name))
    for name, value in constants.items():
        if header.constants.get(name) != value:
            problems.append(f"#define {name}: {header.constants.get(name)} in abi.h, {value} in bindings.py")
    kinds = {f"OP_{op.name}": op.value for op in ops}
    for name in sorted(kinds.keys() | header.enums.get("program_op", {}).keys()):
        value = header.enums.get("program_op", {}).get(name)
        if value != kinds.get(name):
            problems.append(f"operation {name}: {value} in abi.h (enum program_op), {kinds.get(name)} in bindings.py "
                            f"({ops.__name__})")
    fields = tuple((name, kind) for name, kind in step._fields_)
    if header.structs.get("program_step") != fields:
        problems.append(f"struct program_step: {_describe(header.structs.get('program_step'))} in abi.h, "
                        f"{_describe(fields)} in bindings.py ({step.__name__})")
    if problems:
        raise ABIError("the kernels' C header (csrc/abi.h) and their bindings (bindings.py) disagree:\n  "
                       + "\n  ".join(problems))


def _compare_function(name: str, declared: Prototype | None, bound: tuple | None) -> list[str]:
    if bound is None:
        return [f"{name}: declared in abi.h, missing from bindings.py"]
    if declared is None:
        return [f"{name}: bound in bindings.py, not declared in abi.h"]
    argtypes, restype = bound
    problems = []
    if declared.restype != restype:
        problems.append(f"{name}: returns {_NAMES[declared.restype]} in abi.h, {_name(restype)} in bindings.py")
    if len(declared.args) != len(argtypes):
        problems.append(f"{name}: {len(declared.args)} arguments in abi.h "
                        f"({', '.join(arg for arg, _ in declared.args)}), {len(argtypes)} in bindings.py")
        return problems
    for i, ((arg, kind), given) in enumerate(zip(declared.args, argtypes, strict=True)):
        if kind != given:
            problems.append(f"{name}: argument {i} ({arg}) is {_NAMES[kind]} in abi.h, {_name(given)} in bindings.py")
    return problems


def _name(kind) -> str:
    return _NAMES.get(kind) or getattr(kind, "__name__", repr(kind))


def _describe(fields) -> str:
    return "missing" if fields is None else "{" + ", ".join(f"{_name(kind)} {name}" for name, kind in fields) + "}"


def _preprocess(text: str) -> tuple[str, dict[str, int]]:
    """The code without comments and directives (lines kept in place), and the #define constants."""
    text = re.sub(r"/\*.*?\*/", lambda comment: "\n" * comment.group().count("\n"), text, flags=re.S)
    code, constants = [], {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("//")[0].strip()
        if not line.startswith("#"):
            code.append(line)
            continue
        code.append("")
        words = line[1:].split()
        if words[:1] == ["define"] and len(words) == 3 and re.fullmatch(r"-?\d+", words[2]):
            constants[words[1]] = int(words[2])
        elif not (words[:1] in (["ifndef"], ["endif"], ["include"]) or (words[:1] == ["define"] and len(words) == 2)):
            raise ABIError(f"abi.h line {number}: {line!r}: only #define NAME <integer>, include guards and "
                           "#include are understood")
    return "\n".join(code), constants


def _declaration(text: str, line: int, where: str, void: bool = False) -> tuple[str, type | None]:
    """(name, ctypes type) of a ``type name`` declaration."""
    words = _WORD.findall(text)
    if "".join(words) != "".join(text.split()) or len(words) < 2 or words[-1] == "*":
        raise ABIError(f"abi.h line {line}: {where}: {' '.join(text.split())!r} is not 'type name'")
    kind = [word for word in words[:-1] if word != "const"]
    if "*" in kind:
        return words[-1], ctypes.c_void_p
    if len(kind) == 1 and kind[0] in _SCALARS:
        return words[-1], _SCALARS[kind[0]]
    if void and kind == ["void"]:
        return words[-1], None
    raise ABIError(f"abi.h line {line}: {where}: type {' '.join(words[:-1])!r} is outside the ABI (pointers, "
                   "int64_t, float)")


def _members(body: str, line: int, name: str) -> dict[str, int]:
    members = {}
    for member in filter(str.strip, body.split(",")):
        found = re.fullmatch(r"\s*([A-Za-z_]\w*)\s*=\s*(-?\d+)\s*", member)
        if found is None:
            raise ABIError(f"abi.h line {line}: enum {name}: {member.strip()!r} is not 'NAME = <integer>'")
        members[found.group(1)] = int(found.group(2))
    return members
