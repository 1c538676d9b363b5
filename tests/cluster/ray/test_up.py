"""`hybridlb up` on a real three-node Ray cluster (three raylets on this machine)."""

from __future__ import annotations

import time

import httpx
import pytest
import ray

from hybridlb.config import parse_config
from hybridlb.launch.ray_admin import down, status
from hybridlb.launch.ray_driver import RayCluster, up
from hybridlb.launch.ray_session import UpError
from hybridlb.plan import plan_cluster
from hybridlb.testing.ports import free_port
from tests.cluster.dp.test_clusters import burst, served_per_engine
from tests.cluster.ray.conftest import NODE_RESOURCES


def three_node_config(model: str, name: str, **extra_engine) -> dict:
    return {
        "engine": {"model": model, "max_model_len": 512, "kv_cache_gib": 0.05, "torch_threads": 1, **extra_engine},
        "data_parallel": {"size": 6, "rpc_port": free_port(), "nodes": [
            {"size_local": 2, "api_port": free_port(), "ray_resource": resource} for resource in NODE_RESOURCES]},
        "ray": {"name": name, "cpus_per_engine": 1, "cpus_per_api_server": 1, "ready_timeout_s": 120},
    }


def start(data: dict) -> RayCluster:
    config = parse_config(data)
    cluster = RayCluster(config, plan_cluster(config, is_moe=False), detached=False)
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    return cluster


@pytest.fixture(scope="module")
def three(ray_cluster, tiny_qwen3):
    cluster = start(three_node_config(tiny_qwen3, "three"))
    yield cluster
    cluster.stop()


def test_one_api_server_and_its_engines_on_each_node(three):
    api_nodes = ray.get([api.node_id.remote() for _, api in three.apis])
    assert len(set(api_nodes)) == 3, "each node gets exactly one API server"
    for (node, _), api_node in zip(three.apis, api_nodes, strict=True):
        engine_nodes = ray.get([three.engines[rank].node_id.remote() for rank in node.ranks])
        assert set(engine_nodes) == {api_node}, f"node {node.index}'s engines run elsewhere"


def test_every_node_answers_and_balances_over_its_own_engines(three):
    urls = ray.get([api.url.remote() for _, api in three.apis])
    model = three.config.served_model_name
    assert burst(urls, model, 90) == [200] * 90
    for (node, _), url in zip(three.apis, urls, strict=True):
        served = served_per_engine(url)
        assert set(served) == set(node.ranks) and sum(served.values()) == 30
        assert all(count > 30 // 3 for count in served.values()), served


def test_state_api_lists_the_documented_names(three):
    rows = status("three", None, "hybridlb")
    names = {row["name"] for row in rows}
    expected = {f"hybridlb:three:engine:{r}" for r in range(6)} | {f"hybridlb:three:api:{n}" for n in range(3)}
    assert expected | {"hybridlb:three:coordinator"} == names
    assert all(row["state"] == "ALIVE" for row in rows)
    assert all("running" in row["load"] for row in rows if ":engine:" in row["name"])


def test_a_dead_engine_degrades_its_node_only(ray_cluster, tiny_qwen3):
    cluster = start(three_node_config(tiny_qwen3, "deaths"))
    try:
        urls = ray.get([api.url.remote() for _, api in cluster.apis])
        ray.kill(cluster.engines[1], no_restart=True)
        deadline = time.monotonic() + 10
        while httpx.get(f"{urls[0]}/health").json().get("down_ranks") != [1]:
            assert time.monotonic() < deadline, "node 0 never noticed its dead engine"
            time.sleep(0.2)
        assert httpx.get(f"{urls[0]}/health").json()["status"] == "degraded"
        assert burst(urls, cluster.config.served_model_name, 30) == [200] * 30  # node 0 on its other engine
        dead = [row for row in status("deaths", None, "hybridlb") if row["name"].endswith(":engine:1")]
        assert dead[0]["state"] == "DEAD"
    finally:
        cluster.stop()


def test_down_leaves_nothing_behind(ray_cluster, tiny_qwen3):
    cluster = start(three_node_config(tiny_qwen3, "gone"))
    cluster.stop()
    named = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "hybridlb:gone:" in a["name"]]
    groups = [pg for pg in ray.util.placement_group_table().values()
              if pg["name"].startswith("hybridlb:gone:") and pg["state"] != "REMOVED"]
    assert named == [] and groups == []
    assert down("gone", quiet=True) == 1  # nothing left to stop


def test_more_engines_than_the_nodes_hold_fails_before_starting(ray_cluster, tiny_qwen3):
    data = three_node_config(tiny_qwen3, "toobig")
    data["data_parallel"]["nodes"][1]["size_local"] = 8
    data["data_parallel"]["size"] = 12
    config = parse_config(data)
    with pytest.raises(UpError, match=r"node 1 needs .* but no Ray node has that much"):
        up(config, plan_cluster(config), detach=False)
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if "hybridlb:toobig:" in a["name"]]


def test_missing_model_fails_before_starting(ray_cluster, tmp_path):
    config = parse_config(three_node_config(str(tmp_path / "nope"), "nomodel"))
    with pytest.raises(UpError, match="does not exist"):
        up(config, plan_cluster(config), detach=False)


def test_restart_policy_brings_a_dead_engine_back(ray_cluster, tiny_qwen3):
    data = three_node_config(tiny_qwen3, "phoenix")
    data["data_parallel"]["restart_policy"] = "restart"
    cluster = start(data)
    try:
        url = ray.get(cluster.apis[0][1].url.remote())
        ray.kill(cluster.engines[0], no_restart=False)  # as if the process crashed
        deadline = time.monotonic() + 60
        saw_down = False
        while time.monotonic() < deadline:
            healthy = httpx.get(f"{url}/health").json().get("status") == "ok"
            saw_down = saw_down or not healthy
            if saw_down and healthy:
                break
            time.sleep(0.2)
        assert saw_down and healthy, "the engine did not come back"
        body = {"model": cluster.config.served_model_name, "prompt": "back again", "max_tokens": 4}
        pinned = httpx.post(f"{url}/v1/completions", json=body, headers={"X-data-parallel-rank": "0"}, timeout=60)
        assert pinned.status_code == 200
    finally:
        cluster.stop()


def test_multi_port_places_a_supervisor_beside_the_rank_servers_of_a_node(ray_cluster, tiny_qwen3):
    """lb.mode multi_port under Ray: a server per rank on api_port + i, and the node's supervisor
    actor answering the probes for both."""
    from hybridlb.testing.ports import free_port_range

    port, supervisor = free_port_range(2), free_port()
    data = three_node_config(tiny_qwen3, "multiport")
    data["data_parallel"].update(size=2, nodes=[{"size_local": 2, "api_port": port, "ray_resource": "node_a"}])
    data["lb"] = {"mode": "multi_port", "supervisor_port": supervisor, "supervisor_probe_interval_s": 0.5}
    cluster = start(data)
    try:
        for i in (0, 1):
            assert burst([f"http://127.0.0.1:{port + i}"], cluster.config.served_model_name, 4) == [200] * 4
            assert served_per_engine(f"http://127.0.0.1:{port + i}").keys() == {i}
        deadline = time.monotonic() + 30
        while httpx.get(f"http://127.0.0.1:{supervisor}/readyz").status_code != 200:
            assert time.monotonic() < deadline, "the supervisor never saw both ranks up"
            time.sleep(0.2)
        assert "hybridlb:multiport:supervisor:0" in {row["name"] for row in status("multiport", None, "hybridlb")}
    finally:
        cluster.stop()
