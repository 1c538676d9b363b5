"""`hybridlb serve` across hosts with their own network stacks (tests/cluster/netns): every node binds
only its own address, reaches the head by its DNS name, and serves the right tokens, in each
layout: hybrid, internal LB with headless workers, external LB, MoE with expert parallelism
(its torch.distributed group across addresses) and a cluster token (CURVE)."""

from __future__ import annotations

import functools
import sys
import time

import httpx
import pytest

from hybridlb import LLM, SamplingParams
from hybridlb.testing.servers import Server, completion, start_servers
from tests.cluster.netns.hosts import Host, HostNetwork

pytestmark = pytest.mark.slow
PROMPTS = ["The test bed", "Hosts of their own", "A network namespace"]


def serve_on(network: HostNetwork, host: Host, model: str, *flags: str) -> Server:
    """`hybridlb serve` on ``host``, its API on the host's own address."""
    return Server(model, *flags, host=host.address, launcher=lambda argv: network.command(host, argv))


def dp_flags(network: HostNetwork, size: int, size_local: int, start_rank: int, rpc_port: int) -> list[str]:
    """A node of a cluster whose head is the first host, reached by its name (as LWS pods do)."""
    return ["--data-parallel-size", str(size), "--data-parallel-size-local", str(size_local),
            "--data-parallel-start-rank", str(start_rank), "--data-parallel-address", network.hosts[0].name,
            "--data-parallel-rpc-port", str(rpc_port)]


def two_nodes(network: HostNetwork, model: str, rpc_port: int, *flags: str, worker_flags: tuple[str, ...] = (),
              layout: str = "") -> tuple[Server, Server]:
    """Ranks 0-1 on the first host (the head), 2-3 on the second; started and ready (with
    ``layout``, the time that took is printed)."""
    head = serve_on(network, network.hosts[0], model, *dp_flags(network, 4, 2, 0, rpc_port), *flags)
    worker = serve_on(network, network.hosts[1], model, *dp_flags(network, 4, 2, 2, rpc_port), *flags, *worker_flags)
    ready(layout, head, worker) if layout else start_servers(head, worker)
    return head, worker


def listeners(network: HostNetwork, host: Host) -> set[str]:
    """The addresses TCP sockets listen on in ``host``'s namespace."""
    out = network.run(host, ["ss", "-Hltn"]).stdout
    return {line.split()[3].rsplit(":", 1)[0] for line in out.splitlines() if line.strip()}


def greedy(url: str, model: str, prompt: str) -> list[str]:
    body = completion(url, model, prompt, max_tokens=8, logprobs=0)
    return body["choices"][0]["logprobs"]["tokens"]


@functools.cache
def expected(model: str) -> dict[str, str]:
    """Greedy text of each prompt from one offline engine in this process (float32, as the servers)."""
    llm = LLM(model, max_model_len=512, kv_cache_gib=0.05, dtype="float32")
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0))
    return {prompt: out.text for prompt, out in zip(PROMPTS, outputs, strict=True)}


def texts(url: str, model: str) -> dict[str, str]:
    return {p: completion(url, model, p, max_tokens=8)["choices"][0]["text"] for p in PROMPTS}


def assert_binds_only_own_address(network: HostNetwork, *hosts: Host) -> None:
    for host in hosts:
        bound = listeners(network, host)
        assert bound and bound <= {host.address, "127.0.0.1"}, (host.name, bound)


def ready(layout: str, *servers: Server) -> list[Server]:
    """Start ``servers`` together; print how long the layout took to be ready (`pytest -s`)."""
    started = time.monotonic()
    start_servers(*servers)
    print(f"\n{layout}: ready in {time.monotonic() - started:.1f} s")
    return list(servers)


def stop_all(*servers: Server) -> None:
    codes = [server.stop() for server in reversed(servers)]
    assert codes == [0] * len(servers), [s.output[-2000:] for s in servers]


# Run on a host that is not part of the cluster: push forged stats to the head's coordinator
# and listen for its load snapshots.
FORGER = """
import sys, time, zmq
from hybridlb.protocol import EngineStats, encoder
context = zmq.Context()
push = context.socket(zmq.PUSH)
push.connect(sys.argv[1])
sub = context.socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.connect(sys.argv[2])
fake = EngineStats(rank=0, num_running=999, num_waiting=999, kv_usage=1.0, seq=10**9, epoch=10**19)
for _ in range(20):
    try:
        push.send(encoder.encode(fake), zmq.NOBLOCK)
    except zmq.Again:
        pass
    time.sleep(0.1)
print("snapshots received:", bool(sub.poll(1500)))
context.destroy(linger=0)
"""


