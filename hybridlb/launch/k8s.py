"""``hybridlb render k8s``: the same cluster as a LeaderWorkerSet (one pod per node, no Ray).

Each pod runs ``hybridlb serve`` with the shared config (a ConfigMap) and computes its
start rank from the worker index LeaderWorkerSet gives it; the leader (index 0) is the
head node. Every node that serves HTTP gets a Service and ``/health`` probes, which is
the one-pod-per-node shape llm-d deploys.
"""

from __future__ import annotations

import yaml

from hybridlb.config import Config
from hybridlb.plan import ClusterPlan

CONFIG_PATH = "/etc/hybridlb/config.yaml"
LWS_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"


class _NoAliases(yaml.SafeDumper):
    """Plain YAML for kubectl: repeated values written out, no &anchors / *aliases."""

    def ignore_aliases(self, data) -> bool:
        return True


class RenderError(ValueError):
    """The cluster cannot be expressed as a LeaderWorkerSet; the message says why."""


def serve_command(plan: ClusterPlan, size_local: int, headless: bool) -> str:
    """The shell command of every pod (worker index and leader address come from the env)."""
    flags = [
        "hybridlb serve", f"--config {CONFIG_PATH}", "--host 0.0.0.0",
        f"--data-parallel-size {plan.size}", f"--data-parallel-size-local {size_local}",
        '--data-parallel-start-rank "$START_RANK"', '--data-parallel-address "$LWS_LEADER_ADDRESS"',
        f"--data-parallel-rpc-port {plan.rpc_port}", f"--lb-mode {plan.mode}",
    ]
    if headless:
        flags.append("--headless")
    return f"START_RANK=$((LWS_WORKER_INDEX * {size_local})); exec " + " ".join(flags)


def _container(config: Config, plan: ClusterPlan, size_local: int, headless: bool, image: str) -> dict:
    cpus = size_local * config.ray.cpus_per_engine + (0 if headless else config.ray.cpus_per_api_server)
    resources = {"requests": {"cpu": str(cpus)}}
    if config.engine.device == "cuda":
        gpus = int(size_local * (config.ray.gpus_per_engine or 1))
        resources["limits"] = {"nvidia.com/gpu": str(gpus)}
    container = {
        "name": "hybridlb", "image": image, "command": ["sh", "-c", serve_command(plan, size_local, headless)],
        "resources": resources, "volumeMounts": [{"name": "config", "mountPath": "/etc/hybridlb"}],
        "ports": [{"containerPort": plan.rpc_port + i, "name": f"dp-{i}"} for i in range(5)],
    }
    if not headless:
        port = config.api.port
        container["ports"].append({"containerPort": port, "name": "http"})
        probe = {"httpGet": {"path": "/health", "port": port}, "periodSeconds": 10}
        container["readinessProbe"] = {**probe, "initialDelaySeconds": 5}
        container["livenessProbe"] = {**probe, "initialDelaySeconds": 300, "failureThreshold": 6}
    return container


def _pod(config: Config, plan: ClusterPlan, name: str, role: str, headless: bool, image: str) -> dict:
    size_local = len(plan.nodes[0].ranks)
    return {
        "metadata": {"labels": {"app": name, "role": role}},
        "spec": {
            "containers": [_container(config, plan, size_local, headless, image)],
            "volumes": [{"name": "config", "configMap": {"name": f"{name}-config"}}],
        },
    }


def render(config: Config, plan: ClusterPlan, image: str) -> str:
    """The manifest: ConfigMap, LeaderWorkerSet, and one Service per serving node."""
    sizes = {len(node.ranks) for node in plan.nodes}
    if len(sizes) > 1:
        raise RenderError("a LeaderWorkerSet gives every pod the same template: put the same number of ranks "
                          f"on every node (got {sorted(sizes)})")
    worker_headless = {node.headless for node in plan.nodes[1:]}
    if len(worker_headless) > 1:
        raise RenderError("the non-head nodes must all be headless or all serve HTTP")
    name = f"hybridlb-{config.ray.name}"
    shared = config.model_dump(mode="json", exclude_unset=True, exclude={"ray"})
    dp = shared.setdefault("data_parallel", {})
    for per_node in ("nodes", "start_rank", "size_local", "headless", "node_address", "rank"):
        dp.pop(per_node, None)
    documents = [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{name}-config"},
         "data": {"config.yaml": yaml.safe_dump(shared, sort_keys=False)}},
        {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet", "metadata": {"name": name},
         "spec": {"replicas": 1, "leaderWorkerTemplate": {
             "size": len(plan.nodes), "restartPolicy": "RecreateGroupOnPodRestart",
             "leaderTemplate": _pod(config, plan, name, "leader", plan.nodes[0].headless, image),
             "workerTemplate": _pod(config, plan, name, "worker", bool(worker_headless and worker_headless.pop()),
                                    image)}}},
    ]
    for node in plan.nodes:
        if node.headless:
            continue
        documents.append({
            "apiVersion": "v1", "kind": "Service", "metadata": {"name": f"{name}-node-{node.index}"},
            "spec": {"selector": {LWS_NAME_LABEL: name, LWS_INDEX_LABEL: str(node.index)},
                     "ports": [{"name": "http", "port": config.api.port, "targetPort": config.api.port}]},
        })
    return yaml.dump_all(documents, Dumper=_NoAliases, sort_keys=False)
