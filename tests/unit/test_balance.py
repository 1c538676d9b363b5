"""The load-balancing policy as a pure function."""

from __future__ import annotations

from hybridlb.api.dispatch.balance import MAX_LOAD_GAP, RankView, choose_cache_aware, choose_engine, load_score
from hybridlb.api.dispatch.prefix_index import PrefixIndex


def test_least_loaded_wins():
    assert choose_engine([3, 1, 2], start=0) == 1
    assert choose_engine([3, 1, 2], start=2) == 1


def test_ties_rotate_with_start():
    assert [choose_engine([0, 0, 0], start=s) for s in range(6)] == [0, 1, 2, 0, 1, 2]
    assert [choose_engine([1, 0, 0], start=s) for s in range(4)] == [1, 1, 2, 1]


def test_a_burst_spreads_when_loads_are_updated():
    loads = [0, 0, 0, 0]
    for turn in range(12):
        loads[choose_engine(loads, turn)] += 1
    assert loads == [3, 3, 3, 3]


def test_a_request_counts_once_whether_or_not_the_stats_show_it_yet():
    assert load_score(waiting=0, running=0, in_flight_here=3) == 3  # sent, not reported yet
    assert load_score(waiting=0, running=3, in_flight_here=3) == 3  # reported: the same load
    assert load_score(waiting=2, running=3, in_flight_here=5) == 11  # queued requests weigh 4
    assert load_score(waiting=0, running=6, in_flight_here=2) == 6  # other API servers' requests count too


def test_an_engine_with_fresh_stats_does_not_look_busier_than_one_with_stale_stats():
    fresh = load_score(waiting=0, running=4, in_flight_here=4)
    stale = load_score(waiting=0, running=2, in_flight_here=4)  # two sent since its last report
    assert fresh == stale == 4


def _ranks(*ranks) -> list[RankView]:
    """(requests, prefill_tokens, cached_tokens, pressure) per rank."""
    return [RankView(*rank) for rank in ranks]


def test_cache_aware_goes_where_the_prefix_is_cached():
    assert choose_cache_aware(_ranks((0, 0, 0, 0), (0, 0, 512, 0)), 520, start=0) == 1
    assert choose_cache_aware(_ranks((3, 0, 1024, 0), (1, 0, 0, 0)), 1040, start=1) == 0  # outweighs a little load
    assert choose_cache_aware(_ranks((1, 0, 240, 0), (0, 0, 0, 0)), 250, start=0) == 1  # a short prefix does not
    assert [choose_cache_aware(_ranks((0, 0, 240, 0), (0, 0, 0, 0)), 250, s) for s in range(2)] == [0, 1]  # nor ties


def test_cache_aware_spills_when_the_load_outweighs_the_prefill_saved():
    # 1,000 of 1,032 tokens cached on rank 0, rank 1 idle: rank 0 costs 32 x (1 + k) + 128 k for k
    # requests there, rank 1 the whole prompt (1,032), which stalls nobody.
    cached = (1000, 0.0)
    assert choose_cache_aware(_ranks((6, 0, *cached), (0, 0, 0, 0.0)), 1032, start=0) == 0  # 992 < 1032
    assert choose_cache_aware(_ranks((7, 0, *cached), (0, 0, 0, 0.0)), 1032, start=0) == 1  # 1152 > 1032
    # A full cache would lose a prefix to the replica: the cached rank keeps it a while longer.
    full = (1000, 1.0)
    assert choose_cache_aware(_ranks((8, 0, *full), (0, 0, 0, 1.0)), 1032, start=0) == 0


def test_a_miss_costs_more_on_a_busier_rank():
    # A chat's history (576 of 736 tokens) is on rank 0, which has six requests more than rank 1.
    # Recomputing it on rank 1 would stall each of rank 1's eight requests for the whole prompt.
    turn = _ranks((14, 0, 576, 0.3, 14.0), (8, 0, 0, 0.3, 8.0))
    assert [choose_cache_aware(turn, 736, s) for s in range(2)] == [0, 0]
    # With rank 1 idle, nobody waits for the recompute there, and this turn waits for nobody.
    idle = _ranks((6, 0, 576, 0.3, 6.0), (0, 0, 0, 0.3, 0.0))
    assert [choose_cache_aware(idle, 736, s) for s in range(2)] == [1, 1]