def test_hybrid_each_host_serves_its_own_ranks(network, tiny_qwen3):
    """Without a cluster token, too: a process on a third host cannot feed the coordinator
    forged stats or read its snapshots (the nodes share a key drawn for the run)."""
    a, b, c = network.hosts
    head, worker = two_nodes(network, tiny_qwen3, 29500, layout="hybrid, 2 hosts x 2 ranks")
    try:
        for server, ranks in ((head, [0, 1]), (worker, [2, 3])):
            assert httpx.get(f"{server.url}/ranks", timeout=10).json()["ranks"] == ranks
        forger = network.run(c, [sys.executable, "-c", FORGER, f"tcp://{a.address}:29501", f"tcp://{a.address}:29502"])
        assert "snapshots received: False" in forger.stdout, forger.stdout + forger.stderr
        for server in (head, worker):
            cluster = httpx.get(f"{server.url}/ranks", timeout=10).json()["cluster"]
            assert {s["rank"] for s in cluster} == {0, 1, 2, 3} and all(s["num_running"] != 999 for s in cluster)
        assert texts(head.url, tiny_qwen3) == texts(worker.url, tiny_qwen3) == expected(tiny_qwen3)
        assert_binds_only_own_address(network, a, b)
    finally:
        stop_all(head, worker)


def test_internal_lb_headless_workers_reach_the_head_by_name(network, tiny_qwen3):
    a, b, c = network.hosts
    head = serve_on(network, a, tiny_qwen3, *dp_flags(network, 3, 1, 0, 29510), "--lb-mode", "internal")
    workers = [serve_on(network, host, tiny_qwen3, *dp_flags(network, 3, 1, rank, 29510), "--lb-mode", "internal",
                        "--headless") for rank, host in ((1, b), (2, c))]
    ready("internal LB, 3 hosts, 2 headless", head, *workers)
    try:
        engines = sorted(httpx.get(f"{head.url}/ranks", timeout=10).json()["engines"], key=lambda e: e["rank"])
        # Each worker's engine listens on that worker's own address, learnt from its route to the head.
        assert [e["address"].split("//")[1].split(":")[0] for e in engines[1:]] == [b.address, c.address]
        for _ in range(12):
            completion(head.url, tiny_qwen3, "spread me", max_tokens=2)
        time.sleep(1.5)
        served = {e["rank"]: e["steps"] for e in httpx.get(f"{head.url}/ranks", timeout=10).json()["engines"]}
        assert all(steps > 0 for steps in served.values()), served
        assert_binds_only_own_address(network, a, b, c)
    finally:
        stop_all(head, *workers)


def test_external_lb_one_server_per_rank_on_its_own_host(network, tiny_qwen3):
    servers = [serve_on(network, host, tiny_qwen3, "--data-parallel-size", "2", "--data-parallel-rank", str(rank))
               for rank, host in enumerate(network.hosts[:2])]
    ready("external LB, 2 hosts x 1 rank", *servers)
    try:
        assert [texts(s.url, tiny_qwen3) for s in servers] == [expected(tiny_qwen3)] * 2
        assert_binds_only_own_address(network, *network.hosts[:2])
    finally:
        stop_all(*servers)


def test_moe_expert_parallel_group_forms_across_hosts(network, checkpoints):
    """The hosts' names resolve to 127.0.1.1 locally: the group must use the routed address."""
    model = checkpoints("qwen3_moe")
    a, b = network.hosts[:2]
    head, worker = two_nodes(network, model, 29520, "--enable-expert-parallel",
                             layout="MoE expert parallel, 2 hosts x 2 ranks")
    try:
        assert texts(head.url, model) == texts(worker.url, model) == expected(model)
        assert_binds_only_own_address(network, a, b)
        assert "connects from 127." not in head.output + worker.output
    finally:
        stop_all(head, worker)


def test_cluster_token_secures_the_links_and_refuses_a_stranger(network, tiny_qwen3):
    a, b, c = network.hosts
    token = ("--cluster-token", "netns-secret-token-0123456789")
    head, worker = two_nodes(network, tiny_qwen3, 29530, *token,
                             layout="hybrid with a cluster token (CURVE), 2 hosts x 2 ranks")
    stranger = serve_on(network, c, tiny_qwen3, *dp_flags(network, 4, 2, 2, 29530),
                        "--cluster-token", "another-token-9876543210abcdef")
    try:
        assert stranger.process.wait(60) == 1
        assert "cluster token differs" in stranger.output
        assert texts(worker.url, tiny_qwen3) == expected(tiny_qwen3)
        assert_binds_only_own_address(network, a, b)
    finally:
        stranger.stop()
        stop_all(head, worker)
