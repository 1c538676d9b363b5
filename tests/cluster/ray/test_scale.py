"""Resizing a cluster `hybridlb up` placed on Ray (``hybridlb.launch.ray_scaling``): one node of a
dense model grows through vLLM's ``POST /scale_elastic_ep`` and shrinks through ``hybridlb
scale``; the new rank is an engine actor that serves, a restarted API server and a restarted
coordinator catch up with the current ranks, the leaving rank's actor is gone, and `down` leaves nothing behind."""

from __future__ import annotations

import time

import httpx
import pytest
import ray

from hybridlb.coordinator import LOST_AFTER_S
from hybridlb.launch.ray_scaling import scale
from hybridlb.launch.ray_session import UpError
from hybridlb.testing.ports import free_port
from hybridlb.testing.waiting import until
from tests.cluster.ray.conftest import NODE_RESOURCES
from tests.cluster.ray.test_up import start


def _ranks(url: str) -> list[int]:
    return httpx.get(f"{url}/ranks", timeout=10).json()["ranks"]


def _pinned(url: str, rank: int) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers={"X-data-parallel-rank": str(rank)}, timeout=60,
                      json={"model": "m", "prompt": "hi", "max_tokens": 2})


def _actors(name: str) -> list[str]:
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith(f"hybridlb:{name}:"))


def _answers(actor) -> bool:
    try:
        ray.get(actor.snapshot.remote(), timeout=10)
        return True
    except ray.exceptions.RayError:  # still restarting
        return False


def _one_node(model: str, name: str, size: int):
    """A one-node cluster of ``size`` ranks of ``model`` that restarts what dies, started."""
    return start({
        "engine": {"model": model, "max_model_len": 512, "kv_cache_gib": 0.05, "torch_threads": 1},
        "api": {"served_model_name": "m"},
        "data_parallel": {"size": size, "restart_policy": "restart", "nodes": [
            {"size_local": size, "api_port": free_port(), "ray_resource": NODE_RESOURCES[0]}]},
        "ray": {"name": name, "cpus_per_engine": 1, "cpus_per_api_server": 1, "ready_timeout_s": 120},
    })


def test_a_one_node_cluster_grows_shrinks_and_a_restarted_api_server_catches_up(ray_cluster, tiny_qwen3):
    cluster = _one_node(tiny_qwen3, "elastic", 1)
    try:
        ((_, api),) = cluster.apis
        url = ray.get(api.url.remote())
        grown = httpx.post(f"{url}/scale_elastic_ep", json={"new_data_parallel_size": 2}, timeout=300)
        assert grown.status_code == 200, grown.text
        assert _ranks(url) == [0, 1]
        pinned = _pinned(url, 1)
        assert pinned.status_code == 200, pinned.text
        assert "hybridlb:elastic:engine:1" in _actors("elastic")

        ray.kill(api, no_restart=False)  # Ray starts it again with the engines it first had: rank 0 alone
        deadline = time.monotonic() + 60
        while True:
            try:
                if _ranks(url) == [0, 1] and _pinned(url, 1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the restarted API server never took rank 1 again"
            time.sleep(0.5)

        with pytest.raises(UpError, match="room for at most"):
            scale("elastic", 1000, 5, None, "hybridlb")
        assert scale("elastic", 1, 5, None, "hybridlb") == "Scaled to 1 data parallel engines"
        assert _ranks(url) == [0]
        assert "hybridlb:elastic:engine:1" not in _actors("elastic")
        assert _pinned(url, 0).status_code == 200
        with pytest.raises(UpError, match="no resizable cluster named 'absent'"):
            scale("absent", 2, 5, None, "hybridlb")
    finally:
        cluster.stop()
    assert _actors("elastic") == []


def test_a_restarted_coordinator_counts_the_ranks_the_cluster_has_now(ray_cluster, tiny_qwen3):
    """Ray starts a killed coordinator with the arguments it first had (2 ranks); after a shrink to 1
    it asks the scaler, so it does not wait for rank 1 and report it lost."""
    cluster = _one_node(tiny_qwen3, "recount", 2)
    try:
        assert scale("recount", 1, 5, None, "hybridlb") == "Scaled to 1 data parallel engines"
        coordinator = ray.get_actor("hybridlb:recount:coordinator", "hybridlb")
        ray.kill(coordinator, no_restart=False)
        until(lambda: _answers(coordinator), 60, "the coordinator's restart", 0.5)
        time.sleep(LOST_AFTER_S + 1)  # a rank it expects and does not hear from is lost by then
        snapshot = ray.get(coordinator.snapshot.remote(), timeout=10)
        assert snapshot["lost_ranks"] == [] and [engine["rank"] for engine in snapshot["engines"]] == [0], snapshot
    finally:
        cluster.stop()
    assert _actors("recount") == []


def test_an_autoscaled_cluster_grows_under_load_and_shrinks_when_idle(ray_cluster, tiny_qwen3):
    """`hybridlb up` with an autoscaling section: the scaler actor follows the coordinator's loads as a
    `serve` launcher does. Rounds of 8 streams against a target of 2 per rank grow it to 2 ranks; idle,
    it shrinks back to 1; no stream fails and the texts stay those of the one-rank cluster."""
    import asyncio

    from tests.process.dp.test_scaling import _streams

    cluster = start({
        "engine": {"model": tiny_qwen3, "max_model_len": 1024, "kv_cache_gib": 0.05, "torch_threads": 1,
                   "dtype": "float32"},
        "api": {"served_model_name": "m"},
        "data_parallel": {"size": 1, "nodes": [
            {"size_local": 1, "api_port": free_port(), "ray_resource": NODE_RESOURCES[0]}]},
        "autoscaling": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2, "upscale_delay_s": 0.5,
                        "downscale_delay_s": 1.5, "drain_timeout_s": 5},
        "ray": {"name": "autoscaled", "cpus_per_engine": 1, "cpus_per_api_server": 1, "ready_timeout_s": 120},
    })
    try:
        ((_, api),) = cluster.apis
        url = ray.get(api.url.remote())
        texts = asyncio.run(_streams(url, "m"))
        deadline = time.monotonic() + 60
        while _ranks(url) != [0, 1]:  # streams in rounds until it grew
            assert time.monotonic() < deadline, "never grew"
            assert asyncio.run(_streams(url, "m")) == texts
        assert "hybridlb:autoscaled:engine:1" in _actors("autoscaled")
        deadline = time.monotonic() + 30
        while _ranks(url) != [0] or "hybridlb:autoscaled:engine:1" in _actors("autoscaled"):
            assert time.monotonic() < deadline, "never shrank"
            time.sleep(0.2)
        resizes = [line for line in httpx.get(f"{url}/metrics").text.splitlines()
                   if line.startswith("hybridlb:data_parallel_resizes_total{") and 'trigger="autoscaling"' in line]
        assert sorted(float(line.rsplit(" ", 1)[1]) for line in resizes) == [1.0, 1.0], resizes
        assert asyncio.run(_streams(url, "m")) == texts
    finally:
        cluster.stop()
