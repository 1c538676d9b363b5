"""What this machine can do at all: the anchor the engine's speed is measured against.

* **GEMM throughput** at the shapes of a SmolLM2-135M decode step (hidden 576, intermediate
  1536, 9 query / 3 KV heads of 64, vocabulary 49,152): ``x @ W.T`` for each projection and
  the LM head at batch 1, 16, 32 and 64, and one large square GEMM, in bfloat16 and float32,
  with torch's CPU kernels on ``--threads`` threads (default: every core); bfloat16 also
  through oneDNN with the weight reordered once (``_reorder_linear_weight``) and through the
  engine's own kernel (``kernels/csrc/bf16.c``, AVX-512 BF16; the path the engine's linear layers take
  where the CPU has it, ``hybridlb/model/layers.py``, else oneDNN's), and with int8 weights through
  ``kernels/csrc/int8.c`` (``--quantization int8``'s path; half the bytes) and 4-bit weights through
  ``kernels/csrc/int4.c`` (``int4`` / ``gguf``'s; 5 bits a weight with scales). GFLOP/s =
  2·M·N·K / time; at batch 1 the weights' bytes over the time is the bandwidth a decode
  step can stream them at (the LM head's, one large weight, is the best case).
* **Weight streaming at batch 1**: every projection of the model's 30 layers plus the LM
  head, one after another (what a batch-1 decode step does, without attention): the
  weights' bytes over the time, in GB/s, and the tokens per second that bounds.
* **Memory bandwidth**: a 256 MiB tensor copied into another (read + write bytes / time), and
  summed (read bytes / time: the bound on streaming weights, which are only read).
* **Model passes** at batch 1, 16, 32 and 64: the same pass with that many rows, each path.
  The fastest path's GFLOP/s at a batch is the **decode peak** there, the ceiling of a decode
  step's matmuls (cold weights, as in a served step); ``step_profile.py`` quotes the engine
  against it.

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

from hybridlb import kernels
from hybridlb.model.quantized import Int4Linear, Int8Linear

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, VOCAB, LAYERS = 576, 1536, 9, 3, 64, 49152, 30
PROJECTIONS = {  # name: (out features N, in features K) of one layer's weights
    "qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
    "o": (HIDDEN, HEADS * HEAD_DIM),
    "gate_up": (2 * INTERMEDIATE, HIDDEN),
    "down": (HIDDEN, INTERMEDIATE),
}
GEMM_SHAPES = {**PROJECTIONS, "lm_head": (VOCAB, HIDDEN)}  # the LM head: one 57 MB weight in bfloat16
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
BATCHES = (1, 16, 32, 64)
PACKED = "oneDNN packed"  # the engine's path for bfloat16 on a CPU without AVX-512 BF16
KERNEL = "hybridlb bf16.c"  # the engine's path where the CPU has it
INT8 = "hybridlb int8.c"  # --quantization int8: int8 weights (1 byte each), bfloat16 activations
INT4 = "hybridlb int4.c"  # --quantization int4 / gguf: 4-bit codes + float16 scale and low per 32 (5 bits each)
BYTES_PER_WEIGHT = {INT8: 1.0, INT4: 0.625}


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


def linear_fn(weight: torch.Tensor, path: str):
    """``x @ weight.T`` through torch's linear, oneDNN on a weight reordered once, or bf16.c."""
    if path == KERNEL:
        cpu, n = kernels.load(), weight.shape[0]
        packed = cpu.bf16_pack(weight)
        return lambda x: cpu.bf16_matmul(x, packed, None, n)
    if path == INT8:
        layer = Int8Linear.from_weight(weight, None, weight.dtype)
        return layer.forward
    if path == INT4:
        layer = Int4Linear.from_weight(weight, None, weight.dtype)
        return layer.forward
    if path != PACKED:
        return lambda x: torch.nn.functional.linear(x, weight)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def engine_path() -> str:
    """The path the engine's bfloat16 linear layers take on this machine (``PackedLinear``)."""
    cpu = kernels.load()
    return KERNEL if cpu is not None and cpu.bf16_matmul_supported else PACKED


def paths(dtype: torch.dtype) -> list[str]:
    if dtype != torch.bfloat16:
        return ["torch linear"]
    cpu = kernels.load()
    ours = ([KERNEL] if cpu is not None and cpu.bf16_matmul_supported else []) + ([INT8] if cpu is not None else [])
    ours += [INT4] if cpu is not None and cpu.int4_matmul_supported else []
    return ["torch linear", PACKED, *ours]


def gemm_gflops(m: int, n: int, k: int, dtype: torch.dtype, repeats: int, path: str) -> float:
    x, fn = torch.randn(m, k, dtype=dtype), linear_fn(torch.randn(n, k, dtype=dtype), path)
    seconds = timed(lambda: fn(x), repeats)
    return 2 * m * n * k / seconds / 1e9


