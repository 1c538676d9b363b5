"""What every config section shares: frozen models that forbid unknown keys, and the error
the loaders raise."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A configuration problem, phrased for the user: what is wrong and how to fix it. ``problems``
    lists each one on its own (a file with several mistakes names them all)."""

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = problems if problems is not None else [message]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def raise_all(problems: list[str]) -> None:
    """A model validator's cross-field checks: raise every problem found at once (one line each)."""
    if problems:
        raise ValueError("\n".join(problems))
