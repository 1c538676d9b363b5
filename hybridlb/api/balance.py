"""Which local engine takes the next request: a pure policy, tested without sockets."""

from __future__ import annotations


def load_score(waiting: int, running: int, in_flight_here: int) -> int:
    """One engine's load: ``4*waiting + running`` from its latest stats, plus this API
    server's requests the stats do not show yet (sent since, or still in transit).

    A request counts once: adding all of ``in_flight_here`` on top of stats that already
    include it would make the engine that reported most recently look busiest, and
    send the next requests to engines whose stats lag.
    """
    unseen = max(0, in_flight_here - waiting - running)
    return 4 * waiting + running + unseen


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
