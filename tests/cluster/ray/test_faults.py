"""kill -9 of a coordinator, an API server, an engine or a whole node of a `hybridlb up` cluster.

The shared three-node Ray cluster; each test places its own hybridlb cluster on it.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
import ray
from ray.util.state import list_actors

from hybridlb.launch.ray_admin import status
from hybridlb.testing.ports import free_port
from tests.cluster.dp.test_clusters import burst
from tests.cluster.ray.conftest import NODE_RESOURCES
from tests.cluster.ray.test_up import start, three_node_config
from tests.conftest import SMOLLM2
from tests.process.faults.streams import Streams
from tests.process.faults.test_migration import _migrated, _run


def _pid(name: str) -> int | None:
    """The pid of the live incarnation of actor ``name``, if there is one."""
    return next((a.pid for a in list_actors(filters=[("name", "=", name)]) if a.state == "ALIVE"), None)


def _states(name: str) -> dict[str, str]:
    return {row["name"].removeprefix(f"hybridlb:{name}:"): row["state"] for row in status(name, None, "hybridlb")}


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s} s"
        time.sleep(0.2)


def _health(url: str) -> dict:
    response = httpx.get(f"{url}/health", timeout=10)
    return {"code": response.status_code, **response.json()}


def test_coordinator_and_api_server_deaths_leave_the_rest_serving(ray_cluster, tiny_qwen3):
    cluster = start(three_node_config(tiny_qwen3, "faults"))
    model = cluster.config.served_model_name
    try:
        urls = ray.get([api.url.remote() for _, api in cluster.apis])
        streams = Streams(urls, model, 6)
        streams.wait_streaming()
        os.kill(_pid("hybridlb:faults:coordinator"), signal.SIGKILL)
        assert burst(urls, model, 15) == [200] * 15
        assert [o.kind for o in streams.join(120)] == ["complete"] * 6
        _wait_for(lambda: "coordinator" in " ".join(_health(urls[0])["problems"]), 10, "/health naming it")
        assert _states("faults")["coordinator"] == "DEAD"

        streams = Streams(urls, model, 6)
        streams.wait_streaming()
        os.kill(_pid("hybridlb:faults:api:2"), signal.SIGKILL)
        outcomes = streams.join(30)
        assert all(o.kind == "error" for o in outcomes if o.url == urls[2])
        assert all(o.kind == "complete" for o in outcomes if o.url != urls[2])
        assert burst(urls[:2], model, 10) == [200] * 10
        assert _states("faults")["api:2"] == "DEAD"
    finally:
        cluster.stop()


def test_restart_policy_brings_the_coordinator_and_an_api_server_back(ray_cluster, tiny_qwen3):
    data = three_node_config(tiny_qwen3, "again")
    data["data_parallel"]["restart_policy"] = "restart"
    cluster = start(data)
    model = cluster.config.served_model_name
    try:
        urls = ray.get([api.url.remote() for _, api in cluster.apis])
        for actor in ("coordinator", "api:1"):
            old = _pid(f"hybridlb:again:{actor}")
            os.kill(old, signal.SIGKILL)
            _wait_for(lambda a=actor, o=old: _pid(f"hybridlb:again:{a}") not in (None, o), 60, f"{actor} restarting")
            _wait_for(lambda: all(_health(url).get("status") == "ok" for url in urls), 60, "every node healthy")
            assert burst(urls, model, 15) == [200] * 15
        # The restarted coordinator hears every rank again (same addresses as before).
        view = httpx.get(f"{urls[0]}/ranks").json()
        assert view["lost_ranks"] == [] and len(view["cluster"]) == 6
    finally:
        cluster.stop()


def test_losing_a_ray_node_leaves_the_other_nodes_serving(ray_cluster, tiny_qwen3):
    cluster = start(three_node_config(tiny_qwen3, "lossy"))
    model = cluster.config.served_model_name
    victim_id = ray.get(cluster.apis[2][1].node_id.remote())
    victim = next(n for n in ray_cluster.list_all_nodes() if n.node_id == victim_id)
    try:
        urls = ray.get([api.url.remote() for _, api in cluster.apis])
        streams = Streams(urls, model, 6)
        streams.wait_streaming()
        ray_cluster.remove_node(victim, allow_graceful=False)
        outcomes = streams.join(30)
        assert all(o.kind == "complete" for o in outcomes if o.url != urls[2])
        assert all(o.kind == "error" for o in outcomes if o.url == urls[2])
        assert burst(urls[:2], model, 15) == [200] * 15
        _wait_for(lambda: httpx.get(f"{urls[0]}/ranks").json()["lost_ranks"] == [4, 5], 15, "ranks 4, 5 lost")
        _wait_for(lambda: {_states("lossy").get(f"engine:{r}") for r in (4, 5)} == {"DEAD"}, 60,
                  "status showing node 2's engines dead")
    finally:
        cluster.stop()
        ray_cluster.add_node(num_cpus=6, resources={NODE_RESOURCES[2]: 1})
        ray_cluster.wait_for_nodes()


@pytest.mark.slow
def test_a_killed_engines_streams_finish_on_its_sibling_under_up(ray_cluster):
    """tests/process/faults/test_migration.py through `hybridlb up`: the real SmolLM2 (float32), one node
    of two engine actors, kill -9 of engine 0's process while 16 streams (greedy, seeded, some
    with a JSON schema) run. Every stream completes with the text of the fault-free run."""
    cluster = start({
        "engine": {"model": SMOLLM2, "dtype": "float32", "quantization": "none", "max_model_len": 512,
                   "kv_cache_gib": 0.3, "torch_threads": 1},  # as in test_migration.py: exact recomputes
        "api": {"served_model_name": "smollm2"},
        "data_parallel": {"size": 2, "rpc_port": free_port(), "nodes": [
            {"size_local": 2, "api_port": free_port(), "ray_resource": NODE_RESOURCES[0]}]},
        "ray": {"name": "migrate", "cpus_per_engine": 1, "cpus_per_api_server": 1, "ready_timeout_s": 180},
    })
    try:
        (url,) = ray.get([api.url.remote() for _, api in cluster.apis])
        clean = _run(url)
        engine = _pid("hybridlb:migrate:engine:0")
        faulty = _run(url, lambda: os.kill(engine, signal.SIGKILL))
        for i, (got, expected) in enumerate(zip(faulty, clean, strict=True)):
            assert got == expected, (i, got, expected)
        assert _migrated(url) >= 1
        assert _health(url)["down_ranks"] == [0]
    finally:
        cluster.stop()
