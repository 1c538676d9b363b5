"""The autoscaler's decisions (``hybridlb.launch.autoscale.Decider``) and the config's bounds."""

from __future__ import annotations

import pytest

from hybridlb.config import AutoscalingConfig, ConfigError, parse_config
from hybridlb.launch.autoscale import Decider, wanted_ranks
from hybridlb.plan import PlanError, plan_cluster

CONFIG = AutoscalingConfig(min_replicas=1, max_replicas=4, target_ongoing_requests=8, upscale_delay_s=5,
                           downscale_delay_s=30)


def test_the_wanted_ranks_cover_the_ongoing_requests_within_the_bounds():
    assert [wanted_ranks(CONFIG, ongoing) for ongoing in (0, 1, 8, 9, 17, 32, 33, 500)] == [1, 1, 1, 2, 3, 4, 4, 4]


def test_a_resize_waits_for_its_delay_and_a_break_starts_the_wait_over():
    decider = Decider(CONFIG)
    assert decider.decide(1, 20, now=0.0) is None  # 3 wanted from now on
    assert decider.decide(1, 20, now=4.9) is None
    assert decider.decide(1, 4, now=5.0) is None  # back to 1: the wait for more is over
    assert decider.decide(1, 20, now=6.0) is None
    assert decider.decide(1, 30, now=11.0) == 4  # 5 s of wanting more: as many as wanted now
    assert decider.decide(4, 0, now=12.0) is None  # fewer wanted: after downscale_delay_s
    assert decider.decide(4, 0, now=41.9) is None
    assert decider.decide(4, 0, now=42.0) == 1


def test_bounds_that_cross_or_a_start_outside_them_are_refused():
    with pytest.raises(ConfigError, match="min_replicas=3 is above max_replicas=2"):
        parse_config({"engine": {"model": "m"}, "autoscaling": {"min_replicas": 3, "max_replicas": 2}})
    config = parse_config({"engine": {"model": "m"}, "data_parallel": {"size": 3},
                           "autoscaling": {"min_replicas": 1, "max_replicas": 2}})
    with pytest.raises(PlanError, match=r"data_parallel.size=3 is outside autoscaling's 1..2"):
        plan_cluster(config)
    config = parse_config({"engine": {"model": "m", "expert_parallel": True}, "data_parallel": {"size": 2},
                           "autoscaling": {"min_replicas": 1, "max_replicas": 2}})
    with pytest.raises(PlanError, match="autoscaling resizes a one-node cluster of a dense model"):
        plan_cluster(config, is_moe=True)


def test_a_one_rank_node_that_autoscales_runs_a_coordinator():
    config = parse_config({"engine": {"model": "m"}, "autoscaling": {"max_replicas": 2}})
    assert plan_cluster(config).coordinator and not plan_cluster(parse_config({"engine": {"model": "m"}})).coordinator


def test_a_resize_asked_of_a_launcher_that_went_away_is_a_503_not_a_hang(tmp_path):
    """The API server's end (ScaleLink): the launcher's socket closes with a resize pending."""
    import asyncio
    import threading
    from multiprocessing.connection import Listener
    from types import SimpleNamespace

    from hybridlb.api.dispatch.scaling import LAUNCHER_GONE, ScaleLink

    listener = Listener(str(tmp_path / "scale.sock"), family="AF_UNIX", authkey=b"k" * 32)
    accepted = []
    threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True).start()

    async def run():
        link = ScaleLink(listener.address, b"k" * 32, SimpleNamespace(), None, None, None, None)
        pending = asyncio.create_task(link.scale(2, 10))
        while not accepted:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(accepted[0].recv_bytes)  # the request came; the launcher dies unanswering
        accepted[0].close()
        answer = await asyncio.wait_for(pending, 10)
        again = await link.scale(2, 10)
        link.close()
        return answer, again

    try:
        assert asyncio.run(run()) == (LAUNCHER_GONE, LAUNCHER_GONE)
    finally:
        listener.close()
