"""Rank-level quality with vLLM's engine: how evenly hybridlb spreads work over vLLM ranks, and how much of a
multi-turn chat's history its cache-aware routing finds cached, against vLLM's own DP=2 hybrid LB (the
same vLLM release) and hybridlb's own engine.

Servers (each alone on the machine: started, warmed up, measured, stopped; rounds alternate the order):
``hybridlb`` is `hybridlb serve --engine-backend vllm --data-parallel-size 2` (its default LB policy,
cache_aware), ``vllm`` is `vllm serve --data-parallel-size 2 --data-parallel-size-local 2
--data-parallel-hybrid-lb`, ``hybridlb-own`` is hybridlb's own engine with the same flags. SmolLM2-135M-Instruct
(the Hugging Face directory made from the bundled GGUF), float32 by default (this AVX2 CPU has no native
bfloat16), 1 GiB of KV cache per rank on every server.

Workloads (prompts are token ids, new random ones every round, so nothing is cached from a previous run):

* ``mixed``: 96 requests, 16 in flight, prompts of 16-512 tokens and 8-192 output tokens (uniform,
  ``ignore_eos``). Balance: the largest rank's share over the smallest's, of requests served and of tokens
  generated (``vllm:request_success_total`` / ``vllm:generation_tokens_total`` per ``engine``; both servers
  label them so). A balancer that counts requests alone can pile the long ones onto one rank.
* ``multiturn``: benchmarks/prefix_routing.py's: 32 chats of 4 turns, 16 requests in flight, each turn the
  whole history (256-token opening, then 64 answer + 96 user tokens per turn): the workload of vllm#52463.
  Prefix hit rate = ``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total`` over the run.

    .venv-vllm/bin/python benchmarks/vllm_ranks.py [--rounds 3] [--dtype float32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
from functools import partial
from pathlib import Path

import httpx
from common import Server, drive, smollm2_hf_dir, stamp, wait_quiet
from prefix_routing import CONCURRENCY, OUTPUT_LEN, multiturn_workload

from hybridlb.bench.client import BenchArgs, run_sessions, summarize
from hybridlb.checkpoint.tokenizer import Tokenizer

MIXED_REQUESTS, PROMPT_RANGE, OUTPUT_RANGE = 96, (16, 512), (8, 192)
COUNTERS = ("request_success", "generation_tokens", "prefix_cache_hits", "prefix_cache_queries")


def counters(server: Server) -> dict[str, dict[int, float]]:
    """Each of COUNTERS per engine index, summed over its other labels, from /metrics."""
    found: dict[str, dict[int, float]] = {name: {} for name in COUNTERS}
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for name, labels, value in re.findall(r"^vllm:(\w+)_total\{([^}]*)\} (\S+)$", text, re.M):
        engine = re.search(r'engine="(\d+)"', labels)
        if name in found and engine:
            per = found[name]
            per[int(engine[1])] = per.get(int(engine[1]), 0.0) + float(value)
    return found


def run_delta(before: dict, after: dict) -> dict[str, dict[int, float]]:
    return {name: {e: v - before[name].get(e, 0.0) for e, v in after[name].items()} for name in COUNTERS}


def spread(per_rank: dict[int, float]) -> float:
    """The largest rank's count over the smallest's (inf when a rank got nothing)."""
    values = list(per_rank.values())
    return max(values) / min(values) if values and min(values) > 0 else float("inf")


def mixed(server: Server, vocab: int, seed: int) -> dict:
    rng = random.Random(f"mixed-{seed}")
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(*PROMPT_RANGE))] for _ in range(MIXED_REQUESTS)]
    max_tokens = [rng.randint(*OUTPUT_RANGE) for _ in range(MIXED_REQUESTS)]
    before = counters(server)
    s = drive([server.url], server.model, vocab, 0, OUTPUT_RANGE[1], MIXED_REQUESTS, CONCURRENCY, prompts=prompts,
              max_tokens=max_tokens)
    done = run_delta(before, counters(server))
    return {"failed": s["failed"], "output_tok_s": s["output_throughput"], "p50_ttft_ms": s["median_ttft_ms"],
            "requests_per_rank": done["request_success"], "tokens_per_rank": done["generation_tokens"],
            "requests_max_min": spread(done["request_success"]), "tokens_max_min": spread(done["generation_tokens"])}


def multiturn(server: Server, vocab: int, seed: int) -> dict:
    chats = multiturn_workload(random.Random(f"multiturn-{seed}"), vocab)
    args = BenchArgs(base_url=server.url, model=server.model, random_output_len=OUTPUT_LEN,
                     max_concurrency=CONCURRENCY, ignore_eos=True, progress=False)
    before = counters(server)
    results, duration = asyncio.run(run_sessions(args, chats))
    s = summarize(args, results, duration)
    done = run_delta(before, counters(server))
    queries = sum(done["prefix_cache_queries"].values())
    return {"failed": s["failed"], "output_tok_s": s["output_throughput"], "p50_ttft_ms": s["median_ttft_ms"],
            "hit_rate": sum(done["prefix_cache_hits"].values()) / queries if queries else 0.0,
            "requests_per_rank": done["request_success"]}


WORKLOADS = {"mixed": mixed, "multiturn": multiturn}
MEDIANS = {"mixed": ("output_tok_s", "p50_ttft_ms", "requests_max_min", "tokens_max_min", "failed"),
           "multiturn": ("output_tok_s", "p50_ttft_ms", "hit_rate", "failed")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models-dir", type=Path, default=Path("models"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--no-own-engine", action="store_true", help="leave out hybridlb's own engine")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/vllm_ranks.json"))
    args = parser.parse_args()
    vllm = str(Path(sys.executable).parent / "vllm")
    if not Path(vllm).exists():
        raise SystemExit(f"{vllm} not found: run this with .venv-vllm/bin/python (`just setup-vllm`)")
    model = smollm2_hf_dir(args.models_dir)
    vocab = Tokenizer(model).vocab_size
    flags = ("--dtype", args.dtype, "--data-parallel-size", "2", "--max-model-len", "2048")
    own = ("--kv-cache-gib", "1")
    starts = {"hybridlb": partial(Server.hybridlb, "hybridlb", model, *flags, *own, "--engine-backend", "vllm"),
              "vllm": partial(Server.vllm, "vllm", vllm, model, *flags, "--data-parallel-size-local", "2",
                              "--data-parallel-hybrid-lb", env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})}
    if not args.no_own_engine:
        starts["hybridlb-own"] = partial(Server.hybridlb, "hybridlb-own", model, *flags, *own)
    raw: dict[str, dict[str, list[dict]]] = {name: {w: [] for w in WORKLOADS} for name in starts}
    for round_ in range(args.rounds):
        for name in list(starts) if round_ % 2 == 0 else list(starts)[::-1]:
            server = starts[name]()
            try:
                print(f"round {round_ + 1}: {name} ready in {server.wait_ready():.0f} s", flush=True)
                drive([server.url], server.model, vocab, 64, 8, 32, CONCURRENCY, seed=-1)  # warm up
                for workload, run in WORKLOADS.items():
                    wait_quiet([server.process.pid])
                    row = raw[name][workload] = [*raw[name][workload], run(server, vocab, round_)]
                    print(f"  {workload:<10} " + json.dumps(row[-1]), flush=True)
            finally:
                server.stop()
    table = {name: {w: {k: statistics.median(r[k] for r in rows) for k in MEDIANS[w]} for w, rows in runs.items()}
             for name, runs in raw.items()}
    for name, runs in table.items():
        print(f"{name:<14} " + "  ".join(f"{w}: " + ", ".join(f"{k} {v:.3g}" for k, v in r.items())
                                         for w, r in runs.items()))
    meta = stamp(rounds=args.rounds, dtype=args.dtype, concurrency=CONCURRENCY, servers=list(starts))
    report = {"meta": meta, "results": table, "raw": raw}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
