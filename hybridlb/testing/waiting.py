"""Waiting for something a test or a benchmark expects to happen soon."""

from __future__ import annotations

import time
from collections.abc import Callable


def until(condition: Callable[[], bool], timeout_s: float = 30, what: str = "the condition",
          interval_s: float = 0.1) -> None:
    """Call ``condition()`` every ``interval_s`` until it is true; AssertionError naming ``what``
    once ``timeout_s`` has passed without."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s:g} s"
        time.sleep(interval_s)
