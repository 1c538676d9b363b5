"""The gateways vLLM users put in front of data-parallel servers, as the package index ships
them: `vllm-router` (pins a rank inside each node with `X-data-parallel-rank`, a local index)
and `smg` (the SGLang/Shepherd model gateway), in front of two hybridlb nodes of two ranks,
as hybrid-LB nodes and as multi-port nodes."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from hybridlb import LLM, SamplingParams
from hybridlb.lifecycle import die_with_parent
from hybridlb.testing.ports import free_port, free_port_range
from hybridlb.testing.servers import Server, start_servers
from tests.conftest import PROMPTS

BIN = Path(sys.executable).parent
ROUTER, SMG = BIN / "vllm-router", BIN / "smg"
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (ROUTER.exists() and SMG.exists()), reason="vllm-router / smg not installed")]
REQUESTS = 200
MAX_TOKENS = 8


def _flags(start_rank: int, rpc: int, *extra: str) -> list[str]:
    return ["--data-parallel-size", "4", "--data-parallel-size-local", "2", "--data-parallel-start-rank",
            str(start_rank), "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(rpc), *extra]


@pytest.fixture(scope="module")
def hybrid_nodes(tiny_qwen3):
    rpc = free_port_range(5)
    nodes = start_servers(Server(tiny_qwen3, *_flags(0, rpc)), Server(tiny_qwen3, *_flags(2, rpc)))
    yield nodes
    for node in nodes:
        node.stop()


@pytest.fixture(scope="module")
def multi_port_nodes(tiny_qwen3):
    rpc = free_port_range(5)
    nodes = []
    for start in (0, 2):
        port, supervisor = free_port_range(2), free_port()
        nodes.append(Server(tiny_qwen3, *_flags(start, rpc, "--data-parallel-multi-port-external-lb",
                                                "--data-parallel-supervisor-port", str(supervisor)), port=port))
    start_servers(*nodes)
    yield nodes
    for node in nodes:
        node.stop()


@pytest.fixture(scope="module")
def expected(tiny_qwen3) -> dict[str, str]:
    """Greedy text of every prompt from the offline engine (float32, as the servers run)."""
    llm = LLM(tiny_qwen3, max_model_len=512, dtype="float32", kv_cache_gib=0.05)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    return {prompt: output.text for prompt, output in zip(PROMPTS, outputs, strict=True)}


class Gateway:
    """A gateway process on a free port, up once its own /health answers."""

    def __init__(self, *command: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen([*command, "--host", "127.0.0.1", "--port", str(self.port)],
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        preexec_fn=die_with_parent)
        deadline = time.monotonic() + 120
        while True:
            assert self.process.poll() is None, self.process.stdout.read()
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the gateway never answered /health"
            time.sleep(0.5)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def _counts(url: str, metric: str) -> dict[int, float]:
    text = httpx.get(f"{url}/metrics").text
    found: dict[int, float] = {}
    for engine, value in re.findall(rf'^{metric}\{{[^}}]*engine="(\d+)"[^}}]*\}} (\S+)$', text, re.M):
        found[int(engine)] = found.get(int(engine), 0) + float(value)
    return found


def _served(urls: list[str], metric: str = "vllm:request_success_total") -> dict[int, float]:
    total: dict[int, float] = {}
    for url in urls:
        for rank, value in _counts(url, metric).items():
            total[rank] = total.get(rank, 0) + value
    return total


async def _send(url: str, model: str, count: int) -> list[tuple[str, str]]:
    """``count`` greedy completions through the gateway, 16 at a time: (prompt, text) of each."""
    semaphore = asyncio.Semaphore(16)
    async with httpx.AsyncClient(timeout=120) as client:
        async def one(i: int) -> tuple[str, str]:
            prompt = PROMPTS[i % len(PROMPTS)]
            body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                    "ignore_eos": True}
            async with semaphore:
                response = await client.post(f"{url}/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return prompt, response.json()["choices"][0]["text"]

        return await asyncio.gather(*(one(i) for i in range(count)))


def _through(gateway: Gateway, model: str, expected: dict[str, str]) -> None:
    try:
        for prompt, text in asyncio.run(_send(gateway.url, model, REQUESTS)):
            assert text == expected[prompt], prompt
        assert httpx.get(f"{gateway.url}/health").status_code == 200
    finally:
        gateway.stop()


def test_vllm_router_pins_a_rank_inside_each_hybrid_node(hybrid_nodes, expected):
    urls = [node.url for node in hybrid_nodes]
    served, pinned = _served(urls), _served(urls, "hybridlb:pinned_requests_total")
    _through(Gateway(str(ROUTER), "--worker-urls", *urls, "--intra-node-data-parallel-size", "2", "--policy",
                     "cache_aware"), hybrid_nodes[0].model, expected)
    served_now, pinned_now = _served(urls), _served(urls, "hybridlb:pinned_requests_total")
    for rank in range(4):  # every request came pinned, and ran on the rank it named
        assert pinned_now[rank] - pinned.get(rank, 0) == served_now[rank] - served.get(rank, 0), rank
    assert sum(pinned_now.values()) - sum(pinned.values()) == REQUESTS
    assert all(pinned_now[rank] > pinned.get(rank, 0) for rank in range(4)), pinned_now


def test_smg_routes_among_hybrid_nodes(hybrid_nodes, expected):
    urls = [node.url for node in hybrid_nodes]
    served = _served(urls)
    _through(Gateway(str(SMG), "launch", "--worker-urls", *urls, "--policy", "cache_aware"), hybrid_nodes[0].model,
             expected)
    served_now = _served(urls)
    assert sum(served_now.values()) - sum(served.values()) == REQUESTS


@pytest.mark.parametrize("gateway", ["vllm-router", "smg"])
def test_gateways_pick_among_the_rank_ports_of_multi_port_nodes(multi_port_nodes, expected, gateway):
    urls = [f"http://127.0.0.1:{node.port + i}" for node in multi_port_nodes for i in (0, 1)]
    served = _served(urls)
    command = [str(ROUTER)] if gateway == "vllm-router" else [str(SMG), "launch"]
    _through(Gateway(*command, "--worker-urls", *urls, "--policy", "cache_aware"), multi_port_nodes[0].model,
             expected)
    served_now = _served(urls)
    assert sum(served_now.values()) - sum(served.values()) == REQUESTS
    assert all(served_now[rank] > served.get(rank, 0) for rank in range(4)), served_now

