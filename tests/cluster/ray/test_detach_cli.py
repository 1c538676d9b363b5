"""`hybridlb up --detach`, `status` and `down` against an existing Ray cluster, as commands."""

from __future__ import annotations

import subprocess
import sys

import httpx
import yaml

from hybridlb.testing.ports import free_port
from tests.cluster.ray.conftest import NODE_RESOURCES


def _hybridlb(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridlb", *args], capture_output=True, text=True, timeout=300)


def test_detached_cluster_status_and_down(ray_cluster, tiny_qwen3, tmp_path):
    port = free_port()
    config = {
        "engine": {"model": tiny_qwen3, "max_model_len": 512, "kv_cache_gib": 0.05, "torch_threads": 1},
        "api": {"port": port},
        "data_parallel": {"size": 2, "rpc_port": free_port(),
                          "nodes": [{"size_local": 2, "ray_resource": NODE_RESOURCES[1]}]},
        "ray": {"name": "detached"},
    }
    path = tmp_path / "detached.yaml"
    path.write_text(yaml.safe_dump(config))
    address = ray_cluster.address
    try:
        started = _hybridlb("up", str(path), "--detach", "--address", address)
        assert started.returncode == 0, started.stdout + started.stderr
        assert "hybridlb down detached" in started.stdout
        # the driver is gone; the cluster still serves
        body = {"model": tiny_qwen3, "prompt": "still here", "max_tokens": 3}
        assert httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60).status_code == 200
        listed = _hybridlb("status", "detached", "--address", address)
        assert listed.returncode == 0, listed.stderr
        for name in ("hybridlb:detached:engine:0", "hybridlb:detached:engine:1", "hybridlb:detached:api:0",
                     "hybridlb:detached:coordinator"):
            assert name in listed.stdout and "ALIVE" in listed.stdout
        again = _hybridlb("up", str(path), "--detach", "--address", address)
        assert again.returncode == 2 and "already up" in again.stderr
    finally:
        stopped = _hybridlb("down", "detached", "--address", address)
    assert stopped.returncode == 0, stopped.stderr
    after = _hybridlb("status", "detached", "--address", address)
    assert "ALIVE" not in after.stdout  # the state API may still list them, as DEAD
