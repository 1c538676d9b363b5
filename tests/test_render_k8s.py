"""The LeaderWorkerSet manifest: valid YAML, one pod per node, commands `hybridlb plan` accepts."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import yaml

from hybridlb.config import load_config
from hybridlb.launch.k8s import RenderError, render
from hybridlb.plan import plan_cluster


def _documents(config_path: str) -> list[dict]:
    config = load_config(config_path)
    return list(yaml.safe_load_all(render(config, plan_cluster(config, is_moe=None), "img:1")))


def _command_for(pod: dict, index: int, leader: str) -> list[str]:
    script = pod["spec"]["containers"][0]["command"][2]
    size_local = int(re.search(r"LWS_WORKER_INDEX \* (\d+)", script).group(1))
    serve = script.split("exec ", 1)[1]
    serve = serve.replace('"$START_RANK"', str(index * size_local)).replace('"$LWS_LEADER_ADDRESS"', leader)
    return shlex.split(serve)


def test_manifest_has_one_pod_per_node_and_valid_commands(tmp_path):
    docs = _documents("configs/multinode.yaml")
    kinds = [d["kind"] for d in docs]
    assert kinds == ["ConfigMap", "LeaderWorkerSet", "Service", "Service"]
    lws = docs[1]["spec"]["leaderWorkerTemplate"]
    assert lws["size"] == 2
    shared = tmp_path / "config.yaml"
    shared.write_text(docs[0]["data"]["config.yaml"])
    for index, pod in ((0, lws["leaderTemplate"]), (1, lws["workerTemplate"])):
        container = pod["spec"]["containers"][0]
        assert container["readinessProbe"]["httpGet"]["path"] == "/health"
        argv = _command_for(pod, index, "10.0.0.1")
        assert argv[:2] == ["hybridlb", "serve"]
        assert argv[argv.index("--data-parallel-start-rank") + 1] == str(2 * index)
        argv[argv.index("--config") + 1] = str(shared)
        plan = subprocess.run([sys.executable, "-m", "hybridlb", "plan", *argv[2:]], capture_output=True, text=True)
        assert plan.returncode == 0, plan.stderr
        assert f"{2 * index}..{2 * index + 1}" in plan.stdout
    services = {d["metadata"]["name"]: d["spec"]["selector"] for d in docs[2:]}
    assert [s["leaderworkerset.sigs.k8s.io/worker-index"] for s in services.values()] == ["0", "1"]


def test_uneven_nodes_cannot_be_a_leaderworkerset(tmp_path):
    path = tmp_path / "uneven.yaml"
    path.write_text("engine: {model: m}\ndata_parallel: {size: 3, nodes: [{size_local: 2, address: 10.0.0.1}, "
                    "{size_local: 1, address: 10.0.0.2}]}\n")
    config = load_config(path)
    try:
        render(config, plan_cluster(config, is_moe=None), "img")
    except RenderError as exc:
        assert "same number of ranks on every node" in str(exc)
    else:
        raise AssertionError("rendered an uneven cluster")