def test_cache_aware_does_not_queue_a_prompt_behind_a_long_prefill_while_a_rank_idles():
    # Rank 0 caches the prefix but still prefills 2,000 tokens for others: the first token
    # comes sooner from idle rank 1, which computes the whole prompt at once.
    assert choose_cache_aware(_ranks((2, 2000, 1000, 0.2), (0, 0, 0, 0.2)), 1032, start=0) == 1
    assert choose_cache_aware(_ranks((2, 300, 1000, 0.2), (0, 0, 0, 0.2)), 1032, start=0) == 0
    # Had rank 1 requests to decode, each would wait for those 1,032 tokens: the queue is cheaper.
    assert choose_cache_aware(_ranks((2, 2000, 1000, 0.2), (2, 0, 0, 0.2)), 1032, start=0) == 0


def test_cache_aware_places_a_new_prefix_on_the_emptier_cache():
    assert choose_cache_aware(_ranks((1, 0, 0, 0.9), (1, 0, 0, 0.1)), 1032, start=0) == 1


def test_cache_aware_never_picks_a_rank_far_busier_than_the_least_loaded():
    full = (4096, 1.0)
    assert choose_cache_aware(_ranks((MAX_LOAD_GAP, 0, *full), (0, 0, 0, 1.0)), 4100, start=0) == 0  # at the limit
    assert choose_cache_aware(_ranks((MAX_LOAD_GAP + 1, 0, *full), (0, 0, 0, 1.0)), 4100, start=0) == 1  # past it


def test_cache_aware_weighs_each_request_by_the_steps_it_shares_with_the_new_one():
    # (requests, prefill, cached, pressure, decode_load): rank 0's 10 requests have 12 tokens
    # to go, rank 1's 4 have 120: a prompt that may generate 120 shares 10 x 12 / 120 = 1
    # request's worth of steps on rank 0 and 4 on rank 1.
    ranks = _ranks((10, 0, 0, 0.0, 1.0), (4, 0, 0, 0.0, 4.0))
    assert [choose_cache_aware(ranks, 20, s) for s in range(2)] == [0, 0]
    # A prompt of 12 tokens shares every step of all of them: the fewer requests win.
    ranks = _ranks((10, 0, 0, 0.0, 10.0), (4, 0, 0, 0.0, 4.0))
    assert [choose_cache_aware(ranks, 20, s) for s in range(2)] == [1, 1]


def test_cache_aware_without_any_cache_or_queue_is_least_loaded():
    for loads in ([0, 0, 0], [2, 1, 3], [1, 0, 0]):
        ranks = [RankView(load, 0, 0, 0.0) for load in loads]
        assert [choose_cache_aware(ranks, 100, s) for s in range(4)] == [choose_engine(loads, s) for s in range(4)]


def test_the_prefix_index_forgets_evicted_blocks_and_old_prompts():
    index = PrefixIndex(capacity=4)
    index.record([1, 2, 3])
    assert index.matched([1, 2, 3, 4]) == 3 and index.matched([5, 1]) == 0
    index.forget([2])
    assert index.matched([1, 2, 3]) == 1
    index.record([7, 8, 9])  # over capacity: the oldest prompt's blocks go, tail first
    assert index.matched([7, 8, 9]) == 3 and len(index) == 4
    assert index.matched([1]) == 1 and 3 not in index.blocks


