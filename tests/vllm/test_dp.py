"""Data parallelism with vLLM's engine as the ranks: hybrid LB over two `serve` nodes, and a rank
killed with -9 mid-stream costing no request (its streams finish on the sibling rank, with the text
they would have had)."""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import pytest

from hybridlb.testing.ports import free_port
from hybridlb.testing.servers import Server, start_servers
from tests.process.faults.streams import run_streams

pytestmark = pytest.mark.slow
COMMON = ("--engine-backend", "vllm", "--enforce-eager", "--served-model-name", "smollm2", "--max-model-len", "512",
          "--kv-cache-gib", "0.5", "--dtype", "float32")
STREAMS = 8
MAX_TOKENS = 64


def _served(url: str) -> dict[int, float]:
    """Finished requests per rank, from /metrics."""
    counts: dict[int, float] = {}
    for rank, value in re.findall(r'^vllm:request_success_total\{[^}]*engine="(\d+)"[^}]*\} (\S+)$',
                                  httpx.get(f"{url}/metrics").text, re.M):
        counts[int(rank)] = counts.get(int(rank), 0) + float(value)
    return counts


def _complete(url: str, prompt: str) -> str:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 16, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_two_nodes_in_hybrid_lb_each_serve_with_their_own_vllm_rank(smollm2_hf_dir):
    rpc = free_port()
    head = Server(smollm2_hf_dir, *COMMON, "--data-parallel-size", "2", "--data-parallel-size-local", "1",
                  "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(rpc))
    worker = Server(smollm2_hf_dir, *COMMON, "--data-parallel-size", "2", "--data-parallel-size-local", "1",
                    "--data-parallel-start-rank", "1", "--data-parallel-address", "127.0.0.1",
                    "--data-parallel-rpc-port", str(rpc))
    start_servers(head, worker, timeout_s=300)
    try:
        prompts = [f"Fact number {i} about the ocean:" for i in range(4)]
        texts = {url: [_complete(url, p) for p in prompts] for url in (head.url, worker.url)}
        assert texts[head.url] == texts[worker.url]  # the same model and engine on both nodes
        assert _served(head.url) == {0: 4.0} and _served(worker.url) == {1: 4.0}
        ranks = httpx.get(f"{head.url}/ranks", timeout=10).json()
        assert ranks["ranks"] == [0] and not ranks.get("lost_ranks")
        assert "vLLM 0.32.0 engine core" in head.output and "vLLM 0.32.0 engine core" in worker.output
    finally:
        worker.stop()
        head.stop()


def _run(url: str, kill=None) -> list[tuple[str, str | None]]:
    bodies = [{"model": "smollm2", "prompt": f"Story number {i}: once upon a time", "max_tokens": MAX_TOKENS,
               "temperature": 0, "ignore_eos": True, "stream": True} for i in range(STREAMS)]
    return run_streams(url, "/v1/completions", bodies, kill)


def test_a_killed_vllm_rank_loses_no_stream_and_the_supervisor_restarts_it(smollm2_hf_dir):
    (server,) = start_servers(Server(smollm2_hf_dir, *COMMON, "--data-parallel-size", "2",
                                     "--restart-policy", "restart"), timeout_s=300)
    try:
        clean = _run(server.url)
        assert set(_served(server.url)) == {0, 1}  # both ranks took traffic
        engine = server.children()["hybridlb:engine:0"]
        faulty = _run(server.url, lambda: os.kill(engine, signal.SIGKILL))
        assert faulty == clean
        migrated = re.findall(r"^hybridlb:migrated_requests_total\{[^}]*\} (\S+)$",
                              httpx.get(f"{server.url}/metrics").text, re.M)
        assert sum(float(v) for v in migrated) >= 1
        deadline = time.monotonic() + 120  # the rank, not the node, starts again
        while httpx.get(f"{server.url}/health", timeout=10).json().get("down_ranks") != []:
            assert time.monotonic() < deadline, server.output[-3000:]
            time.sleep(0.5)
        assert server.children()["hybridlb:engine:0"] != engine
        body = {"model": "smollm2", "prompt": "Story number 0: once upon a time", "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True}
        again = httpx.post(f"{server.url}/v1/completions", json=body, headers={"X-data-parallel-rank": "0"},
                           timeout=120)
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == clean[0][0]
    finally:
        server.stop()
