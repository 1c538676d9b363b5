"""The rank map: every layout the flags allow, and every problem named with its fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridlb.config import parse_config
from hybridlb.plan import PlanError, format_plan, plan_cluster


def _plan(is_moe: bool | None = False, **sections):
    data = {"engine": {"model": "m"}}
    for key, value in sections.items():
        section, field = key.split("__")
        data.setdefault(section, {})[field] = value
    return plan_cluster(parse_config(data), is_moe)


def _problems(**sections) -> list[str]:
    with pytest.raises(PlanError) as info:
        _plan(**sections)
    return info.value.problems


def test_single_node_hybrid_uses_the_multi_node_flags():
    plan = _plan(data_parallel__size=2, data_parallel__size_local=2, data_parallel__start_rank=0)
    (node,) = plan.nodes
    assert plan.mode == "hybrid" and plan.complete and not plan.multi_node
    assert node.ranks == (0, 1) and [a.ranks for a in node.api_servers] == [(0, 1)]
    assert plan.coordinator  # dense hybrid still relays load stats


def test_worker_node_of_a_hybrid_cluster():
    plan = _plan(data_parallel__size=4, data_parallel__size_local=2, data_parallel__start_rank=2, api__port=8001)
    (node,) = plan.nodes
    assert not plan.complete and plan.multi_node and not node.is_head
    assert node.api_servers[0].ranks == (2, 3) and node.api_servers[0].port == 8001
    assert "other nodes join" in format_plan(plan)


def test_internal_mode_serves_every_rank_from_the_head():
    plan = _plan(data_parallel__size=4, data_parallel__size_local=2, lb__mode="internal")
    assert plan.nodes[0].api_servers[0].ranks == (0, 1, 2, 3)
    assert plan.remote_engines
    worker = _plan(data_parallel__size=4, data_parallel__size_local=2, data_parallel__start_rank=2,
                   data_parallel__headless=True, lb__mode="internal")
    assert worker.nodes[0].api_servers == ()


def test_external_mode_one_server_per_rank_and_no_coordinator_for_dense():
    plan = _plan(data_parallel__size=2, lb__mode="external", api__port=9000)
    assert [(a.port, a.ranks) for a in plan.nodes[0].api_servers] == [(9000, (0,)), (9001, (1,))]
    assert not plan.coordinator
    # MoE without expert parallelism runs its ranks independently too; with it, they step
    # in lockstep and need the coordinator's waves whatever the LB mode.
    assert not _plan(is_moe=True, data_parallel__size=2, lb__mode="external").coordinator
    lockstep = _plan(is_moe=True, data_parallel__size=2, lb__mode="external", engine__expert_parallel=True)
    assert lockstep.coordinator and lockstep.lockstep
    by_rank = _plan(data_parallel__size=4, data_parallel__rank=3)
    assert by_rank.mode == "external" and by_rank.nodes[0].ranks == (3,)


def test_several_api_servers_share_the_node_port():
    plan = _plan(data_parallel__size=2, lb__api_servers_per_node=3)
    servers = plan.nodes[0].api_servers
    assert len(servers) == 3 and {a.port for a in servers} == {8000}
    assert all(a.ranks == (0, 1) for a in servers)


def test_full_cluster_listing():
    plan = _plan(data_parallel__size=4, data_parallel__nodes=[{"size_local": 2, "address": "10.0.0.1"},
                                                               {"size_local": 2, "address": "10.0.0.2"}])
    assert [n.ranks for n in plan.nodes] == [(0, 1), (2, 3)] and plan.complete


@pytest.mark.parametrize(("sections", "expected"), [
    ({"data_parallel__size": 2, "data_parallel__size_local": 4}, "size_local=4 is larger than data_parallel.size=2"),
    ({"data_parallel__size": 4, "data_parallel__size_local": 2, "data_parallel__start_rank": 3},
     "ranks 3..4 go past data_parallel.size=4"),
    ({"data_parallel__size": 2, "data_parallel__rank": 2}, "rank=2 is out of range for size=2"),
    ({"data_parallel__size": 2, "data_parallel__rank": 1, "lb__mode": "hybrid"},
     "data_parallel.rank is for external load balancing"),
    ({"data_parallel__size": 4, "data_parallel__rank": 1, "data_parallel__size_local": 2},
     "runs exactly one rank"),
    ({"data_parallel__size": 4, "data_parallel__size_local": 2, "data_parallel__start_rank": 2,
      "data_parallel__headless": True}, "hybrid mode runs an API server on every node"),
    ({"data_parallel__size": 4, "data_parallel__size_local": 2, "data_parallel__start_rank": 2,
      "data_parallel__headless": True, "lb__mode": "internal", "lb__api_servers_per_node": 2},
     "headless (engines only) but api_servers_per_node is set"),
    ({"data_parallel__size": 4, "data_parallel__size_local": 2, "data_parallel__start_rank": 2,
      "lb__mode": "internal"}, "start this node with --headless"),
    ({"data_parallel__size": 2, "data_parallel__headless": True, "lb__mode": "internal"},
     "head node, which cannot be headless"),
    ({"data_parallel__size": 2, "lb__mode": "external", "data_parallel__headless": True},
     "external mode runs an API server per rank"),
    ({"data_parallel__size": 2, "lb__mode": "external", "lb__api_servers_per_node": 2},
     "exactly one API server per rank"),
    ({"data_parallel__size": 2, "api__port": 29552}, "port 29552 on 127.0.0.1 is used by both"),
    ({"data_parallel__size": 4, "data_parallel__nodes": [{"size_local": 2}, {"size_local": 2, "start_rank": 1}]},
     "both claim rank 1"),
    ({"data_parallel__size": 4, "data_parallel__nodes": [{"size_local": 2}, {"size_local": 1}]},
     "no node runs rank(s) 3"),
    ({"data_parallel__size": 2, "engine__expert_parallel": True}, "expert parallelism needs a MoE checkpoint"),
])
def test_each_invalid_combination_names_the_problem_and_fix(sections, expected):
    problems = _problems(**sections)
    assert any(expected in problem for problem in problems), problems
    assert all(";" in problem for problem in problems), "every problem states a fix after ';'"


def test_the_coordinators_ports_are_drawn_where_no_connection_or_named_port_takes_them():
    """`hybridlb up` draws the coordinator's ports before it starts: outside the kernel's ephemeral
    range (a Ray process's outgoing connection would take one there) and off every port the plan
    names (an API server binds its port only later)."""
    from hybridlb.launch.ray_actors import free_ports

    plan = _plan(data_parallel__size=2, data_parallel__size_local=2, data_parallel__rpc_port=29000, api__port=29500)
    named = plan.named_ports()
    assert {29000, 29016, 29017, 29500} <= named
    ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    avoid = named | frozenset(range(20000, 28990))  # and most of the band: a draw ignoring it lands there
    for _ in range(20):
        _, ports = free_ports._function(4, "127.0.0.1", avoid)
        assert len(set(ports)) == 4 and all(port < ephemeral and port not in avoid for port in ports), ports