def test_a_connection_counts_each_requests_tokens_to_go_down_as_they_arrive():
    """What ``decode_load`` reads: each request's max_tokens (else the model length's room),
    less what it has generated; gone once released."""
    import asyncio

    import zmq.asyncio

    from hybridlb.api.dispatch.engine_client import EngineConnection
    from hybridlb.params import SamplingParams
    from hybridlb.protocol import EngineReady, RequestOutput

    async def main():
        context = zmq.asyncio.Context()
        connection = EngineConnection(0, "tcp://127.0.0.1:9", "balance-test", context)  # never answers
        connection.info = EngineReady(0, "m", max_model_len=512, vocab_size=8, num_kv_blocks=8, block_size=16,
                                      eos_token_ids=[])
        connection.alive = True
        try:
            connection.add("long", [1] * 100, SamplingParams(max_tokens=120))
            connection.add("short", [1] * 4, SamplingParams(max_tokens=12))
            connection.add("open", [1] * 12, SamplingParams(max_tokens=None))  # up to 500 more
            assert connection.decode_load(120) == (120 + 12 + 120) / 120
            connection._dispatch([RequestOutput("short", [5] * 6), RequestOutput("long", [5] * 60)])
            assert connection.decode_load(120) == (60 + 6 + 120) / 120
            connection.release("open", abort=False)
            assert connection.decode_load(600) == (60 + 6) / 600
        finally:
            connection.socket.close(linger=0)
            context.destroy(linger=0)

    asyncio.run(main())


def test_a_prompt_cached_nowhere_goes_by_load_not_by_the_requests_it_would_stall():
    """A burst of long and short prompts: rank 0 holds one long request, rank 1 four short ones
    (a tenth of the long prompt's steps each). A fresh long prompt must be computed in full
    wherever it goes, so it goes by load (rank 1), not away from rank 1's many requests — that
    stacked the long ones on one rank (948 against 396 generated tokens in a skewed burst)."""
    long_there = RankView(requests=1, prefill_tokens=300, cached_tokens=0, pressure=0.0, decode_load=1.0)
    shorts_there = RankView(requests=4, prefill_tokens=40, cached_tokens=0, pressure=0.0, decode_load=0.4)
    assert choose_cache_aware([long_there, shorts_there], 300, start=0) == 1
    # with the prompt's prefix on rank 0, recomputing it beside rank 1's four requests is priced
    cached = long_there._replace(cached_tokens=290)
    assert choose_cache_aware([cached, shorts_there], 300, start=1) == 0


def test_a_debug_log_says_why_each_request_went_where(caplog):
    """HYBRIDLB_LOG_LEVEL=DEBUG: one line per cache_aware decision, every rank's inputs and cost."""
    import asyncio
    import logging

    import zmq.asyncio

    from hybridlb.api.dispatch.engine_client import EngineConnection
    from hybridlb.api.dispatch.pool import EnginePool
    from hybridlb.params import SamplingParams
    from hybridlb.protocol import EngineReady

    async def main():
        context = zmq.asyncio.Context()
        connections = [EngineConnection(rank, "tcp://127.0.0.1:9", "balance-test", context) for rank in (0, 1)]
        try:
            for connection in connections:
                connection.info = EngineReady(connection.rank, "m", max_model_len=512, vocab_size=8, num_kv_blocks=8,
                                              block_size=16, eos_token_ids=[])
                connection.alive = True
            connections[0].add("busy", [1] * 100, SamplingParams(max_tokens=120))
            pool = EnginePool(connections, policy="cache_aware")
            with caplog.at_level(logging.DEBUG, logger="hybridlb.api.dispatch.pool"):
                chosen = pool.pick(prompt_tokens=40, params=SamplingParams(max_tokens=16))
        finally:
            for connection in connections:
                connection.socket.close(linger=0)
            context.destroy(linger=0)
        return chosen.rank

    assert asyncio.run(main()) == 1
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cache_aware:")]
    assert line.startswith("cache_aware: 40 prompt tokens to rank 1 (rank 0: 1 requests, 100 to prefill, 0 cached")
    assert "; rank 1: 0 requests, 0 to prefill" in line and line.count("cost ") == 2
