"""What this machine can do at all: the anchor the engine's speed is measured against.

* **GEMM throughput** at the shapes of a SmolLM2-135M decode step (hidden 576, intermediate
  1536, 9 query / 3 KV heads of 64, vocabulary 49,152): ``x @ W.T`` for each projection and
  the LM head at batch 1, 16 and 64, and one large square GEMM, in bfloat16 and float32,
  with torch's CPU kernels on ``--threads`` threads (default: every core). GFLOP/s =
  2·M·N·K / time; at batch 1 the weights' bytes over the time is the bandwidth a decode
  step can stream them at (the LM head's, one large weight, is the best case).
* **Weight streaming at batch 1**: every projection of the model's 30 layers plus the LM
  head, one after another (what a batch-1 decode step does, without attention): the
  weights' bytes over the time, in GB/s, and the tokens per second that bounds.
* **Memory bandwidth**: a 256 MiB tensor copied into another (read + write bytes / time).

Each figure is the median of ``--repeats`` timed runs after a warm-up. The step profile
(``step_profile.py``) and the engine's benchmarks quote their figures as a fraction of these.

    python benchmarks/machine_peak.py [--threads N] [--repeats 20] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from common import stamp

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, VOCAB, LAYERS = 576, 1536, 9, 3, 64, 49152, 30
PROJECTIONS = {  # name: (out features N, in features K) of one layer's weights
    "qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
    "o": (HIDDEN, HEADS * HEAD_DIM),
    "gate_up": (2 * INTERMEDIATE, HIDDEN),
    "down": (HIDDEN, INTERMEDIATE),
}
GEMM_SHAPES = {**PROJECTIONS, "lm_head": (VOCAB, HIDDEN)}  # the LM head: one 57 MB weight in bfloat16
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs, after three warm-up runs."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def gemm_gflops(m: int, n: int, k: int, dtype: torch.dtype, repeats: int) -> float:
    x, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
    seconds = timed(lambda: torch.nn.functional.linear(x, w), repeats)
    return 2 * m * n * k / seconds / 1e9


def weight_streaming(dtype: torch.dtype, repeats: int) -> dict:
    """Batch 1 through every projection of every layer and the LM head (fresh weights each,
    as a real model's: nothing stays in cache between layers)."""
    layers = [{name: torch.randn(n, k, dtype=dtype) for name, (n, k) in PROJECTIONS.items()} for _ in range(LAYERS)]
    head = torch.randn(VOCAB, HIDDEN, dtype=dtype)
    x = torch.randn(1, HIDDEN, dtype=dtype)
    x_wide = torch.randn(1, INTERMEDIATE, dtype=dtype)

    def step() -> None:
        for layer in layers:
            for name, weight in layer.items():
                torch.nn.functional.linear(x_wide if name == "down" else x, weight)
        torch.nn.functional.linear(x, head)

    seconds = timed(step, max(3, repeats // 4))
    weight_bytes = (sum(w.numel() for layer in layers for w in layer.values()) + head.numel()) * x.element_size()
    return {"weight_mb": weight_bytes / 1e6, "step_ms": seconds * 1e3, "gb_s": weight_bytes / seconds / 1e9,
            "tokens_per_s_bound": 1 / seconds}


def copy_gb_s(repeats: int) -> float:
    src = torch.randn(64 * 2**20)  # 256 MiB of float32
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), repeats)
    return 2 * src.numel() * src.element_size() / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/machine_peak.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    gemm = []
    for dtype_name, dtype in DTYPES.items():
        for batch in (1, 16, 64):
            for name, (n, k) in GEMM_SHAPES.items():
                gflop_s = gemm_gflops(batch, n, k, dtype, args.repeats)
                weight_gb_s = gflop_s / (2 * batch) * dtype.itemsize  # the weights read, per second
                gemm.append({"dtype": dtype_name, "batch": batch, "projection": name, "m": batch, "n": n, "k": k,
                             "gflop_s": gflop_s, "weight_gb_s": weight_gb_s})
        gemm.append({"dtype": dtype_name, "batch": 2048, "projection": "square 2048", "m": 2048, "n": 2048,
                     "k": 2048, "gflop_s": gemm_gflops(2048, 2048, 2048, dtype, max(3, args.repeats // 4))})
    streaming = {name: weight_streaming(dtype, args.repeats) for name, dtype in DTYPES.items()}
    copy = copy_gb_s(args.repeats)

    print(f"torch {torch.__version__}, {args.threads} threads\n")
    print("| dtype | batch | projection (M×N×K) | GFLOP/s | weights streamed (GB/s) |\n|---|---:|---|---:|---:|")
    for row in gemm:
        print(f"| {row['dtype']} | {row['batch']} | {row['projection']} ({row['m']}×{row['n']}×{row['k']}) "
              f"| {row['gflop_s']:.0f} | {row.get('weight_gb_s', 0):.1f} |")
    print("\n| dtype | weights (MB) | batch-1 pass (ms) | GB/s | tok/s bound |\n|---|---:|---:|---:|---:|")
    for name, s in streaming.items():
        print(f"| {name} | {s['weight_mb']:.0f} | {s['step_ms']:.2f} | {s['gb_s']:.1f} "
              f"| {s['tokens_per_s_bound']:.0f} |")
    print(f"\nmemory copy (256 MiB, read + write): {copy:.1f} GB/s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": stamp(threads=args.threads, repeats=args.repeats), "gemm": gemm,
                                    "weight_streaming": streaming, "copy_gb_s": copy}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
