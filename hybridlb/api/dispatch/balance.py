"""Which local engine takes the next request: a pure policy, tested without sockets."""

from __future__ import annotations

from typing import NamedTuple


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


class RankView(NamedTuple):
    """What ``cache_aware`` weighs for one rank."""

    requests: int  # requests on the rank: its stats' waiting + running, or this server's in flight if more
    prefill_tokens: int  # prompt tokens this server sent there that are not prefilled yet (no first token)
    cached_tokens: int  # of this prompt's, held there by this server's PrefixIndex
    pressure: float  # share of the rank's KV pool the index holds reusable prompts in (0 to 1)
    # the requests this one would decode beside, each weighted by the share of its steps it is
    # still there for: min(its tokens left, this one's max tokens) / this one's max tokens.
    # None: ``requests`` (all there for every step)
    decode_load: float | None = None


# cache_aware prices a rank in prompt tokens to prefill:
#
#   prefill_tokens                  the prompts queued there before this one: its first token
#                                   waits for them
# + uncached * (1 + requests + pressure)
#                                   this prompt's tokens the rank would compute: its first token
#                                   waits for them, and so does the next token of each request
#                                   there (a recompute on a busy rank stalls all of them; priced
#                                   only when some rank holds the prompt's prefix); a
#                                   full cache also loses what the new blocks evict (a prefix
#                                   other requests may need)
# + TOKENS_PER_REQUEST * decode_load  each request decoding there slows the steps of this one
#                                   it is still there for: a request with 12 tokens to go
#                                   weighs a tenth on a prompt that may generate 120, a whole
#                                   one on a prompt of 12. Counting requests alone, a burst
#                                   of long and short requests could stack the long ones on
#                                   one rank (same counts, ten times the steps) while the
#                                   other idles after a few steps.
#
# A chat's next turn stays on the rank holding its history while the ranks' loads are close:
# moving it would recompute the history and stall every request of the other rank meanwhile
# (a 1,000-token prefix outweighs 6 requests more on its rank when the other idles, and all
# MAX_LOAD_GAP when the other has 2). Measured on multi-turn chats (benchmarks/prefix_routing.py,
# 16 in flight): pricing a recompute by this prompt's first token alone (1 + pressure) moved
# 15-20 of 96 turns off the rank holding their history, mostly to dodge a few hundred tokens of
# queued prefill, and recomputed it there (hits 53-56% of an ideal 63%); priced as here, 1 and
# 6 of 96 (62%, 57%) in the two rounds traced, though over 3 rounds its hits were within the
# spread of least_loaded's (benchmarks/REPORT.md). A prompt cached nowhere is computed in full
# whichever rank takes it, so the stall is not priced (1 + pressure): it goes to the least busy
# rank, the emptier cache breaking near-ties (pricing the stall there too kept long prompts off
# ranks busy with short requests and stacked them on one: 948 against 396 generated tokens in
# tests/cluster/dp/test_clusters.py's skewed bursts). Cached prefixes under MIN_CACHED_TOKENS do
# not count (a chat template's first blocks save less prefill than piling every request onto
# one rank costs), and no rank more than MAX_LOAD_GAP requests above the least loaded is
# picked, so one hot prefix spreads out.
TOKENS_PER_REQUEST = 128
MIN_CACHED_TOKENS = 256
MAX_LOAD_GAP = 8


def serve_cost(rank: RankView, prompt_tokens: int, cached_somewhere: bool = True) -> float:
    """What serving a ``prompt_tokens`` prompt on ``rank`` costs, in prompt tokens (see above);
    ``cached_somewhere``: whether any rank holds enough of it to count."""
    cached = rank.cached_tokens if rank.cached_tokens >= MIN_CACHED_TOKENS else 0
    uncached = max(0, prompt_tokens - cached)
    stalled = rank.requests if cached_somewhere else 0
    decoding = rank.requests if rank.decode_load is None else rank.decode_load
    return rank.prefill_tokens + uncached * (1 + stalled + rank.pressure) + TOKENS_PER_REQUEST * decoding


def choose_cache_aware(ranks: list[RankView], prompt_tokens: int, start: int, max_gap: int = MAX_LOAD_GAP) -> int:
    """Index of the rank that serves the prompt cheapest (``serve_cost``), among ranks within
    ``max_gap`` requests of the least loaded. Ties go to the first at or after ``start``."""
    count = len(ranks)
    window = min(rank.requests for rank in ranks) + max_gap
    cached_somewhere = any(rank.cached_tokens >= MIN_CACHED_TOKENS for rank in ranks)
    best, best_cost = None, None
    for offset in range(count):
        index = (start + offset) % count
        if ranks[index].requests > window:
            continue
        cost = serve_cost(ranks[index], prompt_tokens, cached_somewhere)
        if best_cost is None or cost < best_cost:
            best, best_cost = index, cost
    return best
