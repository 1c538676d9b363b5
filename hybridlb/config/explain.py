"""A config's validation errors as the lines a user reads: one per problem, each at its key
(``engine.max_num_seqs: ...``), an unknown key with the nearest name its section has."""

from __future__ import annotations

import difflib
import typing

from pydantic import BaseModel, ValidationError


def problem_lines(error: ValidationError, root: type[BaseModel]) -> list[str]:
    """Every problem in ``error`` (raised validating ``root``), one line each."""
    lines = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "(top level)"
        if item["type"] == "extra_forbidden":
            lines.append(f"{where}: unknown key; {_nearest(root, item['loc'])}")
            continue
        message = item["msg"].removeprefix("Value error, ")
        # A cross-field check reports each of its problems on a line of its own (base.raise_all),
        # most of them naming their keys already.
        lines += [line if line.startswith(f"{where}.") else f"{where}: {line}" for line in message.split("\n")]
    return lines


def _nearest(root: type[BaseModel], loc: tuple) -> str:
    """What to write instead of the unknown key at ``loc``: a close name in its own section, else
    the section that has a key of that name, else a plain hint."""
    key = str(loc[-1]).replace("-", "_")  # vLLM's flags are spelt with dashes
    section = _section_at(root, loc[:-1])
    if section is not None:
        close = difflib.get_close_matches(key, list(section.model_fields), n=1, cutoff=0.6)
        if close:
            return f"did you mean `{close[0]}`?"
    for name, field in root.model_fields.items():
        other = _model_in(field.annotation)
        if other is not None and key in other.model_fields:
            return f"did you mean `{name}.{key}`? (it belongs in the {name} section)"
    return "remove it or check its spelling"


def _section_at(root: type[BaseModel], path: tuple) -> type[BaseModel] | None:
    """The model that validates the mapping at ``path`` (list indexes skipped), if one does."""
    model = root
    for part in path:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(str(part))
        model = _model_in(field.annotation) if field is not None else None
        if model is None:
            return None
    return model


def _model_in(annotation: object) -> type[BaseModel] | None:
    """The pydantic model an annotation holds (``X``, ``X | None``, ``list[X]``), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for argument in typing.get_args(annotation):
        found = _model_in(argument)
        if found is not None:
            return found
    return None
