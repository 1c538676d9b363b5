"""The question llm-d answered by leaving hybrid LB, measured: does a gateway need every rank's
port, or does a hybrid-LB node that routes by cache inside itself do as well?

Two "nodes" of two ranks each on this machine (DP=4, SmolLM2 bfloat16), behind `vllm-router
--policy cache_aware`, on the prefix-heavy workloads of ``prefix_routing.py`` (8 shared system
prompts of ~1,000 tokens; multi-turn chats resending their history), KV cache under pressure:

* ``hybrid``: the router picks a node; the node's API server picks the rank (cache_aware);
* ``multi_port``: the router picks among the four ranks' own ports (multi-port nodes);
* ``vllm``: the router over two vLLM nodes with ``--data-parallel-hybrid-lb`` (vLLM picks the
  rank inside the node by load), each alone on the machine.

Each configuration runs alone (the others stopped), in alternating order, ``--rounds`` times;
figures are medians with each round's. Goal: hybrid >= multi_port, and hybrid >= 1.5x vllm.

    python benchmarks/gateways.py [--rounds 3] [--no-vllm] [--kv-cache-gib 0.15] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from common import Server, free_port, previous_results, smollm2_hf_dir, stamp, vllm_executable, wait_quiet
from prefix_routing import CONCURRENCY, OUTPUT_LEN, WORKLOADS, multiturn_workload, system_workload

from hybridlb.bench.client import BenchArgs, run_benchmark, run_sessions, summarize
from hybridlb.checkpoint.tokenizer import Tokenizer
from hybridlb.lifecycle import die_with_parent

ROUTER = str(Path(sys.executable).parent / "vllm-router")
COMMON = ("--dtype", "bfloat16", "--max-model-len", "2048", "--data-parallel-size", "4",
          "--data-parallel-size-local", "2", "--data-parallel-address", "127.0.0.1")
CONFIGS = ("hybrid", "multi_port", "vllm")


class Gateway:
    """vllm-router over ``urls``; quacks like a common.Server for ``prefix_routing.measure``."""

    def __init__(self, name: str, urls: list[str], model: str, nodes: list[Server]):
        self.name, self.model, self.nodes, self.urls = name, model, nodes, urls
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(f"/tmp/bench_gateway_{name}_{port}.log", "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen([ROUTER, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
                                         "--policy", "cache_aware"], stdout=self.log, stderr=subprocess.STDOUT,
                                        preexec_fn=die_with_parent)
        deadline = time.monotonic() + 120
        while not _healthy(self.url):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vllm-router did not start; see {self.log.name}")
            time.sleep(0.5)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)
        self.log.close()
        for node in self.nodes:
            node.stop()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def start(config: str, model: str, kv_gib: float, rpc: int) -> Gateway:
    """Two nodes of ``config`` and the router in front of them, ready."""
    nodes, urls = [], []
    for start_rank in (0, 2):
        flags = (*COMMON, "--data-parallel-start-rank", str(start_rank), "--data-parallel-rpc-port", str(rpc))
        if config == "vllm":
            node = Server.vllm(f"vllm-node{start_rank}", vllm_executable(), model, *flags, "--data-parallel-hybrid-lb")
        else:
            mode = ("--data-parallel-multi-port-external-lb", "--data-parallel-supervisor-port", str(free_port())) \
                if config == "multi_port" else ()
            node = Server.hybridlb(f"hybridlb-{config}-node{start_rank}", model, *flags, "--kv-cache-gib",
                                   str(kv_gib), *mode, port=_port_pair())
        nodes.append(node)
        urls += [f"http://127.0.0.1:{node.port + i}" for i in (0, 1)] if config == "multi_port" else [node.url]
    for node in nodes:
        node.wait_ready(900)
    return Gateway(config, urls, model, nodes)


def _port_pair() -> int:
    """A port whose successor is free too (a multi-port node's second rank)."""
    while True:
        port = free_port()
        if port < 65000 and _free(port + 1):
            return port


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def prefix_cache(urls: list[str]) -> tuple[float, float]:
    """(prompt tokens looked up, found cached) over every rank behind the gateway (vLLM's names)."""
    queries = hits = 0.0
    for url in urls:
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
            if line.startswith("vllm:prefix_cache_queries_total{"):
                queries += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:prefix_cache_hits_total{"):
                hits += float(line.rsplit(" ", 1)[1])
    return queries, hits


def measure(gateway: Gateway, vocab: int, round_seed: int) -> dict:
    """Both workloads through the gateway: throughput, TTFT and the ranks' prefix-cache hit rate."""
    rows = {}
    for workload in WORKLOADS:
        rng = random.Random(f"{workload}-{round_seed}")
        prompts = system_workload(rng, vocab) if workload == "system" else multiturn_workload(rng, vocab)
        wait_quiet([node.process.pid for node in gateway.nodes])
        queries, hits = prefix_cache(gateway.urls)
        args = BenchArgs(base_url=gateway.url, model=gateway.model, random_output_len=OUTPUT_LEN,
                         max_concurrency=CONCURRENCY, ignore_eos=True, progress=False)
        runner = run_benchmark if workload == "system" else run_sessions
        s = summarize(args, *asyncio.run(runner(args, prompts)))
        queries_now, hits_now = prefix_cache(gateway.urls)
        row = rows[workload] = {"failed": s["failed"], "output_tok_s": s["output_throughput"],
                                "p50_ttft_ms": s["median_ttft_ms"], "p99_ttft_ms": s["p99_ttft_ms"],
                                "hit_rate": (hits_now - hits) / max(queries_now - queries, 1)}
        print(f"  {gateway.name:<12}{workload:<11}{row['output_tok_s']:>7.0f} tok/s  "
              f"TTFT P50 {row['p50_ttft_ms']:>6.0f} P99 {row['p99_ttft_ms']:>6.0f} ms  "
              f"hits {row['hit_rate']:.0%}  failed {row['failed']}", flush=True)
    return rows


def warm_up(gateway: Gateway, vocab: int) -> None:
    args = BenchArgs(base_url=gateway.url, model=gateway.model, random_output_len=8, ignore_eos=True,
                     progress=False)
    rng = random.Random(-1)
    asyncio.run(run_benchmark(args, [[rng.randrange(vocab) for _ in range(64)] for _ in range(16)]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models-dir", type=Path, default=Path("models"))
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--kv-cache-gib", type=float, default=0.15, help="each hybridlb engine's KV cache")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gateways.json"))
    args = parser.parse_args()
    model = smollm2_hf_dir(args.models_dir)
    vocab = Tokenizer(model).vocab_size
    configs = [c for c in CONFIGS if c != "vllm" or not args.no_vllm]
    raw = {config: {workload: [] for workload in WORKLOADS} for config in configs}
    for round_index in range(args.rounds):
        print(f"round {round_index + 1}", flush=True)
        for config in configs if round_index % 2 == 0 else configs[::-1]:
            gateway = start(config, model, args.kv_cache_gib, 29800 + 20 * round_index)
            try:
                warm_up(gateway, vocab)
                for workload, row in measure(gateway, vocab, round_index).items():
                    raw[config][workload].append(row)
            finally:
                gateway.stop()
    table = {config: {workload: {key: statistics.median(r[key] for r in rows)
                                 for key in ("output_tok_s", "p50_ttft_ms", "p99_ttft_ms", "hit_rate", "failed")}
                      for workload, rows in workloads.items() if rows}
             for config, workloads in raw.items()}
    for config, workloads in table.items():
        for workload, row in workloads.items():
            rounds = ", ".join(f"{r['output_tok_s']:.0f}" for r in raw[config][workload])
            print(f"{config:<12}{workload:<11}{row['output_tok_s']:>7.0f} tok/s ({rounds})  TTFT P50 "
                  f"{row['p50_ttft_ms']:>6.0f} P99 {row['p99_ttft_ms']:>6.0f} ms  hits {row['hit_rate']:.0%}")
    meta = stamp(rounds=args.rounds, kv_cache_gib=args.kv_cache_gib, gateway="vllm-router cache_aware")
    previous = previous_results(args.out)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**previous, "meta": meta, "results": table, "raw": raw}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
