"""hybridlb with vLLM's engine (``--engine-backend vllm``) against vLLM's own data parallelism, the
same vLLM release on both sides, and hybridlb's own engine on the same workloads.

Three servers, each alone on the machine (started, warmed up at every shape, measured, stopped;
then the next), rounds alternating the order: ``hybridlb`` is `hybridlb serve --engine-backend
vllm --data-parallel-size N`, ``vllm`` is `vllm serve --data-parallel-size N
--data-parallel-size-local N --data-parallel-hybrid-lb`, ``hybridlb-own`` is hybridlb's own
engine with the same flags. SmolLM2-135M-Instruct (the Hugging Face directory made from the
bundled GGUF), bfloat16 by default. The ratio hybridlb / vLLM is what hybridlb's layer costs (or
gains) on vLLM's own engine; the own-engine rows say which engine to pick on this CPU.

Run it where vLLM is installed (`just setup-vllm`):

    .venv-vllm/bin/python benchmarks/vllm_backend.py [--rounds 3] [--workloads 32/64c16,32/64c64]
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

from common import Server, previous_results, smollm2_hf_dir, stamp
from vs_vllm import REAL_WORKLOADS, compare

from hybridlb.checkpoint.tokenizer import Tokenizer

WORKLOADS = [w for w in REAL_WORKLOADS if w[2] > 1]  # 32/64 c16, 256/128 c32, 32/64 c64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models-dir", type=Path, default=Path("models"))
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--dp", type=int, default=2, help="data-parallel ranks on this node (both servers)")
    parser.add_argument("--workloads", default="", help="only these, e.g. 32/64c16,32/64c64 (default: all)")
    parser.add_argument("--no-own-engine", action="store_true", help="leave out hybridlb's own engine")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/vllm_backend.json"))
    args = parser.parse_args()
    vllm = str(Path(sys.executable).parent / "vllm")  # the release the backend runs: one venv for both
    if not Path(vllm).exists():
        raise SystemExit(f"{vllm} not found: run this with .venv-vllm/bin/python (`just setup-vllm`)")
    model = smollm2_hf_dir(args.models_dir)
    workloads = [w for w in WORKLOADS if not args.workloads or f"{w[0]}/{w[1]}c{w[2]}" in args.workloads.split(",")]
    flags = ("--dtype", args.dtype, "--data-parallel-size", str(args.dp))
    vllm_dp = ("--data-parallel-size-local", str(args.dp), "--data-parallel-hybrid-lb") if args.dp > 1 else ()
    reserved = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}  # every core to the engines, as hybridlb gives them
    starts = {"hybridlb": partial(Server.hybridlb, "hybridlb", model, *flags, "--engine-backend", "vllm"),
              "vllm": partial(Server.vllm, "vllm", vllm, model, *flags, *vllm_dp, env=reserved)}
    if not args.no_own_engine:
        starts["hybridlb-own"] = partial(Server.hybridlb, "hybridlb-own", model, *flags)
    title = f"SmolLM2-135M-Instruct (real), {args.dtype}, DP={args.dp}"
    print(f"\n{title}: {', '.join(starts)}; {args.num_prompts} prompts per workload, {args.rounds} rounds", flush=True)
    result = compare(starts, Tokenizer(model).vocab_size, workloads, args.rounds, args.num_prompts)
    print("  hybridlb (vLLM engine) / vLLM output tok/s (median): "
          + ", ".join(f"{k} {v:.2f}x" for k, v in result["ratios"].items()), flush=True)
    meta = stamp(rounds=args.rounds, num_prompts=args.num_prompts, dtype=args.dtype, dp=args.dp,
                 figure="vllm_backend", servers=list(starts))
    previous = previous_results(args.out)
    report = {"meta": meta, "results": {**previous.get("results", {}), title: result["rows"]},
              "ratios": {**previous.get("ratios", {}), title: result["ratios"]},
              "raw": {**previous.get("raw", {}), title: result["raw"]},
              "stamps": {**previous.get("stamps", {}), title: meta}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
