"""`hybridlb render k8s` output run as a LeaderWorkerSet runs it (tests/netns): each pod's
command verbatim on a host of its own, with LWS's environment (the leader's address a DNS
name, the worker index, the group size), the ConfigMap mounted as a file where the pod mounts
it, the cluster token from the Secret, and the model from its hostPath volume."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import yaml

from tests.netns.hosts import HostNetwork
from tests.netns.test_serve_hosts import expected, ready, texts
from tests.servers import Server

pytestmark = pytest.mark.slow
API_PORT = 8800


@pytest.fixture(scope="module")
def config_mountpoint():
    """The directory pods mount their ConfigMap on (created for the test if missing; each pod binds
    its own copy over it in its private mount namespace, so the real one is never touched)."""
    target = Path("/etc/hybridlb")
    made = not target.exists()
    target.mkdir(exist_ok=True)
    yield target
    if made:
        target.rmdir()


def render(tmp_path: Path, config: dict) -> list[dict]:
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    manifest = tmp_path / "manifest.yaml"
    command = [sys.executable, "-m", "hybridlb", "render", "k8s", str(path), "--model-host-path",
               config["engine"]["model"], "--out", str(manifest)]
    assert os.spawnv(os.P_WAIT, sys.executable, command) == 0
    return list(yaml.safe_load_all(manifest.read_text()))


def run_pods(network: HostNetwork, docs: list[dict], tmp_path: Path) -> list[Server]:
    """Start every pod of the LeaderWorkerSet as the kubelet would, one host each."""
    by_kind = {d["kind"]: d for d in docs}
    lws = by_kind["LeaderWorkerSet"]
    name, size = lws["metadata"]["name"], lws["spec"]["leaderWorkerTemplate"]["size"]
    leader = f"{name}-0.{name}.default"  # the DNS name LWS gives the leader
    network.alias(network.hosts[0], leader)
    secrets = {d["metadata"]["name"]: d["stringData"] for d in docs if d["kind"] == "Secret"}
    pods = []
    for index in range(size):
        template = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate" if index == 0 else "workerTemplate"]
        container, volumes = template["spec"]["containers"][0], template["spec"]["volumes"]
        env = {"LWS_LEADER_ADDRESS": leader, "LWS_WORKER_INDEX": str(index), "LWS_GROUP_SIZE": str(size),
               "LWS_NAME": name, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
        for var in container.get("env", []):
            ref = var["valueFrom"]["secretKeyRef"]
            env[var["name"]] = secrets[ref["name"]][ref["key"]]
        mounts = {}
        for mount in container["volumeMounts"]:
            volume = next(v for v in volumes if v["name"] == mount["name"])
            if "configMap" in volume:
                files = tmp_path / f"pod{index}-{mount['name']}"
                files.mkdir()
                for key, text in by_kind["ConfigMap"]["data"].items():
                    (files / key).write_text(text)
                mounts[mount["mountPath"]] = str(files)
            elif "hostPath" in volume:
                mounts[mount["mountPath"]] = volume["hostPath"]["path"]
        host = network.hosts[index]
        pods.append(Server(name, port=API_PORT, host=host.address, command=container["command"], env=env,
                           launcher=lambda argv, host=host, mounts=mounts: network.command(host, argv, mounts)))
    return ready(f"LeaderWorkerSet pods, {size} hosts", *pods)


def cluster_config(model: str, **extra) -> dict:
    return {"engine": {"model": model, "dtype": "float32", "max_model_len": 512, "kv_cache_gib": 0.05, **extra},
            "api": {"port": API_PORT},
            "data_parallel": {"size": 4, "size_local": 2, "rpc_port": 29700,
                              "cluster_token": "lws-test-token-0123456789abcdef"}}


def test_lws_hybrid_pods_run_from_the_rendered_manifest(network, tiny_qwen3, tmp_path, config_mountpoint):
    docs = render(tmp_path, cluster_config(tiny_qwen3))
    pods = run_pods(network, docs, tmp_path)
    try:
        assert [texts(pod.url, tiny_qwen3) for pod in pods] == [expected(tiny_qwen3)] * 2
        assert "lws-test-token" not in docs[0]["data"]["config.yaml"]  # the token came from the Secret
    finally:
        for pod in reversed(pods):
            pod.stop()


def test_lws_moe_pods_form_the_expert_parallel_group(network, checkpoints, tmp_path, config_mountpoint):
    model = checkpoints("qwen3_moe")
    docs = render(tmp_path, cluster_config(model, expert_parallel=True))
    pods = run_pods(network, docs, tmp_path)
    try:
        assert [texts(pod.url, model) for pod in pods] == [expected(model)] * 2
    finally:
        for pod in reversed(pods):
            pod.stop()
