"""What every config section shares: frozen models that forbid unknown keys, and the error
the loaders raise."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A configuration problem, phrased for the user: what is wrong and how to fix it."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


