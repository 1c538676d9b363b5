"""`hybridlb render k8s` output run as a LeaderWorkerSet runs it (tests/cluster/netns): each pod's
command verbatim on a host of its own, with LWS's environment (the leader's address a DNS
name, the worker index, the group size), the ConfigMap mounted as a file where the pod mounts
it, the cluster token from the Secret, and the model from its hostPath volume."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from hybridlb.testing.servers import Server, completion
from tests.cluster.netns.hosts import HostNetwork
from tests.cluster.netns.test_serve_hosts import expected, ready, texts

pytestmark = pytest.mark.slow
API_PORT = 8800
SUPERVISOR_PORT = 8808


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


def render(tmp_path: Path, config: dict, *flags: str) -> list[dict]:
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    manifest = tmp_path / "manifest.yaml"
    command = [sys.executable, "-m", "hybridlb", "render", "k8s", str(path), "--model-host-path",
               config["engine"]["model"], "--out", str(manifest), *flags]
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
            if "value" in var:
                env[var["name"]] = var["value"]
                continue
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


def _supervisor(host_address: str, port: int, path: str = "/readyz") -> tuple[int, dict]:
    response = httpx.get(f"http://{host_address}:{port}{path}", timeout=5)
    return response.status_code, response.json()


def test_lws_multi_port_pods_serve_every_rank_port_under_their_supervisor(network, tiny_qwen3, tmp_path,
                                                                          config_mountpoint):
    """llm-d's shape from the rendered manifest: each pod's ranks on API_PORT + i, its probes on the
    supervisor port the manifest names."""
    config = cluster_config(tiny_qwen3)
    config["lb"] = {"supervisor_port": SUPERVISOR_PORT}
    docs = render(tmp_path, config, "--lb", "multi-port")
    pods = run_pods(network, docs, tmp_path)
    try:
        lws = next(d for d in docs if d["kind"] == "LeaderWorkerSet")
        container = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["supervisor"] == SUPERVISOR_PORT
        for host in network.hosts[:len(pods)]:
            for probe in ("/health", "/readyz"):
                # The supervisor sees every rank up on its next probe round, which may follow the
                # ranks' own readiness by a round (a Kubernetes probe retries the same way).
                deadline = time.monotonic() + 15
                while (answer := _supervisor(host.address, ports["supervisor"], probe))[0] != 200:
                    assert time.monotonic() < deadline, (probe, answer)
                    time.sleep(0.5)
            for i in (0, 1):
                assert texts(f"http://{host.address}:{ports[f'rank{i}']}", tiny_qwen3) == expected(tiny_qwen3)
    finally:
        for pod in reversed(pods):
            pod.stop()


# llm-d's wide-EP decode pod (guides/wide-ep-lws), verbatim but for its model and the
# --kv_transfer_config flag (prefill/decode disaggregation, not implemented): ranks on 8200+,
# the supervisor on 8208, the start rank from LWS's worker index.
LLM_D_DECODE = (
    "START_RANK=$(( ${LWS_WORKER_INDEX:-0} * DP_SIZE_LOCAL )); exec hybridlb serve {model} --port 8200 "
    "--disable-access-log-for-endpoints=/health,/metrics --data-parallel-multi-port-external-lb "
    "--data-parallel-supervisor-port=8208 --enable-expert-parallel --tensor-parallel-size $TP_SIZE "
    "--max-num-batched-tokens ${MAX_TOKENS} --max-num-seqs ${MAX_TOKENS} "
    "--data-parallel-size $((LWS_GROUP_SIZE * DP_SIZE_LOCAL)) --data-parallel-size-local $DP_SIZE_LOCAL "
    "--data-parallel-address ${LWS_LEADER_ADDRESS} --data-parallel-rpc-port 5555 "
    "--data-parallel-start-rank $START_RANK --enable-dbo --dbo-decode-token-threshold 32 "
    "--all2all-backend deepep_low_latency --moe-backend deep_gemm"
)


def test_llm_d_decode_command_runs_and_its_probes_answer(network, checkpoints):
    """The command llm-d ships, on two hosts with LWS's environment: every rank port and both
    supervisors answer; a killed rank server shows down at once and is brought back while its
    pod stays ready and live and the pod's other rank serves."""
    model = checkpoints("qwen3_moe")
    leader = "decode-0.decode.default"
    network.alias(network.hosts[0], leader)
    pods = []
    for index, host in enumerate(network.hosts[:2]):
        env = {"LWS_LEADER_ADDRESS": leader, "LWS_WORKER_INDEX": str(index), "LWS_GROUP_SIZE": "2",
               "DP_SIZE_LOCAL": "2", "TP_SIZE": "1", "MAX_TOKENS": "256", "KUBERNETES_SERVICE_HOST": "10.96.0.1",
               "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
        command = ["sh", "-c", LLM_D_DECODE.replace("{model}", model)]
        pods.append(Server(model, port=8200, host=host.address, command=command, env=env,
                           launcher=lambda argv, host=host: network.command(host, argv)))
    pods = ready("llm-d decode pods, 2 hosts", *pods)
    try:
        for pod, host in zip(pods, network.hosts, strict=False):
            assert "note: --all2all-backend" in pod.output and "note: --moe-backend" in pod.output
            for port in (8200, 8201):
                completion(f"http://{host.address}:{port}", model, "GPU")
            status, view = _supervisor(host.address, 8208)
            assert status == 200 and view["status"] == "ready", view
            assert _supervisor(host.address, 8208, "/health")[0] == 200
        worker = network.hosts[1]
        pid = _supervisor(worker.address, 8208)[1]["ranks"]["3"]["pid"]
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        while _supervisor(worker.address, 8208)[1]["ranks"]["3"]["up"]:
            assert time.monotonic() - killed < 5.0, "rank 3 still shows up (llm-d's probe interval: 5 s)"
            time.sleep(0.05)
        while True:  # readiness and liveness hold while rank 3 restarts; rank 2 serves on
            status, view = _supervisor(worker.address, 8208)
            assert status == 200 and _supervisor(worker.address, 8208, "/health")[0] == 200, view
            completion(f"http://{worker.address}:8200", model, "rank 2 serves on")
            if view["ranks"]["3"]["up"] and view["ranks"]["3"]["pid"] != pid:
                break
            assert time.monotonic() - killed < 90, "the rank's server was not brought back"
            time.sleep(0.5)
        completion(f"http://{worker.address}:8201", model, "back again")
    finally:
        for pod in reversed(pods):
            pod.stop()
