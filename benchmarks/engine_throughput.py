"""Offline engine throughput: hybridlb's engine against transformers generate().

Models: the real SmolLM2-135M-Instruct first (hybridlb loads its GGUF file; transformers
the same weights, dequantized), then the random ``small`` dense and MoE checkpoints.
Runs in one process, one after the other, on the same cores, so ratios are side by side:

* mixed workload: 64 requests, prompts 16–512 tokens, outputs 16–256 tokens (seeded).
  hybridlb gets them all at once (continuous batching); transformers runs them one by
  one (batch 1) and in static left-padded batches of 16 (a batch runs until its longest
  output; only requested tokens count).
* fixed batches of 1 / 8 / 32 requests, 128 prompt + 128 output tokens each.
* the fraction of a decode step's wall time spent outside torch ops (torch profiler).

Each workload runs ``--rounds`` times (default 3), hybridlb and transformers alternating
which goes first; the medians are reported, with each round's ratio (the spread).
Prints a table and writes JSON. ``--quick`` shrinks everything for a smoke run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from common import SMOLLM2, checkpoint, previous_results, smollm2_hf_dir, stamp

from hybridlb import LLM, SamplingParams

ARCHES = {"smollm2": "SmolLM2-135M", "dense": "qwen3", "moe": "qwen3_moe"}


def mixed_workload(n: int, seed: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(16, 512))], rng.randint(16, 256))
            for _ in range(n)]


def run_ours(llm: LLM, work: list[tuple[list[int], int]]) -> float:
    params = [SamplingParams(max_tokens=out, temperature=0, ignore_eos=True) for _, out in work]
    start = time.perf_counter()
    outputs = llm.generate([ids for ids, _ in work], params)
    elapsed = time.perf_counter() - start
    assert [len(o.token_ids) for o in outputs] == [out for _, out in work]
    return elapsed


def run_hf(model, work: list[tuple[list[int], int]], batch_size: int) -> float:
    """Static batches in arrival order, left-padded; each runs to its longest output."""
    start = time.perf_counter()
    for i in range(0, len(work), batch_size):
        group = work[i : i + batch_size]
        longest = max(len(ids) for ids, _ in group)
        ids = torch.tensor([[0] * (longest - len(p)) + p for p, _ in group])
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p, _ in group])
        new = max(out for _, out in group)
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
    return time.perf_counter() - start


def outside_torch_fraction(llm: LLM, batch: int, vocab: int, steps: int) -> float:
    """Share of decode-step wall time not spent inside torch ops (profiler self times)."""
    from torch.profiler import ProfilerActivity, profile

    core = llm.engine
    rng = random.Random(1)
    params = SamplingParams(max_tokens=steps * 3, temperature=0, ignore_eos=True)
    ids = [f"p{i}" for i in range(batch)]
    for request_id in ids:
        core.add_request(request_id, [rng.randrange(3, vocab) for _ in range(128)], params)
    while core.scheduler.waiting or any(r.num_uncomputed > 1 for r in core.scheduler.running):
        core.step()
    core.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            core.step()
        wall = time.perf_counter() - start
    inside = sum(event.self_cpu_time_total for event in prof.key_averages()) / 1e6
    core.abort(ids)
    return max(0.0, 1 - inside / wall)


def alternating(rounds: int, sides: dict[str, Callable[[], float]]) -> list[dict[str, float]]:
    """Each side's output tok/s in every round; the order flips each round, so slow minutes of
    a shared machine fall on both sides."""
    names = list(sides)
    return [{name: sides[name]() for name in (names if r % 2 == 0 else names[::-1])} for r in range(rounds)]


def bench_model(arch: str, path: str, hf_path: str, args) -> dict:
    from transformers import AutoModelForCausalLM

    llm = LLM(path, max_model_len=1024, kv_cache_gib=1.0, max_num_seqs=64, max_num_batched_tokens=2048,
              dtype=args.dtype, quantization="none")  # transformers' weights: the GGUF file dequantized
    hf = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32).eval()
    vocab = llm.engine.vocab_size
    llm.generate([[5] * 32], SamplingParams(max_tokens=4))  # warm-up
    run_hf(hf, [([5] * 32, 4)], 1)
    result: dict = {"arch": arch, "rounds": args.rounds, "mixed": {}, "fixed": {}}

    work = mixed_workload(args.requests, 0, vocab)
    tokens = sum(out for _, out in work)
    sides = {"hybridlb_tok_s": lambda: tokens / run_ours(llm, work)}
    sides.update({f"transformers_b{size}_tok_s": lambda size=size: tokens / run_hf(hf, work, size)
                  for size in args.hf_batch_sizes})
    rounds = alternating(args.rounds, sides)
    mixed = {"requests": len(work), "output_tokens": tokens,
             **{name: statistics.median(r[name] for r in rounds) for name in sides}}
    best = max(v for k, v in mixed.items() if k.startswith("transformers"))
    mixed["ratio_vs_best_transformers"] = mixed["hybridlb_tok_s"] / best
    mixed["ratios"] = [r["hybridlb_tok_s"] / max(v for k, v in r.items() if k.startswith("transformers"))
                       for r in rounds]
    result["mixed"] = mixed

    rng = random.Random(2)
    for batch in args.batches:
        fixed = [([rng.randrange(3, vocab) for _ in range(128)], args.fixed_output) for _ in range(batch)]
        tokens_fixed = batch * args.fixed_output
        rounds = alternating(args.rounds, {
            "hybridlb_tok_s": lambda fixed=fixed, n=tokens_fixed: n / run_ours(llm, fixed),
            "transformers_tok_s": lambda fixed=fixed, n=tokens_fixed, b=batch: n / run_hf(hf, fixed, b)})
        ours = statistics.median(r["hybridlb_tok_s"] for r in rounds)
        theirs = statistics.median(r["transformers_tok_s"] for r in rounds)
        result["fixed"][batch] = {"hybridlb_tok_s": ours, "transformers_tok_s": theirs, "ratio": ours / theirs,
                                  "ratios": [r["hybridlb_tok_s"] / r["transformers_tok_s"] for r in rounds]}
    result["outside_torch_fraction"] = {
        batch: outside_torch_fraction(llm, batch, vocab, args.profile_steps) for batch in (1, 8, 32)
    }
    return result


def print_table(results: list[dict]) -> None:
    print(f"\n{'model':<10} {'workload':<22} {'hybridlb tok/s':>15} {'transformers tok/s':>20} {'ratio':>7}")
    for r in results:
        m = r["mixed"]
        hf_cols = {k: v for k, v in m.items() if k.startswith("transformers")}
        for name, value in hf_cols.items():
            label = f"mixed {m['requests']} ({name.split('_')[1]})"
            print(f"{r['arch']:<10} {label:<22} {m['hybridlb_tok_s']:>15.0f} {value:>20.0f} "
                  f"{m['hybridlb_tok_s'] / value:>6.2f}x")
        for batch, f in r["fixed"].items():
            print(f"{r['arch']:<10} {f'fixed batch {batch}':<22} {f['hybridlb_tok_s']:>15.0f} "
                  f"{f['transformers_tok_s']:>20.0f} {f['ratio']:>6.2f}x")
        fractions = ", ".join(f"b{b}: {v:.0%}" for b, v in r["outside_torch_fraction"].items())
        print(f"{r['arch']:<10} decode step time outside torch ops: {fractions}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models-dir", type=Path, default=Path("models"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/engine_throughput.json"))
    parser.add_argument("--quick", action="store_true", help="tiny run to check the script works")
    parser.add_argument("--models", default="smollm2,dense,moe", help="comma list of smollm2, dense, moe")
    parser.add_argument("--requests", type=int, default=64, help="requests in the mixed workload")
    parser.add_argument("--dtype", default="float32", help="hybridlb's dtype (transformers runs float32)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians are reported")
    args = parser.parse_args()
    args.batches, args.fixed_output, args.profile_steps = (1, 8, 32), 128, 20
    args.hf_batch_sizes = (1, 16)
    if args.quick:
        args.requests, args.batches, args.fixed_output, args.profile_steps, args.rounds = 8, (1, 8), 16, 5, 2
    torch.set_num_threads(os.cpu_count() or 1)
    results = []
    for kind in args.models.split(","):
        if kind == "smollm2":
            path, hf_path = SMOLLM2, smollm2_hf_dir(args.models_dir)
        else:
            path = hf_path = checkpoint(args.models_dir, ARCHES[kind], "small")
        results.append(bench_model(ARCHES[kind], path, hf_path, args))
    print_table(results)
    meta = stamp(threads=torch.get_num_threads(), quick=args.quick, dtype=args.dtype, rounds=args.rounds)
    previous = previous_results(args.out)
    fresh = {r["arch"] for r in results}
    kept = [{"meta": previous.get("meta"), **r} for r in previous.get("results", []) if r["arch"] not in fresh]
    results = [{"meta": meta, **r} for r in results] + kept
    results.sort(key=lambda r: list(ARCHES.values()).index(r["arch"]) if r["arch"] in ARCHES.values() else 99)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
