"""Prefix caching and cache-aware routing on the real model, DP=2 hybrid on one node.

Two workloads, the same client for every server (``hybridlb bench serve``'s engine,
streaming, ``ignore_eos``):

* ``system``: many users sharing 8 system prompts of ~1,000 tokens; each request is one
  system prompt (shuffled order) plus 32 tokens of its own, 64 tokens out.
* ``multiturn``: 32 chats of 4 turns, 16 requests in flight. Each turn resends the whole
  history (a 256-token opening, then per turn 64 assistant tokens and 96 new user tokens)
  and waits for the previous answer, then for a free slot: chats outnumber slots, so
  their turns interleave as many users' do (with one chat per slot, a chat's next turn
  would always take the slot its last turn just freed, on the rank holding its history).
  The history's assistant turns are fixed tokens, not the model's own answers, so the
  engines' cached output blocks do not match and only prompt blocks are reused: the hit
  rate is a lower bound on a real chat's.

Servers: hybridlb with ``cache_aware``, ``least_loaded`` and ``round_robin`` (prefix caching
on), hybridlb ``least_loaded`` with prefix caching off, and vLLM DP=2 ``--data-parallel-
hybrid-lb`` with its prefix caching (on by default). All bfloat16. Prompts are new random
tokens in every round, so no server starts a run with anything cached from an earlier one.
Each server runs alone on the machine (started for its turn, warmed up, measured, stopped);
rounds alternate the servers' order; figures are medians over rounds.

``--kv-cache-gib`` sets each hybridlb engine's KV cache (default 1 GiB, as vLLM's
``VLLM_CPU_KVCACHE_SPACE=1``). SmolLM2 keeps 22.5 KiB of KV per token. At 1 GiB
(~46,000 tokens) every rank holds all 8 system prompts next to its running requests, so
``least_loaded`` misses little. At 0.15 GiB (~7,000 tokens) a rank holds about 6 of them
next to its running requests and the two ranks together hold all 8: the regime where it
matters which rank a prompt goes to (a cache smaller than the prompts in use, as with
many prompts or a bigger model). vLLM's space is whole GiB, so it sits that setting out.
Each setting keeps its own rows in the JSON.

    python benchmarks/prefix_routing.py [--rounds 3] [--no-vllm] [--kv-cache-gib 0.15]
        [--configs cache_aware,least_loaded] [--workloads system] [--think-s 2] [--out FILE]

``--think-s``: users pause between an answer and their next turn (exponential, this mean),
holding no slot. Without it a finished turn's next one queues for a slot at once, and under
``least_loaded`` often lands on the rank its last turn just freed: locality by itself.

``--configs`` / ``--workloads`` pick a subset (for a quick look; the report wants them all).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
from pathlib import Path

import httpx
from common import Server, previous_results, smollm2_hf_dir, stamp, vllm_executable, wait_quiet

from hybridlb.bench.client import BenchArgs, run_benchmark, run_sessions, summarize
from hybridlb.checkpoint.tokenizer import Tokenizer

HYBRIDLB = {
    "cache_aware": ("--lb-policy", "cache_aware"),
    "least_loaded": ("--lb-policy", "least_loaded"),
    "round_robin": ("--lb-policy", "round_robin"),
    "no_caching": ("--lb-policy", "least_loaded", "--no-enable-prefix-caching"),
}
COMMON = ("--max-model-len", "2048", "--data-parallel-size", "2")
SYSTEM_PROMPTS, SYSTEM_LEN, USER_LEN, SYSTEM_REQUESTS = 8, 1000, 32, 96
CHATS, TURNS, OPENING_LEN, TURN_USER_LEN, TURN_ANSWER_LEN = 32, 4, 256, 96, 64
OUTPUT_LEN, CONCURRENCY = 64, 16


def system_workload(rng: random.Random, vocab: int) -> list[list[int]]:
    systems = [[rng.randrange(vocab) for _ in range(SYSTEM_LEN)] for _ in range(SYSTEM_PROMPTS)]
    return [systems[rng.randrange(SYSTEM_PROMPTS)] + [rng.randrange(vocab) for _ in range(USER_LEN)]
            for _ in range(SYSTEM_REQUESTS)]


def multiturn_workload(rng: random.Random, vocab: int) -> list[list[list[int]]]:
    chats = []
    for _ in range(CHATS):
        history = [rng.randrange(vocab) for _ in range(OPENING_LEN)]
        turns = [list(history)]
        for _ in range(TURNS - 1):
            history += [rng.randrange(vocab) for _ in range(TURN_ANSWER_LEN + TURN_USER_LEN)]
            turns.append(list(history))
        chats.append(turns)
    return chats


def ideal_hit_rate(prompts: list[list[int]], block: int = 16) -> float:
    """The hit rate of perfect routing to a cache that never evicts: every full block of every
    earlier prompt is reused (all but a prompt's last token, as engines compute at least one).
    ``prompts`` in the order sent (a chat's turns in order)."""
    seen: set[int] = set()
    hits = total = 0
    for prompt in prompts:
        chain, matched, usable = 0, 0, (len(prompt) - 1) // block
        for index in range(len(prompt) // block):
            chain = hash((chain, tuple(prompt[index * block:(index + 1) * block])))
            if matched == index < usable and chain in seen:
                matched += 1
            seen.add(chain)
        hits, total = hits + matched * block, total + len(prompt)
    return hits / total


def run(server: Server, workload: str, prompts, think_s: float = 0.0) -> dict:
    args = BenchArgs(base_url=server.url, model=server.model, random_output_len=OUTPUT_LEN,
                     max_concurrency=CONCURRENCY, ignore_eos=True, progress=False)
    if workload == "system":
        results, duration = asyncio.run(run_benchmark(args, prompts))
    else:
        results, duration = asyncio.run(run_sessions(args, prompts, think_s=think_s))
    s = summarize(args, results, duration)
    row = {"failed": s["failed"], "output_tok_s": s["output_throughput"], "p50_ttft_ms": s["median_ttft_ms"],
           "p99_ttft_ms": s["p99_ttft_ms"], "mean_tpot_ms": s["mean_tpot_ms"]}
    row.update(cache_stats(server))
    return row


def cache_stats(server: Server) -> dict:
    """Prefix-cache hit rate over the server's life (reset by the caller between runs) and the
    ranks' busy seconds, from /metrics (vLLM's names, so it works for both servers)."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    totals = {"queries": 0.0, "hits": 0.0}
    for line in text.splitlines():
        for key in totals:
            if line.startswith(f"vllm:prefix_cache_{key}_total{{"):
                totals[key] += float(line.rsplit(" ", 1)[1])
    stats = {"queries": totals["queries"], "hits": totals["hits"]}
    if server.name.startswith("hybridlb"):
        ranks = httpx.get(f"{server.url}/ranks", timeout=10).json()["engines"]
        stats["busy_s"] = [round(e["busy_s"], 1) for e in ranks]
    return stats


def delta(row: dict, before: dict) -> dict:
    """Turn the cumulative counters in ``row`` into this run's."""
    queries, hits = row.pop("queries") - before["queries"], row.pop("hits") - before["hits"]
    row["hit_rate"] = hits / queries if queries else 0.0
    if "busy_s" in row:
        row["busy_s"] = [round(a - b, 1) for a, b in zip(row["busy_s"], before["busy_s"], strict=True)]
    return row


def warm_up(server: Server, vocab: int) -> None:
    args = BenchArgs(base_url=server.url, model=server.model, random_output_len=8, ignore_eos=True, progress=False)
    rng = random.Random(-1)
    asyncio.run(run_benchmark(args, [[rng.randrange(vocab) for _ in range(64)] for _ in range(8)]))


WORKLOADS = ("system", "multiturn")


def measure(server: Server, vocab: int, round_seed: int, workloads=WORKLOADS, think_s: float = 0.0) -> dict:
    rows = {}
    for workload in workloads:
        rng = random.Random(f"{workload}-{round_seed}")
        prompts = system_workload(rng, vocab) if workload == "system" else multiturn_workload(rng, vocab)
        wait_quiet([server.process.pid])
        before = cache_stats(server)
        row = rows[workload] = delta(run(server, workload, prompts, think_s), before)
        row["ideal_hit_rate"] = ideal_hit_rate(prompts if workload == "system" else [p for c in prompts for p in c])
        print(f"  {server.name:<22} {workload:<10} {row['output_tok_s']:>6.0f} tok/s  "
              f"TTFT P50 {row['p50_ttft_ms']:>6.0f}"
              f" P99 {row['p99_ttft_ms']:>6.0f} ms  TPOT {row['mean_tpot_ms']:>5.1f} ms  hits {row['hit_rate']:.0%}"
              f" (ideal {row['ideal_hit_rate']:.0%})"
              f"  busy {row.get('busy_s', '-')}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models-dir", type=Path, default=Path("models"))
    parser.add_argument("--no-vllm", action="store_true", help="hybridlb's configurations only")
    parser.add_argument("--dtype", default="bfloat16",
                        help="every server's; float32 where the CPU has no bfloat16 instructions (AVX2 only)")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0, help="each hybridlb engine's KV cache")
    parser.add_argument("--configs", default=",".join(HYBRIDLB), help="hybridlb configurations to run")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="workloads to run")
    parser.add_argument("--think-s", type=float, default=0.0,
                        help="multiturn: a user's mean pause between an answer and the next turn (exponential)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/prefix_routing.json"))
    args = parser.parse_args()
    model = smollm2_hf_dir(args.models_dir)
    vocab = Tokenizer(model).vocab_size
    with_vllm = not args.no_vllm and args.kv_cache_gib == 1.0
    names = [f"hybridlb:{policy}" for policy in args.configs.split(",")] + (["vllm"] if with_vllm else [])
    vllm = vllm_executable() if with_vllm else None
    workloads = args.workloads.split(",")
    if unknown := set(workloads) - set(WORKLOADS):
        parser.error(f"unknown workloads {sorted(unknown)}; choose from {', '.join(WORKLOADS)}")
    common = (*COMMON, "--dtype", args.dtype)
    raw: dict[str, dict[str, list[dict]]] = {name: {workload: [] for workload in workloads} for name in names}
    for round_index in range(args.rounds):
        print(f"round {round_index + 1}", flush=True)
        for name in names if round_index % 2 == 0 else names[::-1]:
            # Each server alone on the machine: started for its turn, stopped after it.
            if name == "vllm":
                server = Server.vllm("vllm", vllm, model, *common, "--data-parallel-size-local", "2",
                                     "--data-parallel-hybrid-lb")
            else:
                server = Server.hybridlb(name, model, *common, "--kv-cache-gib", str(args.kv_cache_gib),
                                         *HYBRIDLB[name.split(":")[1]])
            try:
                print(f"{name} ready in {server.wait_ready():.0f} s", flush=True)
                warm_up(server, vocab)
                for workload, row in measure(server, vocab, round_index, workloads, args.think_s).items():
                    raw[name][workload].append(row)
            finally:
                server.stop()
    table = summarize_rounds(raw)
    print_table(table)
    setting = (f"KV cache {args.kv_cache_gib:g} GiB per engine"
               + ("" if args.dtype == "bfloat16" else f", {args.dtype}")
               + (f", think {args.think_s:g} s" if args.think_s else ""))
    meta = stamp(rounds=args.rounds, concurrency=CONCURRENCY, kv_cache_gib=args.kv_cache_gib, dtype=args.dtype,
                 think_s=args.think_s)
    previous = previous_results(args.out)  # other settings' rows stay, each with the stamp that made it
    report = {"meta": meta,  # the latest run's; each setting keeps its own
              "settings": {**previous.get("settings", {}), setting: {"meta": meta, "results": table, "raw": raw}}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


def summarize_rounds(raw: dict) -> dict:
    table = {}
    for name, workloads in raw.items():
        table[name] = {}
        for workload, rows in workloads.items():
            if rows:
                table[name][workload] = {key: statistics.median(r[key] for r in rows)
                                         for key in ("output_tok_s", "p50_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
                                                     "hit_rate", "ideal_hit_rate", "failed")}
    return table


def print_table(table: dict) -> None:
    base = table.get("hybridlb:least_loaded", {})
    print(f"\n{'server':<24}{'workload':<11}{'tok/s':>8}{'vs LL':>7}{'TTFT P50':>10}{'vs LL':>7}{'P99':>8}"
          f"{'TPOT':>7}{'hits':>6}{'ideal':>6}")
    for name, workloads in table.items():
        for workload, row in workloads.items():
            ref = base.get(workload)
            speed = f"{row['output_tok_s'] / ref['output_tok_s']:.2f}x" if ref else "-"
            ttft = f"{row['p50_ttft_ms'] / ref['p50_ttft_ms']:.2f}x" if ref else "-"
            print(f"{name:<24}{workload:<11}{row['output_tok_s']:>8.0f}{speed:>7}{row['p50_ttft_ms']:>10.0f}{ttft:>7}"
                  f"{row['p99_ttft_ms']:>8.0f}{row['mean_tpot_ms']:>7.1f}{row['hit_rate']:>6.0%}"
                  f"{row['ideal_hit_rate']:>6.0%}")


if __name__ == "__main__":
    main()
