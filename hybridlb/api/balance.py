"""Which local engine takes the next request: a pure policy, tested without sockets."""

from __future__ import annotations


def choose_engine(loads: list[int], start: int) -> int:
    """Index of the lowest load (``EngineConnection.score``); ties go to the first at or
    after ``start``.

    Rotating ``start`` on every decision spreads ties (an idle cluster, a burst between
    two load reports) instead of piling them onto engine 0.
    """
    count = len(loads)
    best = start % count
    for offset in range(1, count):
        index = (start + offset) % count
        if loads[index] < loads[best]:
            best = index
    return best
