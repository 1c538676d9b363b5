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


# cache_aware: every CACHED_TOKENS_PER_LOAD cached prompt tokens make a rank count one load
# unit (one running request) less busy, in whole units, once at least MIN_CACHED_TOKENS are
# cached: a shorter prefix (a chat template's first blocks, a short shared instruction)
# saves less prefill than piling its requests onto one rank costs, so it leaves ties to
# rotate as least_loaded does. A 1,000-token cached system prompt is worth 7 units.
CACHED_TOKENS_PER_LOAD = 128
MIN_CACHED_TOKENS = 256
MAX_LOAD_GAP = 8  # cache_aware never picks a rank this much busier than the least loaded


def choose_cache_aware(loads: list[int], cached_tokens: list[int], start: int, max_gap: int = MAX_LOAD_GAP) -> int:
    """Index of the rank that serves a request cheapest: load minus what its prefix cache
    saves, among ranks within ``max_gap`` of the least loaded (so one hot prefix spreads
    over the ranks instead of piling onto one: the next rank it spills to caches it too).
    Ties go to the first at or after ``start``; with no long cached prefix anywhere this
    is ``choose_engine``."""
    count = len(loads)
    window = min(loads) + max_gap
    best, best_cost = None, None
    for offset in range(count):
        index = (start + offset) % count
        if loads[index] > window:
            continue
        cached = cached_tokens[index] if cached_tokens[index] >= MIN_CACHED_TOKENS else 0
        cost = loads[index] - cached // CACHED_TOKENS_PER_LOAD
        if best_cost is None or cost < best_cost:
            best, best_cost = index, cost
    return best
