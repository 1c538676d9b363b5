"""Where a vLLM rank's OpenMP threads run: each rank of a node on cores of its own unless the user set
VLLM_CPU_OMP_THREADS_BIND, and a user's value naming a core this process may not use is refused before
vLLM starts, with the cores it may use and the fix."""

from __future__ import annotations

import os

import pytest

from hybridlb.engine.vllm_backend.args import checked_binding, thread_binding


def test_ranks_of_a_node_get_cores_of_their_own(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5, 6, 7})
    assert [thread_binding(rank, 2) for rank in range(3)] == ["4,5", "6,7", "4,5"]
    assert thread_binding(1, 1) == "5" and thread_binding(0, 16) == "4,5,6,7"


@pytest.mark.parametrize("value", ["auto", "nobind", "4-7", "4,5|6-7", " 5 "])
def test_a_users_binding_within_the_allowed_cores_is_kept(monkeypatch, value):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5, 6, 7})
    assert checked_binding(value) == value


@pytest.mark.parametrize(("value", "problem"), [
    ("0-5", r"names cores 0-3 "), ("4,9|12-13", r"names cores 9,12-13 "), ("cores 4", "is not a list of cores"),
    ("", "is not a list of cores"),
])
def test_a_users_binding_outside_them_is_refused_with_the_fix(monkeypatch, value, problem):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5, 6, 7})
    with pytest.raises(ValueError, match=problem + r".*may use cores 4-7\).*or unset it"):
        checked_binding(value)
