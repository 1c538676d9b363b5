"""How a command refuses to start: ``fail`` for one problem, ``Problems`` to gather every one.

A command line can be wrong in several places at once (a vLLM flag hybridlb would give another
meaning, a config value out of range, a model option that cannot load, a topology, a port in
use). The checks that look at them add what they find to one ``Problems`` list, so the user
fixes everything in one round instead of meeting one error per run. ``fail`` raises a
``Refusal``; a check run inside ``Problems.gather`` has its refusal noted and the command goes
on to the next check. A refusal nobody gathers reaches ``hybridlb.cli.main``, which prints it
(``error: ...`` in red, one line for one problem, a list for several) and exits 2.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import NoReturn

import typer


class Refusal(Exception):
    """The command cannot run as given; ``problems`` says what is wrong and how to fix each."""

    exit_code = 2

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems

    def format_message(self) -> str:
        if len(self.problems) == 1:
            return self.problems[0]
        return f"{len(self.problems)} problems:\n" + "\n".join(f"  - {problem}" for problem in self.problems)

    def show(self) -> None:
        typer.secho(f"error: {self.format_message()}", fg=typer.colors.RED, err=True)


def fail(message: str) -> NoReturn:
    """Refuse with one problem: ``error: message`` in red, exit 2 (unless a ``Problems`` gathers it)."""
    raise Refusal([message])


class Problems:
    """Every problem found before anything starts, in the order found; reported together."""

    def __init__(self, found: Iterable[str] = ()):
        self.found = list(found)

    def add(self, problem: str) -> None:
        self.found.append(problem)

    def extend(self, problems: Iterable[str]) -> None:
        self.found.extend(problems)

    @contextlib.contextmanager
    def gather(self) -> Iterator[None]:
        """Run one check: what it refuses is noted here, and the command goes on to the next check."""
        try:
            yield
        except Refusal as refusal:
            self.found.extend(refusal.problems)

    def raise_any(self) -> None:
        """Refuse with everything found so far, if anything was."""
        if self.found:
            raise Refusal(self.found)


def given_on_the_command_line(context: typer.Context) -> Problems:
    """The problems ``hybridlb.cli.main`` found in a vLLM command line before typer parsed it
    (they ride in the context's ``obj``), to be listed with the command's own."""
    return Problems(context.obj if isinstance(context.obj, list) else ())
