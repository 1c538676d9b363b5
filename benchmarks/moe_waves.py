"""MoE with experts sharded over DP=2: what lockstep coordination costs. One run:

1. The same decode-heavy load (16 in / 128 out, 16 concurrent, split over the ranks) on
   the `small` qwen3_moe checkpoint: one rank holding every expert, then EP over DP=2 with
   the per-step metadata exchange synchronous, then overlapped (async). Reported: mean
   step time per engine (real and dummy steps), the share of it spent blocked on the
   metadata exchange and the share in the MoE layers' collectives (both of the same busy
   time, dummy steps included), TPOT and output throughput: medians over ``--rounds``
   (default 3) alternating rounds, with each round's TPOT. Goal: coordination (the
   metadata exchange) adds <= 5% to step time with async on.
2. Skewed load (75% and 95% of the requests pinned to rank 0, 4 at a time): the
   fraction of each rank's steps that were dummy steps.

    python benchmarks/moe_waves.py [--size small]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import httpx
from common import Server, checkpoint, drive, free_port, stamp

from hybridlb.bench.client import BenchArgs, make_prompts
from hybridlb.checkpoint.tokenizer import Tokenizer

INPUT, OUTPUT, PROMPTS, CONCURRENCY = 16, 128, 64, 16


STATS_FRESH_S = 1.5  # an engine's counters reach /ranks with its next heartbeat (every second)


def engines(url: str) -> dict[int, dict]:
    """Every rank's counters as of now (after waiting out one engine heartbeat)."""
    time.sleep(STATS_FRESH_S)
    return {e["rank"]: e for e in httpx.get(f"{url}/ranks").json()["engines"]}


def delta(after: dict, before: dict, key: str) -> float:
    return after[key] - before.get(key, 0)


def run_setup(name: str, model: str, vocab: int, flags: list[str]) -> dict:
    server = Server.hybridlb(name, model, "--torch-threads", "1", *flags)
    try:
        server.wait_ready()
        drive([server.url], model, vocab, INPUT, 16, CONCURRENCY, CONCURRENCY, seed=99)  # warm-up
        before = engines(server.url)
        s = drive([server.url], model, vocab, INPUT, OUTPUT, PROMPTS, CONCURRENCY)
        after = engines(server.url)
    finally:
        server.stop()
    ranks = {}
    for rank, e in after.items():
        b = before.get(rank, {})
        steps = max(1, delta(e, b, "steps") + delta(e, b, "dummy_steps"))  # busy time includes dummy steps
        busy = delta(e, b, "busy_s")
        ranks[rank] = {"step_ms": 1000 * busy / steps, "meta_share": delta(e, b, "meta_s") / busy if busy else 0,
                       "collective_share": delta(e, b, "collective_s") / busy if busy else 0}
    step_ms = sum(r["step_ms"] for r in ranks.values()) / len(ranks)
    meta = sum(r["meta_share"] for r in ranks.values()) / len(ranks)
    coll = sum(r["collective_share"] for r in ranks.values()) / len(ranks)
    row = {"setup": name, "step_ms": step_ms, "meta_share": meta, "collective_share": coll,
           "tpot_ms": s["mean_tpot_ms"], "output_tok_s": s["output_throughput"], "failed": s["failed"], "ranks": ranks}
    print(f"  {name:<28} step {step_ms:6.2f} ms  metadata {meta:6.1%}  MoE collectives {coll:6.1%}  "
          f"TPOT {s['mean_tpot_ms']:6.2f} ms  {s['output_throughput']:6.0f} tok/s  failed {s['failed']}", flush=True)
    return row


MEDIANS = ("step_ms", "meta_share", "collective_share", "tpot_ms", "output_tok_s")


def median_row(name: str, runs: list[dict]) -> dict:
    """One setup over its rounds: the median of each figure, each round's TPOT (the spread)."""
    return {"setup": name, **{key: statistics.median(r[key] for r in runs) for key in MEDIANS},
            "failed": sum(r["failed"] for r in runs), "tpot_ms_rounds": [r["tpot_ms"] for r in runs],
            "ranks": runs[-1]["ranks"]}


def skewed(model: str, vocab: int, share: float) -> dict:
    server = Server.hybridlb("skew", model, "-dp", "2", "--enable-expert-parallel", "--torch-threads", "1",
                             "--data-parallel-rpc-port", str(free_port()))
    try:
        server.wait_ready()
        before = engines(server.url)
        args = BenchArgs(random_input_len=INPUT, random_output_len=64, num_prompts=32, seed=5)
        prompts = make_prompts(args, vocab)
        rng = random.Random(5)
        with httpx.Client(timeout=120) as client:
            import concurrent.futures as cf

            def one(prompt):
                rank = 0 if rng.random() < share else 1
                body = {"model": model, "prompt": prompt, "max_tokens": 64, "temperature": 0, "ignore_eos": True}
                return client.post(f"{server.url}/v1/completions", json=body,
                                   headers={"X-data-parallel-rank": str(rank)}).status_code

            with cf.ThreadPoolExecutor(4) as pool:
                statuses = list(pool.map(one, prompts))
        after = engines(server.url)
    finally:
        server.stop()
    fractions = {}
    for rank, e in after.items():
        real = delta(e, before[rank], "steps")
        dummy = delta(e, before[rank], "dummy_steps")
        fractions[rank] = dummy / (real + dummy) if real + dummy else 0.0
    label = f"{share:.0%}/{1 - share:.0%}"
    print(f"  skew {label} (4 concurrent): dummy-step fraction per rank "
          f"{', '.join(f'{r}: {f:.0%}' for r, f in fractions.items())}  (failed {sum(s != 200 for s in statuses)})",
          flush=True)
    return {"share_rank0": share, "dummy_fraction": fractions}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    parser.add_argument("--models-dir", type=Path, default=Path("models"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/moe_waves.json"))
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of the three setups (medians)")
    args = parser.parse_args()
    model = checkpoint(args.models_dir, "qwen3_moe", args.size)
    vocab = Tokenizer(model).vocab_size
    print(f"\n{args.size} qwen3_moe, {PROMPTS} prompts, {INPUT} in / {OUTPUT} out, concurrency {CONCURRENCY}")
    setups = {"one rank, all experts": [],
              "EP DP=2, sync metadata": ["-dp", "2", "--enable-expert-parallel", "--no-async-dp-coordination"],
              "EP DP=2, async metadata": ["-dp", "2", "--enable-expert-parallel"]}
    names = list(setups)
    rounds = []
    for round_ in range(args.rounds):  # the order flips each round, so machine noise falls on every setup
        print(f" round {round_ + 1} of {args.rounds}")
        rounds.append({name: run_setup(name, model, vocab, [*setups[name], "--data-parallel-rpc-port",
                                                            str(free_port())])
                       for name in (names if round_ % 2 == 0 else names[::-1])})
    rows = [median_row(name, [r[name] for r in rounds]) for name in names]
    skew = [skewed(model, vocab, share) for share in (0.75, 0.95)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": stamp(rounds=args.rounds), "size": args.size, "setups": rows,
                                    "skew": skew}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
