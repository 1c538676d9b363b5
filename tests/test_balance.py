"""The load-balancing policy as a pure function."""

from __future__ import annotations

from hybridlb.api.balance import choose_engine


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
