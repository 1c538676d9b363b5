"""The commands' config options, made from the flags the config's fields declare
(``hybridlb.config.flags``), and the config overrides their values make.

A command takes ``options(command)`` with ``with_options`` and hands the values it receives to
``overrides``: section → key → value (nested for a section's own keys), None where a flag was
not given, so the config file decides. The field's description is the option's help; the
flag's ``parse`` says how its text becomes the field's value, and what is wrong with it is
added to the command's ``Problems``.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any

import typer

from hybridlb.cli.problems import Problems
from hybridlb.cli.vllm_args import parse_length
from hybridlb.config import Config
from hybridlb.config.flags import Flag, choices, default_text, flags_of, section_of, value_type

# --help marks the flags vLLM also has (same name and meaning) apart from hybridlb's own.
VLLM_MARK = "[vLLM]"
FLAGS = flags_of(Config)
_BY_PARAM = {each.param: each for each in FLAGS}
assert len(_BY_PARAM) == len(FLAGS), "two config fields declare the same flag"


def options(command: str) -> dict[str, Any]:
    """The options ``command`` takes for config fields (parameter → its Annotated type; all default
    to None), for ``with_options``."""
    return {each.param: Annotated[_kind(each) | None, _option(each)] for each in FLAGS if command in each.commands}


def _kind(each: Flag) -> type:
    """What typer makes of the flag's text (the rest is ``overrides``' to parse)."""
    if each.parse == "switch":
        return bool
    if each.parse is not None and each.parse not in ("one_or_list", "name=path"):
        return str
    kind = value_type(each.field.annotation)
    return list[str] if kind is list else kind


def _option(each: Flag) -> typer.models.OptionInfo:
    long = f"{each.name}/--no-{each.name[2:]}" if each.is_bool and each.negatable else each.name
    return typer.Option(long, *each.names[1:], help=help_text(each), envvar=each.envvar,
                        metavar="TOKENS" if each.parse == "length" else None)


def help_text(each: Flag) -> str:
    """The option's help: the field's description, what the command line adds, the config's default."""
    description = each.field.description or ""
    parts = [description, each.note or ""]
    values = choices(each.field.annotation)
    if any(not re.search(rf"\b{re.escape(value)}\b", description) for value in values):
        parts.append(f"One of: {', '.join(values)}.")
    if each.parse == "json" and (section := section_of(each.field.annotation)) is not None:
        parts.append(f"As JSON, with the keys {', '.join(section.model_fields)}.")
    if each.parse == "length":
        parts.append("Written as vLLM does too: 4096, 32k (32,000), 32K (32,768).")
    default = default_text(each.field)
    if default is not None and (each.negatable or default != "false"):
        parts.append(f"[default: {default}]")
    if each.vllm:
        parts.append(VLLM_MARK)
    return " ".join(part for part in parts if part)


def overrides(values: dict[str, Any], problems: Problems) -> dict[str, dict]:
    """Config overrides (section → keys) from the config options' values (None: not given)."""
    tree: dict[str, Any] = {}
    given = []
    for param, value in values.items():
        each = _BY_PARAM[param]
        if value is not None and each.parse is not None:
            value = _PARSE[each.parse](each, value, problems)
        if value is None:
            continue
        given.append(each)
        _place(tree, each.path, value)
    _check_sections(tree, given, problems)
    return tree


def _place(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for part in path[:-1]:
        tree = tree.setdefault(part, {})
    if isinstance(value, dict) and isinstance(tree.get(path[-1]), dict):
        tree[path[-1]].update(value)
    else:
        tree[path[-1]] = value


def _check_sections(tree: dict, given: list[Flag], problems: Problems) -> None:
    """The flags of a section's keys need the flag that turns it on (``--enable-lora``), or the
    flags of its required keys (``--simulate-step-ms``); else they are problems, not overrides."""
    inner = [each for each in given if len(each.path) > 2]
    for path in dict.fromkeys(each.path[:-1] for each in inner):
        names = [each.name for each in inner if each.path[:-1] == path]
        switch = next((each for each in FLAGS if each.path == path and each.parse == "switch"), None)
        if switch is not None:
            missing = [] if switch in given else [switch.name]
        else:
            keys = {each.path[-1] for each in given if each.path[:-1] == path}
            required = [each for each in FLAGS if each.path[:-1] == path and each.field.is_required()]
            missing = [each.name for each in required if each.path[-1] not in keys]
        if missing:
            problems.add(f"{', '.join(names)} needs {', '.join(missing)}; add it")
            parent = tree
            for part in path[:-1]:
                parent = parent[part]
            parent.pop(path[-1])


def json_object(each: Flag, text: str, problems: Problems) -> dict | None:
    """A flag whose value is a JSON object (vLLM's --kv-events-config), or None if it is not one."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        problems.add(f"{each.name} is not valid JSON ({exc}); give an object, e.g. "
                     "'{\"enable_kv_cache_events\": true}'")
        return None
    if not isinstance(value, dict):
        problems.add(f"{each.name} must be a JSON object, got {text!r}")
        return None
    return value


def _switch(each: Flag, on: bool, problems: Problems) -> dict | None:
    return {} if on else None


def _length(each: Flag, text: str, problems: Problems) -> int | None:
    try:
        return parse_length(text)
    except ValueError as exc:
        problems.add(f"{each.name} {text}: {exc}")
        return None


def _count_or_auto(each: Flag, text: str, problems: Problems) -> int | str | None:
    if text == "auto" or text.isdigit():
        return text if text == "auto" else int(text)
    problems.add(f"{each.name} takes a number or 'auto', got {text!r}")
    return None


def _one_or_list(each: Flag, values: list[str], problems: Problems) -> str | list[str] | None:
    return values[0] if len(values) == 1 else values or None


def _entries(each: Flag, texts: list[str], problems: Problems) -> list[dict]:
    """name=path entries (or JSON objects) of a list of sections (--lora-modules)."""
    entries = []
    for text in texts:
        if text.lstrip().startswith("{"):
            entry = json_object(each, text, problems)
        else:
            name, equals, path = text.partition("=")
            entry = {"name": name, "path": path} if equals and name and path else None
            if entry is None:
                problems.add(f"{each.name} {text!r}: write name=path (or JSON with name, path, base_model_name)")
        if entry is not None:
            entries.append(entry)
    return entries


def _dashes(each: Flag, text: str, problems: Problems) -> str:
    return text.replace("-", "_")  # multi-port, as vLLM users write it


_PARSE = {"json": json_object, "switch": _switch, "length": _length, "dashes": _dashes,
          "count_or_auto": _count_or_auto, "one_or_list": _one_or_list, "name=path": _entries}
