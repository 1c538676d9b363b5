"""The LeaderWorkerSet manifest: valid YAML, one pod per node, commands `hybridlb plan` accepts."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

from tests.unit.test_render_k8s import _containers, _documents, _kind, _problems, _schema


def _command_for(pod: dict, index: int, leader: str) -> list[str]:
    script = pod["spec"]["containers"][0]["command"][2]
    size_local = int(re.search(r"LWS_WORKER_INDEX \* (\d+)", script).group(1))
    serve = script.split("exec ", 1)[1]
    serve = serve.replace('"$START_RANK"', str(index * size_local)).replace('"$LWS_LEADER_ADDRESS"', leader)
    return shlex.split(serve)


def test_manifest_has_one_pod_per_node_and_valid_commands(tmp_path):
    docs = _documents("configs/multinode.yaml")
    kinds = [d["kind"] for d in docs]
    assert kinds == ["ConfigMap", "Secret", "LeaderWorkerSet", "Service", "Service", "Service", "NetworkPolicy"]
    lws = _kind(docs, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
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
    services = {d["metadata"]["name"]: d["spec"]["selector"] for d in docs if d["kind"] == "Service"}
    per_node = [s for name, s in services.items() if name.endswith(("-node-0", "-node-1"))]
    assert [s["leaderworkerset.sigs.k8s.io/worker-index"] for s in per_node] == ["0", "1"]
    # One Service across the group: every serving pod of it, on the API port.
    group = services["hybridlb-multinode"]
    assert group == {"leaderworkerset.sigs.k8s.io/name": "hybridlb-multinode", "llm-d.ai/inference-serving": "true"}
    assert lws["leaderTemplate"]["metadata"]["labels"]["llm-d.ai/inference-serving"] == "true"


def _render(path: Path, *flags: str) -> list[dict]:
    run = subprocess.run([sys.executable, "-m", "hybridlb", "render", "k8s", str(path), *flags],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return list(yaml.safe_load_all(run.stdout))


def test_a_config_without_a_token_renders_a_closed_handshake_and_kv_events_for_the_scheduler_only(tmp_path):
    """No token in the config: each render draws one into a Secret every pod reads, so only the
    group's pods can join; the NetworkPolicy comes by default and admits only the scheduler's pods
    (--kv-events-from) to the KV-event ports. Both can be turned off."""
    path = tmp_path / "lws.yaml"
    events = "{enable_kv_cache_events: true, endpoint: 'tcp://*:5557'}"
    path.write_text(f"engine: {{model: /models/m, kv_events: {events}}}\ndata_parallel: {{size: 4, size_local: 2}}\n")
    docs = _render(path, "--memory-gib", "8")
    token = _kind(docs, "Secret")
    assert token["metadata"]["name"] == "hybridlb-default-token" and len(token["stringData"]["token"]) >= 32
    assert _problems(token, _schema("secret-v1")) == []
    for container in _containers(docs):
        env = next(e for e in container["env"] if e["name"] == "HYBRIDLB_CLUSTER_TOKEN")
        assert env["valueFrom"]["secretKeyRef"] == {"name": "hybridlb-default-token", "key": "token"}
    assert token["stringData"]["token"] not in docs[0]["data"]["config.yaml"]
    assert _kind(_render(path, "--memory-gib", "8"), "Secret")["stringData"] != token["stringData"]  # drawn anew
    kv_rule = _kind(docs, "NetworkPolicy")["spec"]["ingress"][-1]
    assert kv_rule["from"] == [{"podSelector": {"matchLabels": {"inferencepool": "hybridlb-default-epp"}}}]
    assert kv_rule["ports"] == [{"protocol": "TCP", "port": 5557, "endPort": 5560}]
    policy = _kind(_render(path, "--memory-gib", "8", "--kv-events-from", "app=my-epp"), "NetworkPolicy")
    assert policy["spec"]["ingress"][-1]["from"] == [{"podSelector": {"matchLabels": {"app": "my-epp"}}}]

    bare = _render(path, "--memory-gib", "8", "--no-token-secret", "--no-network-policy")
    assert {d["kind"] for d in bare} == {"ConfigMap", "LeaderWorkerSet", "Service"}
    assert all(e["name"] != "HYBRIDLB_CLUSTER_TOKEN" for c in _containers(bare) for e in c["env"])
    path.write_text(path.read_text().replace("size_local: 2", "size_local: 2, cluster_token: a-token-of-32-chars"))
    run = subprocess.run([sys.executable, "-m", "hybridlb", "render", "k8s", str(path), "--no-token-secret"],
                         capture_output=True, text=True)
    assert run.returncode != 0 and "data_parallel.cluster_token is set" in run.stderr


def test_render_names_what_is_missing(tmp_path):
    path = tmp_path / "lws.yaml"
    path.write_text("engine: {model: /nowhere/model}\ndata_parallel: {size: 3, size_local: 2}\n")
    run = subprocess.run([sys.executable, "-m", "hybridlb", "render", "k8s", str(path)], capture_output=True, text=True)
    assert run.returncode != 0 and "multiple of --data-parallel-size-local" in run.stderr
    # A model that is not readable here (it lives on the cluster's volume): a default, and a note saying so.
    path.write_text("engine: {model: /nowhere/model}\ndata_parallel: {size: 4, size_local: 2}\n")
    run = subprocess.run([sys.executable, "-m", "hybridlb", "render", "k8s", str(path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "note: /nowhere/model is not readable here" in run.stderr and "--memory-gib" in run.stderr
    memory = yaml.safe_load_all(run.stdout)
    lws = next(d for d in memory if d["kind"] == "LeaderWorkerSet")
    container = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    assert container["resources"]["requests"]["memory"] == "36352Mi"  # 2 x (16 + 0.5 KV + 0.75) + 1 GiB


def test_the_readme_command_renders_the_multinode_config_as_written():
    """`hybridlb render k8s configs/multinode.yaml` (its model is not on this machine): valid manifests."""
    run = subprocess.run([sys.executable, "-m", "hybridlb", "render", "k8s", "configs/multinode.yaml"],
                         capture_output=True, text=True, cwd=Path(__file__).parents[2])
    assert run.returncode == 0, run.stderr
    docs = list(yaml.safe_load_all(run.stdout))
    schemas = {kind: _schema(f"{kind.lower()}-v1")
               for kind in ("ConfigMap", "Secret", "Service", "LeaderWorkerSet", "NetworkPolicy")}
    for document in docs:
        assert _problems(document, schemas[document["kind"]]) == [], document["kind"]
    assert [d["kind"] for d in docs].count("Service") == 3


def test_multi_port_renders_llm_d_s_pod_shape(tmp_path, tiny_qwen3):
    """`--lb multi-port`: a port per rank (what the InferencePool lists and the PodMonitor scrapes), the
    probes on the supervisor's port with llm-d's periods (liveness on /health, which only a rank left
    dead fails; readiness and start-up on /readyz, which a rank's restart does not), and pods that
    start multi-port serve."""
    path = tmp_path / "lws.yaml"
    path.write_text(f"engine: {{model: {tiny_qwen3}}}\napi: {{port: 8200}}\nlb: {{supervisor_port: 8208}}\n"
                    "data_parallel: {size: 4, size_local: 2}\n")
    run = subprocess.run([sys.executable, "-m", "hybridlb", "render", "k8s", str(path), "--lb", "multi-port"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    docs = list(yaml.safe_load_all(run.stdout))
    kinds = [d["kind"] for d in docs]
    assert kinds == ["ConfigMap", "Secret", "LeaderWorkerSet", "Service", "Service", "Service", "InferencePool",
                     "PodMonitor", "NetworkPolicy"]
    schemas = {kind: _schema(f"{kind.lower()}-v1") for kind in ("ConfigMap", "Secret", "Service", "LeaderWorkerSet",
                                                               "InferencePool", "PodMonitor", "NetworkPolicy")}
    templates = _schema("podtemplatespec-v1")
    for document in docs:
        assert _problems(document, schemas[document["kind"]]) == [], document["kind"]
    lws = _kind(docs, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    for role in ("leaderTemplate", "workerTemplate"):
        assert _problems(lws[role], templates) == [], role
        container = lws[role]["spec"]["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["rank0"] == 8200 and ports["rank1"] == 8201 and ports["supervisor"] == 8208
        assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "supervisor"}
        assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "supervisor"}
        assert container["startupProbe"]["httpGet"] == {"path": "/readyz", "port": "supervisor"}
        assert "--lb-mode multi_port" in container["command"][2]
    pool, monitor = _kind(docs, "InferencePool"), _kind(docs, "PodMonitor")
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [8200, 8201]
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["rank0", "rank1"]
    # Each pod's command plans what llm-d runs: two ranks on 8200 and 8201, the supervisor on 8208.
    shared = tmp_path / "config.yaml"
    shared.write_text(docs[0]["data"]["config.yaml"])
    argv = _command_for(lws["workerTemplate"], 1, "10.0.0.1")
    argv[argv.index("--config") + 1] = str(shared)
    plan = subprocess.run([sys.executable, "-m", "hybridlb", "plan", *argv[2:]], capture_output=True, text=True)
    assert plan.returncode == 0, plan.stderr
    assert "api:1.0@0.0.0.0:8200→[2], api:1.1@0.0.0.0:8201→[3]; supervisor :8208" in plan.stdout


def test_multi_port_pods_publish_kv_events_under_llm_d_s_topic(tmp_path, tiny_qwen3):
    path = tmp_path / "lws.yaml"
    path.write_text(f"engine: {{model: {tiny_qwen3}, kv_events: {{enable_kv_cache_events: true}}}}\n"
                    "data_parallel: {size: 4, size_local: 2}\n")
    run = subprocess.run([sys.executable, "-m", "hybridlb", "render", "k8s", str(path), "--lb", "multi-port"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    docs = list(yaml.safe_load_all(run.stdout))
    shared = yaml.safe_load(docs[0]["data"]["config.yaml"])
    assert shared["engine"]["kv_events"]["topic"] == "kv@${POD_IP}:{port}@{model}"  # each rank fills its port in
    container = _containers(docs)[1]
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in container["env"]


def _render_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridlb", "render", "k8s", *args], capture_output=True, text=True)


def test_what_the_manifest_assumes_is_said_and_heads_it(tmp_path, tiny_qwen3):
    """Where the model is read from, said on the terminal and at the top of the manifest: inside
    the image unless a volume is given; in llm-d's shape, the endpoint picker the InferencePool
    names and that the manifest does not run."""
    path = tmp_path / "lws.yaml"
    path.write_text("engine: {model: /models/Qwen3-8B}\ndata_parallel: {size: 4, size_local: 2}\n")
    run = _render_cli(str(path), "--image", "registry.example/hybridlb:1", "--lb", "multi-port")
    assert run.returncode == 0, run.stderr
    notes = [line for line in run.stderr.splitlines() if line.startswith("note: ")]
    assert any("/models/Qwen3-8B inside the image registry.example/hybridlb:1" in n and "--model-pvc" in n
               for n in notes), run.stderr
    assert any("endpoint picker Service hybridlb-default-epp" in n and "does not run" in n for n in notes), run.stderr
    head = run.stdout.split("apiVersion", 1)[0]
    for note in notes:  # the same lines head the file that gets applied
        assert f"#  - {note.removeprefix('note: ')}" in head
    assert "InferencePool" in [d["kind"] for d in yaml.safe_load_all(run.stdout)]

    run = _render_cli(str(path), "--model-pvc", "models", "--lb", "multi-port", "--no-inference-pool")
    assert run.returncode == 0, run.stderr
    assert "PersistentVolumeClaim 'models', mounted read-only at /models/Qwen3-8B" in run.stderr
    assert "inside the image" not in run.stderr
    # The chart makes the pool: what it must select and list is said instead.
    assert ("select llm-d.ai/inference-serving=true,leaderworkerset.sigs.k8s.io/name=hybridlb-default and list "
            "the target ports 8000, 8001") in run.stderr
    assert "InferencePool" not in [d["kind"] for d in yaml.safe_load_all(run.stdout)]


def test_a_hub_id_is_read_from_a_cache_on_the_model_volume(tmp_path):
    """`engine.model: org/name` is resolved in each pod, offline, from a Hugging Face cache on the
    model volume (never from the machine that renders); without a volume it is refused."""
    path = tmp_path / "hub.yaml"
    path.write_text("engine: {model: Qwen/Qwen3-0.6B}\ndata_parallel: {size: 2, size_local: 1}\n")
    refused = _render_cli(str(path))
    assert refused.returncode == 2 and "hub ID and pods never download: pass --model-pvc" in refused.stderr
    run = _render_cli(str(path), "--model-pvc", "hf-cache")
    assert run.returncode == 0, run.stderr
    docs = list(yaml.safe_load_all(run.stdout))
    assert yaml.safe_load(docs[0]["data"]["config.yaml"])["engine"]["model"] == "Qwen/Qwen3-0.6B"
    for container in _containers(docs):
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["HF_HUB_CACHE"] == "/hf-cache" and env["HF_HUB_OFFLINE"] == "1"
        assert {"name": "model", "mountPath": "/hf-cache", "readOnly": True} in container["volumeMounts"]
    assert "reads it offline from the Hugging Face cache on the PersistentVolumeClaim 'hf-cache'" in run.stderr
