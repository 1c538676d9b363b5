"""Command-line flags declared on the config fields they set, so an option is written once.

A field the CLI takes says so with ``Field(..., json_schema_extra=flag(...))``: its flag names
(default ``--`` plus the field name, dashed), whether vLLM has the flag with the same meaning,
which commands take it, and how its text becomes the field's value (``parse``). The field's
description is the flag's help. ``hybridlb.cli.config_flags`` makes the commands' options and
their config overrides from ``flags_of(Config)``; ``hybridlb.config.doc`` lists them.

Ways of parsing a flag's text (``parse``), besides as the field's own type:

* ``json``: a JSON object holding a section's keys (``--speculative-config``);
* ``switch``: on a section, a flag without a value that turns the section on (``--enable-lora``);
  the flags of its fields need it;
* ``length``: a token count as vLLM writes it: 4096, 32k (32,000), 32K (32,768);
* ``dashes``: a name with dashes for underscores (``multi-port``);
* ``count_or_auto``: a number or ``auto``;
* ``one_or_list``: a repeated flag; given once, its one value;
* ``name=path``: repeated ``name=path`` entries (or JSON objects) of a list of sections.
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass

from pydantic import BaseModel
from pydantic.fields import FieldInfo

PARSERS = ("json", "switch", "length", "dashes", "count_or_auto", "one_or_list", "name=path")
SERVE = ("serve",)
UNIONS = (typing.Union, types.UnionType)


def flag(*names: str, vllm: bool = False, commands: tuple[str, ...] = SERVE, parse: str | None = None,
         note: str | None = None, envvar: str | None = None, negatable: bool = True) -> dict:
    """The ``json_schema_extra`` of a field the CLI takes as a flag.

    ``names``: the long name first, then short forms (default: the field's name, dashed);
    ``vllm``: vLLM has this flag, with this meaning; ``commands``: the commands that take it;
    ``parse``: one of PARSERS; ``note``: what the help adds for the command line only (how to
    write the value); ``envvar``: read from this variable when the flag is not given;
    ``negatable``: a boolean's ``--no-`` form exists."""
    if parse not in (None, *PARSERS):
        raise ValueError(f"parse={parse!r}: one of {PARSERS}")
    cli: dict = {"names": list(names), "vllm": vllm, "commands": list(commands)}
    for key, value in (("parse", parse), ("note", note), ("envvar", envvar)):
        if value is not None:
            cli[key] = value
    if not negatable:
        cli["negatable"] = False
    return {"cli": cli}


@dataclass(frozen=True)
class Flag:
    """One flag, with the field it sets: ``path`` from the config's root."""

    path: tuple[str, ...]
    field: FieldInfo
    names: tuple[str, ...]
    vllm: bool
    commands: tuple[str, ...]
    parse: str | None = None
    note: str | None = None
    envvar: str | None = None
    negatable: bool = True

    @property
    def name(self) -> str:
        """The long name, e.g. ``--max-model-len``."""
        return self.names[0]

    @property
    def param(self) -> str:
        """The command's parameter for it (a Python name)."""
        return self.name.lstrip("-").replace("-", "_")

    @property
    def key(self) -> str:
        """The config key it sets, e.g. ``engine.max_model_len``."""
        return ".".join(self.path)

    @property
    def is_bool(self) -> bool:
        return self.parse is None and value_type(self.field.annotation) is bool


def flags_of(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[Flag]:
    """Every flag declared in ``model``'s tree, in field order, a section's own flags after the section's."""
    found = []
    for name, field in model.model_fields.items():
        path = (*prefix, name)
        declared = cli_of(field)
        if declared is not None:
            names = tuple(declared["names"]) or ("--" + name.replace("_", "-"),)
            found.append(Flag(path, field, names, declared["vllm"], tuple(declared["commands"]),
                              declared.get("parse"), declared.get("note"), declared.get("envvar"),
                              declared.get("negatable", True)))
        section = section_of(field.annotation)
        if section is not None:
            found += flags_of(section, path)
    return found


def cli_of(field: FieldInfo) -> dict | None:
    """The flag declared on ``field`` (``flag()``'s mapping), or None."""
    extra = field.json_schema_extra
    return extra.get("cli") if isinstance(extra, dict) else None


def section_of(annotation: object) -> type[BaseModel] | None:
    """The section a field holds (``X`` or ``X | None``, not a list of them), if it holds one."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in UNIONS:
        arms = [arm for arm in typing.get_args(annotation) if arm is not type(None)]
        return section_of(arms[0]) if len(arms) == 1 else None
    return None


def value_type(annotation: object) -> type:
    """What a flag's text becomes before the config reads it: bool, int, float, str, or list
    (a repeated flag); str where the field takes several kinds of value."""
    arms = [arm for arm in _arms(annotation) if arm is not type(None)]
    if any(typing.get_origin(arm) is list for arm in arms):
        return list
    kinds = {_plain(arm) for arm in arms}
    return kinds.pop() if len(kinds) == 1 else str


def _arms(annotation: object) -> tuple:
    if typing.get_origin(annotation) in UNIONS:
        return typing.get_args(annotation)
    return (annotation,)


def _plain(arm: object) -> type:
    if typing.get_origin(arm) is typing.Literal:
        return str
    return arm if arm in (bool, int, float, str) else str


def choices(annotation: object) -> list[str]:
    """The values a Literal field takes (none for other fields)."""
    return [str(value) for arm in _arms(annotation) if typing.get_origin(arm) is typing.Literal
            for value in typing.get_args(arm)]


def default_text(field: FieldInfo) -> str | None:
    """A field's default as YAML writes it (None: it has none, or a section's)."""
    if field.is_required() or field.default_factory is not None or field.default is None:
        return None
    value = field.default
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value) if value != "" else '""'
