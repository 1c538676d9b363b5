"""The load-balancing policy as a pure function."""

from __future__ import annotations

from hybridlb.api.balance import choose_engine, load_score


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
