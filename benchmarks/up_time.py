"""How long ``hybridlb up`` takes to be ready, and the memory the Ray launcher adds.

1. configs/local.yaml (one node, two engines) with ``hybridlb serve`` and with
   ``hybridlb up`` (a private local Ray cluster): seconds from the command to its ready
   line, and resident memory of the whole process tree once ready; the difference is what
   Ray adds on one node (GCS, raylet, dashboard, core workers). RSS counts a page every
   process of the tree maps once per process; PSS splits it among them (the engines forked
   from one server share torch's pages), so PSS is what the tree costs the machine.
2. A three-node Ray cluster on this machine (``ray.cluster_utils.Cluster``) with two
   engines per node: seconds from ``up`` to ready, and each raylet's memory.

    python benchmarks/up_time.py
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from common import free_port, stamp, tree_rss_mib

from hybridlb.testing.procs import tree_pss_mib


def timed_start(command: list[str]) -> tuple[subprocess.Popen, float]:
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    for line in process.stdout:
        if "is ready" in line:
            return process, time.monotonic() - started
    raise RuntimeError(f"{command[3]} never became ready (exit {process.wait()})")


def stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGINT)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the group this script started
        process.wait()


def local_config(path: Path) -> Path:
    config = yaml.safe_load(Path("configs/local.yaml").read_text())
    config["api"]["port"] = free_port()
    config["ray"]["name"] = f"bench{os.getpid()}"
    path.write_text(yaml.safe_dump(config))
    return path


def one_node() -> dict:
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        config = local_config(Path(tmp) / "local.yaml")
        for name, command in (("serve", ["serve", "--config", str(config)]), ("up", ["up", str(config)])):
            process, seconds = timed_start([sys.executable, "-m", "hybridlb", *command])
            time.sleep(2)  # let resident memory settle
            rows[name] = {"ready_s": seconds, "tree_rss_mib": tree_rss_mib(process.pid),
                          "tree_pss_mib": tree_pss_mib(process.pid)}
            stop(process)
            print(f"  hybridlb {name:<6} ready in {seconds:5.1f} s, process tree {rows[name]['tree_rss_mib']:6.0f} MiB "
                  f"RSS, {rows[name]['tree_pss_mib']:6.0f} MiB PSS", flush=True)
    rows["ray_adds_mib"] = rows["up"]["tree_rss_mib"] - rows["serve"]["tree_rss_mib"]
    print(f"  Ray adds {rows['ray_adds_mib']:.0f} MiB on this node", flush=True)
    return rows


def three_nodes() -> dict:
    import ray
    from ray.cluster_utils import Cluster

    from hybridlb.config import parse_config
    from hybridlb.launch.ray_driver import RayCluster
    from hybridlb.plan import plan_cluster

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "resources": {"n0": 1}})
    for i in (1, 2):
        cluster.add_node(num_cpus=4, resources={f"n{i}": 1})
    ray.init(address=cluster.address, namespace="hybridlb", log_to_driver=False)
    model = str(Path("models/tiny-qwen3").resolve())
    config = parse_config({
        "engine": {"model": model, "make_if_missing": {"arch": "qwen3", "size": "tiny"}, "max_model_len": 512,
                   "kv_cache_gib": 0.05, "torch_threads": 1},
        "data_parallel": {"size": 6, "rpc_port": free_port(), "nodes": [
            {"size_local": 2, "api_port": free_port(), "ray_resource": f"n{i}"} for i in range(3)]},
        "ray": {"name": "bench3"},
    })
    if not Path(model, "config.json").exists():
        from hybridlb.model.make_model import make_model

        make_model("qwen3", "tiny", model)
    try:
        started = time.monotonic()
        up = RayCluster(config, plan_cluster(config), detached=False)
        up.start()
        seconds = time.monotonic() - started
        raylets = [tree_rss_mib(node.all_processes["raylet"][0].process.pid) for node in cluster.list_all_nodes()]
        up.stop()
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(f"  3 nodes x 2 engines: ready in {seconds:.1f} s after `up` started placing; raylet + workers per node "
          f"{', '.join(f'{r:.0f}' for r in raylets)} MiB", flush=True)
    return {"ready_s": seconds, "raylet_tree_rss_mib": raylets}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/up_time.json"))
    args = parser.parse_args()
    print("\n1. configs/local.yaml, one node")
    local = one_node()
    print("\n2. three Ray nodes on this machine")
    three = three_nodes()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": stamp(), "local": local, "three_nodes": three}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
