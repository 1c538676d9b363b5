"""Multi-port mode (vLLM's `--data-parallel-multi-port-external-lb`, llm-d's pod shape since
mid-2026): one API server per local rank on `--port + i`, and one node supervisor whose
`/health` and `/readyz` carry the pod's probes for every rank."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import zmq

from hybridlb.testing.ports import free_port, free_port_range
from hybridlb.testing.servers import Server, completion, start_servers


def _supervisor(url: str) -> tuple[int, dict]:
    response = httpx.get(url, timeout=5)
    return response.status_code, response.json()


@pytest.fixture(scope="module")
def node(tiny_qwen3):
    port, supervisor = free_port_range(2), free_port()
    server = Server(tiny_qwen3, "--data-parallel-size", "2", "--data-parallel-multi-port-external-lb",
                    "--data-parallel-supervisor-port", str(supervisor), "--dp-supervisor-probe-interval-s", "0.5",
                    "--dp-supervisor-probe-timeout-s", "2", port=port)
    start_servers(server)
    yield server, f"http://127.0.0.1:{supervisor}"
    assert server.stop() == 0


def test_each_rank_has_its_own_port_and_the_supervisor_answers_for_the_node(node):
    server, supervisor = node
    for i in (0, 1):
        url = f"http://127.0.0.1:{server.port + i}"
        assert httpx.get(f"{url}/ranks").json()["ranks"] == [i]
        completion(url, server.model, "GPU")
    for path in ("/health", "/ready", "/readyz"):
        status, view = _supervisor(f"{supervisor}{path}")
        assert status == 200 and view["status"] == "ready", view
        assert {rank: entry["up"] for rank, entry in view["ranks"].items()} == {"0": True, "1": True}
    assert httpx.get(f"{supervisor}/v1/models").status_code == 404
    assert "its supervisor answers at" in server.output


def test_a_rank_header_naming_another_rank_is_ignored_on_a_rank_port(node):
    """A gateway that pins ranks by local index sends 0 or 1 to every node URL: a rank's own
    server serves it whatever the header says (as vLLM's children do)."""
    server, _ = node
    url = f"http://127.0.0.1:{server.port + 1}"
    for header in ("0", "1", "7"):
        response = httpx.post(f"{url}/v1/completions", headers={"X-data-parallel-rank": header}, timeout=60,
                              json={"model": server.model, "prompt": "GPU", "max_tokens": 2})
        assert response.status_code == 200, response.text


def test_a_rank_restarting_keeps_the_pod_ready_and_live_while_the_other_rank_serves(node):
    """A rank's restart is that rank's business: while its killed server reloads, the pod stays in
    the Service (readiness 200) and alive (liveness 200), rank 0 serves throughout, and only the
    body says rank 1 is down, then back under a new pid with one restart."""
    server, supervisor = node
    pid = _supervisor(f"{supervisor}/readyz")[1]["ranks"]["1"]["pid"]
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    while (answer := _supervisor(f"{supervisor}/readyz"))[1]["ranks"]["1"]["up"]:
        assert time.monotonic() - killed < 0.5, "the body still shows the rank up half a probe interval after"
        time.sleep(0.05)
    served = 0
    while True:
        status, view = answer
        assert status == 200 and view["status"] in ("degraded", "ready"), view
        assert _supervisor(f"{supervisor}/health")[0] == 200
        completion(f"http://127.0.0.1:{server.port}", server.model, f"rank 0 serves on ({served})")
        served += 1
        if (rank := view["ranks"]["1"])["up"] and rank["pid"] != pid:
            break
        assert time.monotonic() - killed < 60, "the rank did not come back"
        answer = _supervisor(f"{supervisor}/readyz")
    assert view["status"] == "ready" and rank["restarts"] == 1, view
    completion(f"http://127.0.0.1:{server.port + 1}", server.model, "back")


def test_a_rank_that_exhausts_its_restarts_fails_liveness_while_the_other_serves(node):
    """The launcher restarts a rank's server at most 3 times a minute; killed a 4th time it is
    left dead, and /health (liveness) turns 503 so the pod is restarted. Leaves rank 1 dead: the
    last test of this module's node."""
    server, supervisor = node
    killed = set()
    for _ in range(5):  # the window may hold the previous test's restart too
        deadline = time.monotonic() + 30
        while (rank := _supervisor(f"{supervisor}/readyz")[1]["ranks"]["1"])["pid"] in killed and not rank["failed"]:
            assert time.monotonic() < deadline, f"rank 1 was not restarted: {rank}"
            time.sleep(0.05)
        if rank["failed"]:
            break
        killed.add(rank["pid"])
        os.kill(rank["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while (health := _supervisor(f"{supervisor}/health"))[0] == 200:
        assert time.monotonic() < deadline, "liveness held with a rank left dead"
        time.sleep(0.1)
    status, view = health
    assert status == 503 and view["ranks"]["1"]["failed"] and "rank 1" in view["liveness_problem"], view
    assert _supervisor(f"{supervisor}/readyz")[0] == 200  # rank 0 serves until the kubelet restarts the pod
    completion(f"http://127.0.0.1:{server.port}", server.model, "still here")


def _dry_run(model: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridlb", "serve", model, *flags, "--dry-run"],
                          capture_output=True, text=True, timeout=120)


def test_vllm_rules_for_multi_port_each_with_its_fix(tiny_qwen3):
    ok = _dry_run(tiny_qwen3, "-dp", "4", "-dpl", "2", "-dpr", "2", "-dpm", "--port", "8200",
                  "--data-parallel-supervisor-port", "8208")
    assert ok.returncode == 0, ok.stderr
    assert "api:1.0@127.0.0.1:8200→[2], api:1.1@127.0.0.1:8201→[3], supervisor :8208" in ok.stdout
    assert "mode: multi_port" in ok.stdout and "coordinator: tcp://" in ok.stdout
    for flags, problem in (
        (["-dp", "1", "-dpm"], "needs --data-parallel-size of at least 2"),
        (["-dp", "4", "-dpl", "1", "-dpm"], "needs --data-parallel-size-local of at least 2"),
        (["-dp", "3", "-dpl", "2", "-dpm"], "is not a multiple of --data-parallel-size-local"),
        (["-dp", "2", "-dpm", "--port", "9000", "--data-parallel-supervisor-port", "9001"],
         "overlaps the ranks' ports 9000-9001"),
        (["-dp", "2", "-dpm", "--api-server-count", "2"], "exactly one API server per rank"),
        (["-dp", "2", "-dpm", "-dph"], "cannot be combined with --data-parallel-multi-port-external-lb"),
    ):
        run = _dry_run(tiny_qwen3, *flags)
        assert run.returncode != 0 and problem in run.stderr, (flags, run.stderr)
        assert "Traceback" not in run.stderr


def test_each_rank_names_its_own_port_in_its_kv_event_topic(tiny_qwen3):
    """llm-d's indexer keys a rank's KV-cache events by `kv@<pod ip>:<rank port>@<model>`: each engine
    fills its own port into the topic, and publishes on the endpoint's port plus its rank."""
    events = free_port_range(2)
    context = zmq.Context.instance()
    subs = []
    for i in (0, 1):
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        sub.bind(f"tcp://127.0.0.1:{events + i}")
        subs.append(sub)
    config = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{events}",
                         "topic": "kv@${POD_IP}:{port}@{model}"})
    port = free_port_range(2)
    server = Server(tiny_qwen3, "--data-parallel-size", "2", "-dpm", "--data-parallel-supervisor-port",
                    str(free_port()), "--kv-events-config", config, "--served-model-name", "m", port=port,
                    env={"POD_IP": "10.1.2.3"})
    try:
        start_servers(server)
        topics: list[set[bytes]] = [set(), set()]
        deadline = time.monotonic() + 30
        attempt = 0
        while not all(topics) and time.monotonic() < deadline:
            attempt += 1  # a new prompt each time: a cached one stores no block, so publishes nothing
            for i in (0, 1):
                completion(f"http://127.0.0.1:{port + i}", "m", f"attempt {attempt}: more than one block " * 4)
            for i, sub in enumerate(subs):
                while sub.poll(200):  # a bound SUB sends its subscription only while it is polled
                    topics[i].add(sub.recv_multipart()[0])
        assert topics == [{f"kv@10.1.2.3:{port}@m".encode()}, {f"kv@10.1.2.3:{port + 1}@m".encode()}], topics
    finally:
        server.stop()
        for sub in subs:
            sub.close(linger=0)
