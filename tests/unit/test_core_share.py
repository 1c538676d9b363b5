"""Cores shared by a node's engines: an engine stepping alone borrows its idle siblings' cores."""

from __future__ import annotations

import torch

from hybridlb.config import EngineConfig
from hybridlb.engine.core_share import CoreShare, shared_cores
from hybridlb.engine.spawn import node_core_share


def test_an_engine_alone_takes_the_pool_and_gives_it_back(tmp_path):
    before = torch.get_num_threads()
    try:
        a, b, c = (CoreShare(shared_cores(str(tmp_path), "cores", slot, 3, 6)) for slot in range(3))
        assert a.stepping() == 6  # the others wait for work
        assert b.stepping() == 3
        assert c.stepping() == 2 and a.stepping() == 2  # everyone busy: each its own share
        b.idle()
        c.idle()
        assert a.stepping() == 6 and torch.get_num_threads() == 6
        assert (a.borrowed, b.borrowed, c.borrowed) == (2, 1, 0)
        for share in (a, b, c):
            share.close()
    finally:
        torch.set_num_threads(before)


def test_a_table_left_by_an_engine_that_died_stepping_is_reset_by_its_successor(tmp_path):
    spec = shared_cores(str(tmp_path), "cores", 0, 2, 2)
    dead = CoreShare(spec)
    dead.stepping()  # never calls idle(): the process was killed mid-step
    restarted, sibling = CoreShare(spec), CoreShare(shared_cores(str(tmp_path), "cores", 1, 2, 2))
    assert sibling.stepping() == 2
    for share in (dead, restarted, sibling):
        share.close()


def test_nothing_to_share_for_one_engine_or_chosen_threads(tmp_path):
    assert shared_cores(str(tmp_path), "cores", 0, 1, 8) is None
    assert shared_cores(str(tmp_path), "cores", 0, 2, 1) is None
    assert node_core_share(EngineConfig(model="m", torch_threads=2), str(tmp_path), "cores", 2, 8) == [None, None]
    assert node_core_share(EngineConfig(model="m", share_cores=False), str(tmp_path), "cores", 2, 8) == [None, None]
    shares = node_core_share(EngineConfig(model="m"), str(tmp_path), "cores", 2, 8)
    assert [(s.slot, s.own) for s in shares] == [(0, 4), (1, 4)]
