"""The bundled .gguf file served as shipped (its weights kept quantized, the default since issue 51)
against the bfloat16 Hugging Face checkpoint of the same model, at concurrency 1; and where a
batch-1 step's matmul time goes on this CPU, per projection kind.

* **Serving.** ``hybridlb serve smollm2-135m-instruct`` with no flags (``default``: dtype auto,
  quantization gguf), the same with ``--dtype bfloat16`` (``default-bf16``), and the Hugging Face
  directory transformers writes from the file (the same weights, dequantized) with ``--dtype
  bfloat16`` (``hf-bf16``). One engine each. Each round starts one configuration, warms it up,
  sends 16 sequential requests of 32 random tokens in / 64 out (``--ignore-eos``), stops it; the
  order alternates between rounds. Output tok/s, median of the rounds (each round's figure too).
* **Matmuls.** The engine's own layers, as each configuration loads them (``LLM``, in this
  process): every qkv / o / gate-up / down projection of the 30 layers and the output layer,
  called on one row, in milliseconds summed over the layers (median of ``--repeats``).

    python benchmarks/gguf_default.py [--rounds 3] [--no-serve] [--no-matmuls]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from common import SMOLLM2, Server, drive, smollm2_hf_dir, stamp

VOCAB = 49152
KINDS = ("qkv", "o", "gate_up", "down")
CONFIGS = {"default": ("gguf", []), "default-bf16": ("gguf", ["--dtype", "bfloat16"]),
           "hf-bf16": ("hf", ["--dtype", "bfloat16"])}
LOADS = {"default": (SMOLLM2, {}), "default-bf16": (SMOLLM2, {"dtype": "bfloat16"}),
         "hf-bf16": ("hf", {"dtype": "bfloat16"})}


def serve_c1(name: str, model: str, flags: list[str], seed: int) -> tuple[float, float]:
    """Output tok/s of one configuration at concurrency 1, and the machine's 1-minute load average after it
    (the run's own engine counts ~1-2: more is someone else's work on the same cores)."""
    server = Server.hybridlb(f"gguf_default_{name}", model, "--served-model-name", "smollm2", "--kv-cache-gib",
                             "0.5", *flags)
    try:
        server.wait_ready()
        drive([server.url], "smollm2", VOCAB, 32, 64, 2, 1, seed=seed + 99)  # warm-up
        tok_s = drive([server.url], "smollm2", VOCAB, 32, 64, 16, 1, seed=seed)["output_throughput"]
        return tok_s, os.getloadavg()[0]
    finally:
        server.stop()


def timed_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def matmul_ms(model_path: str, options: dict, repeats: int) -> dict:
    """Milliseconds per batch-1 call of each projection kind (summed over the layers) and the output layer."""
    from hybridlb import LLM

    llm = LLM(model_path, max_model_len=256, num_kv_blocks=16, **options)
    runner = llm.engine.runner
    model, hidden = runner.model, runner.spec.hidden_size
    out = {"label": runner.label()}
    with torch.no_grad():
        for kind in KINDS:
            layers = [getattr(layer.self_attn if kind in ("qkv", "o") else layer.mlp, kind) for layer in model.layers]
            inputs = [torch.randn(1, getattr(layer, "in_features", hidden), dtype=runner.dtype) for layer in layers]
            out[kind] = timed_ms(lambda ls=layers, xs=inputs: [f(x) for f, x in zip(ls, xs, strict=True)], repeats)
            out[f"{kind}_module"] = type(layers[0]).__name__
        x = torch.randn(1, hidden, dtype=runner.dtype)
        out["lm_head"] = timed_ms(lambda: model.logits(x), repeats)
        out["lm_head_module"] = type(model.lm_head).__name__
    del llm
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--no-serve", action="store_true")
    parser.add_argument("--no-matmuls", action="store_true")
    parser.add_argument("--models-dir", type=Path, default=Path("/tmp/hybridlb-bench-models"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gguf_default.json"))
    args = parser.parse_args()
    hf = smollm2_hf_dir(args.models_dir)
    result: dict = {"meta": stamp(rounds=args.rounds)}
    if not args.no_matmuls:
        result["matmul_ms"] = {}
        for name, (path, options) in LOADS.items():
            row = matmul_ms(hf if path == "hf" else path, options, args.repeats)
            result["matmul_ms"][name] = row
            print(f"{name:<13} " + "  ".join(f"{k} {row[k]:.2f} ms ({row[k + '_module']})" for k in (*KINDS, "lm_head"))
                  + f"  [{row['label']}]", flush=True)
    if not args.no_serve:
        runs: dict[str, list[float]] = {name: [] for name in CONFIGS}
        loads: dict[str, list[float]] = {name: [] for name in CONFIGS}
        names = list(CONFIGS)
        for round_ in range(args.rounds):
            for name in names if round_ % 2 == 0 else names[::-1]:
                kind, flags = CONFIGS[name]
                tok_s, load = serve_c1(name, hf if kind == "hf" else SMOLLM2, flags, seed=round_)
                runs[name].append(tok_s)
                loads[name].append(load)
                print(f"round {round_ + 1} {name:<13} c1 {tok_s:6.1f} tok/s (load {load:.1f})", flush=True)
        medians = {name: statistics.median(values) for name, values in runs.items()}
        result["c1_tok_s"] = {"rounds": runs, "load_1min_after": loads, "median": medians,
                              "ratio_to_hf_bf16": {n: m / medians["hf-bf16"] for n, m in medians.items()}}
        for name in names:
            print(f"{name:<13} c1 median {medians[name]:6.1f} tok/s {runs[name]}  "
                  f"x{medians[name] / medians['hf-bf16']:.2f} hf-bf16")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