def model_pass(dtype: torch.dtype, repeats: int, path: str, batch: int) -> dict:
    """``batch`` rows through every projection of every layer and the LM head (fresh weights
    each, as a real model's: nothing stays in cache between layers): a decode step's matmuls."""
    layers = [{name: linear_fn(torch.randn(n, k, dtype=dtype), path) for name, (n, k) in PROJECTIONS.items()}
              for _ in range(LAYERS)]
    head = linear_fn(torch.randn(VOCAB, HIDDEN, dtype=dtype), path)
    x = torch.randn(batch, HIDDEN, dtype=dtype)
    x_wide = torch.randn(batch, INTERMEDIATE, dtype=dtype)

    def step() -> None:
        for layer in layers:
            for name, fn in layer.items():
                fn(x_wide if name == "down" else x)
        head(x)

    seconds = timed(step, max(3, repeats // 4))
    weights = LAYERS * sum(n * k for n, k in PROJECTIONS.values()) + VOCAB * HIDDEN
    size = BYTES_PER_WEIGHT.get(path, x.element_size())
    return {"path": path, "batch": batch, "weight_mb": weights * size / 1e6, "step_ms": seconds * 1e3,
            "gb_s": weights * size / seconds / 1e9, "gflop_s": 2 * batch * weights / seconds / 1e9,
            "tokens_per_s_bound": batch / seconds}


def weight_streaming(dtype: torch.dtype, repeats: int, path: str) -> dict:
    """The batch-1 pass: the weights' bytes over its time is the bandwidth batch-1 decode streams at."""
    return model_pass(dtype, repeats, path, 1)


def copy_gb_s(repeats: int) -> float:
    src = torch.randn(64 * 2**20)  # 256 MiB of float32
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), repeats)
    return 2 * src.numel() * src.element_size() / seconds / 1e9


def read_gb_s(repeats: int) -> float:
    src = torch.randn(64 * 2**20)  # 256 MiB of float32, summed: read only
    seconds = timed(lambda: src.sum(), repeats)
    return src.numel() * src.element_size() / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/machine_peak.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    gemm = []
    for dtype_name, dtype in DTYPES.items():
        for path in paths(dtype):
            for batch in BATCHES:
                for name, (n, k) in GEMM_SHAPES.items():
                    gflop_s = gemm_gflops(batch, n, k, dtype, args.repeats, path)
                    size = BYTES_PER_WEIGHT.get(path, dtype.itemsize)
                    weight_gb_s = gflop_s / (2 * batch) * size  # the weights read, per second
                    gemm.append({"dtype": dtype_name, "path": path, "batch": batch, "projection": name, "m": batch,
                                 "n": n, "k": k, "gflop_s": gflop_s, "weight_gb_s": weight_gb_s})
            gemm.append({"dtype": dtype_name, "path": path, "batch": 2048, "projection": "square 2048", "m": 2048,
                         "n": 2048, "k": 2048,
                         "gflop_s": gemm_gflops(2048, 2048, 2048, dtype, max(3, args.repeats // 4), path)})
    passes = [model_pass(dtype, args.repeats, path, batch) | {"dtype": name}
              for name, dtype in DTYPES.items() for path in paths(dtype) for batch in BATCHES]
    streaming = [p for p in passes if p["batch"] == 1]
    peaks = {name: {str(b): max(p["gflop_s"] for p in passes
                                if p["dtype"] == name and p["batch"] == b and p["path"] not in BYTES_PER_WEIGHT)
                    for b in BATCHES} for name in DTYPES}
    copy, read = copy_gb_s(args.repeats), read_gb_s(args.repeats)

    print(f"torch {torch.__version__}, {args.threads} threads\n")
    print("| dtype | path | batch | projection (M×N×K) | GFLOP/s | weights streamed (GB/s) |\n"
          "|---|---|---:|---|---:|---:|")
    for row in gemm:
        print(f"| {row['dtype']} | {row['path']} | {row['batch']} | {row['projection']} "
              f"({row['m']}×{row['n']}×{row['k']}) | {row['gflop_s']:.0f} | {row.get('weight_gb_s', 0):.1f} |")
    print("\n| dtype | path | batch | model pass (ms) | GFLOP/s | weights GB/s | tok/s bound |\n"
          "|---|---|---:|---:|---:|---:|---:|")
    for s in passes:
        print(f"| {s['dtype']} | {s['path']} | {s['batch']} | {s['step_ms']:.2f} | {s['gflop_s']:.0f} "
              f"| {s['gb_s']:.1f} | {s['tokens_per_s_bound']:.0f} |")
    print(f"\nmemory copy (256 MiB, read + write): {copy:.1f} GB/s; read (256 MiB summed): {read:.1f} GB/s")
    for dtype, by_batch in peaks.items():
        print(f"decode peak, {dtype} (a step's matmuls, fastest path), GFLOP/s by batch: "
              + ", ".join(f"{b}: {g:.0f}" for b, g in by_batch.items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": stamp(threads=args.threads, repeats=args.repeats), "gemm": gemm,
                                    "model_passes": passes, "weight_streaming": streaming, "copy_gb_s": copy,
                                    "read_gb_s": read,
                                    "decode_peak": peaks},
                                   indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
