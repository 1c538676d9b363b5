"""The step's token budget (``--max-num-batched-tokens``) against TTFT, TPOT and throughput.

hybridlb alone on the machine, SmolLM2-135M-Instruct in bfloat16, one server per budget: start
it, warm up every shape, measure every shape, stop it; then the next budget. Rounds run the
budgets forwards, then backwards, so no budget always follows the same one. The default shapes
are the two where prompts arrive in bursts (256/128 at concurrency 32, 32/64 at 64): a smaller
budget hands out first tokens sooner and makes the running requests' steps wait on more prefill
chunks; whether throughput moves is what this measures. Medians over rounds, each round's figure
kept. This is how the CPU default (1,024) was chosen; ``vs_vllm.py`` compares the result with
vLLM (2,048 on CPU).

    python benchmarks/step_budget.py [--budgets 2048,1024,512] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from common import Server, drive, smollm2_hf_dir, stamp

from hybridlb.checkpoint.tokenizer import Tokenizer

METRICS = ("output_tok_s", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", default="2048,1024,512")
    parser.add_argument("--workloads", default="256/128c32,32/64c64", help="input/output c concurrency, comma list")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--models-dir", type=Path, default=Path("models"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/step_budget.json"))
    args = parser.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    workloads = []
    for text in args.workloads.split(","):
        lengths, concurrency = text.split("c")
        input_len, output_len = lengths.split("/")
        workloads.append((int(input_len), int(output_len), int(concurrency)))
    model = smollm2_hf_dir(args.models_dir)
    vocab = Tokenizer(model).vocab_size
    raw = []
    for round_ in range(args.rounds):
        for budget in budgets if round_ % 2 == 0 else budgets[::-1]:
            server = Server.hybridlb("hybridlb", model, "--dtype", "bfloat16", "--max-num-batched-tokens", str(budget))
            try:
                server.wait_ready()
                for w in workloads:
                    drive([server.url], model, vocab, w[0], w[1], 2 * w[2], w[2], seed=99)
                for w in workloads:
                    s = drive([server.url], model, vocab, w[0], w[1], args.num_prompts, w[2], seed=1 + round_)
                    row = {"budget": budget, "input": w[0], "output": w[1], "concurrency": w[2], "round": round_,
                           "output_tok_s": s["output_throughput"], **{m: s[m] for m in METRICS[1:]}}
                    raw.append(row)
                    print(f"  round {round_ + 1} budget {budget:>5} {w[0]}/{w[1]} c{w[2]}: "
                          f"{row['output_tok_s']:.0f} tok/s, TTFT {row['mean_ttft_ms']:.0f} ms "
                          f"(P99 {row['p99_ttft_ms']:.0f}), TPOT {row['mean_tpot_ms']:.1f} ms", flush=True)
            finally:
                server.stop()
    rows = []
    print("\n| budget | shape | output tok/s (rounds) | mean TTFT ms | P99 TTFT ms | mean TPOT ms |\n"
          "|---:|---|---|---:|---:|---:|")
    for w in workloads:
        for budget in budgets:
            mine = [r for r in raw if r["budget"] == budget and (r["input"], r["output"], r["concurrency"]) == w]
            row = {"budget": budget, "input": w[0], "output": w[1], "concurrency": w[2],
                   **{m: statistics.median(r[m] for r in mine) for m in METRICS},
                   "output_tok_s_rounds": [r["output_tok_s"] for r in mine]}
            rows.append(row)
            rounds = ", ".join(f"{v:.0f}" for v in row["output_tok_s_rounds"])
            print(f"| {budget} | {w[0]}/{w[1]} c{w[2]} | {row['output_tok_s']:.0f} ({rounds}) | "
                  f"{row['mean_ttft_ms']:.0f} | {row['p99_ttft_ms']:.0f} | {row['mean_tpot_ms']:.1f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": stamp(rounds=args.rounds, num_prompts=args.num_prompts), "rows": rows,
                                    "raw": raw}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
