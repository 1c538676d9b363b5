"""Weights kept quantized against bfloat16, each configuration alone on the machine.

SmolLM2-135M-Instruct from its Q4_1 GGUF file, bfloat16 activations, three configurations of
``hybridlb serve`` (one engine): ``bf16`` (``--quantization none``: the file dequantized), ``int8``
(``--quantization int8``: per-channel int8 from the dequantized values) and ``q4`` (no flag: a .gguf
file's default, ``gguf``, the file's own 4-bit blocks). Each round starts one configuration,
warms it up, measures every shape, stops it, then the next; the order alternates between
rounds. Shapes: 32 in / 64 out at concurrency 1 (16 sequential requests) and 16 (64 requests),
random prompts, ``--ignore-eos``. Reported per configuration: output tok/s and mean TPOT
(median of the rounds, with each round's figure), the engine's RSS after the run (/ranks), the
bytes of weight a decode step streams, and at concurrency 1 those bytes times the tokens per
second as a fraction of this machine's measured batch-1 bfloat16 weight streaming
(``machine_peak.weight_streaming``, measured in this run with no server up). Quality, once per
configuration: how many of 16 greedy tokens each of 8 prompts shares with ``bf16``, and, unless
``--no-lm-eval``, the repository's lm-eval tasks (tests/real/evals) through ``lm_eval --model
local-completions``.

    python benchmarks/quantized.py [--rounds 3] [--no-lm-eval]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import torch
from common import SMOLLM2, Server, drive, smollm2_hf_dir, stamp
from machine_peak import engine_path, weight_streaming

CONFIGS = {"bf16": ["--quantization", "none"], "int8": ["--quantization", "int8"], "q4": []}
METHODS = {"bf16": None, "int8": "int8", "q4": "gguf"}  # what each configuration's engine keeps
SHAPES = [(32, 64, 1), (32, 64, 16)]
PROMPTS = {1: 16, 16: 64}
VOCAB = 49152
QUALITY_PROMPTS = ["The alarm went off", "def main():\n    print('hello, world')\n", "The capital of France is",
                   "Once upon a time there was a small village near a river where people",
                   "1 2 3 4 5 6 7 8 9 10 11 12", "The three primary colors are", "import numpy as np\n",
                   "Water boils at"]
AGREE = 16
ROOT = Path(__file__).resolve().parents[1]


def weight_bytes(quantization: str | None) -> dict:
    """``streamed``: bytes of weight one batch-1 decode step reads (every projection and the output layer;
    the embedding is a lookup of one row per token; an output layer kept as codes reads those, not its
    dense copy). ``held``: bytes of every tensor the model holds as the engine holds it (packed for the
    kernels; a tied output layer's packed copy and a kept-as-codes layer's dense copy included)."""
    from hybridlb import kernels
    from hybridlb.checkpoint.spec import load_spec
    from hybridlb.model.loader import load_model
    from hybridlb.model.quantized import Int8GroupLinear

    spec = load_spec(SMOLLM2)
    model = load_model(SMOLLM2, spec, torch.bfloat16, torch.device("cpu"), 1024, quantization=quantization)
    streamed = 0
    for name, module in model.named_modules():
        if isinstance(module, Int8GroupLinear):
            streamed += sum(t.numel() * t.element_size() for t in (module.packed, module.group_scales))
            continue
        if name == "embed" or name == "lm_head.dense" or not name or list(module.children()):
            continue
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if hasattr(module, "out_features"):
            streamed += sum(t.numel() * t.element_size() for t in tensors)
    found = kernels.load()
    if found is not None:
        model.use_cpu_kernels(found, pack_linears=True)
    held = {}
    for module in model.modules():
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False),
                       *(v for v in vars(module).values() if isinstance(v, torch.Tensor))]:
            held[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
    return {"streamed": streamed, "held": sum(held.values())}


def greedy(url: str) -> list[list[str]]:
    outs = []
    for prompt in QUALITY_PROMPTS:
        body = {"model": "smollm2", "prompt": prompt, "max_tokens": AGREE, "temperature": 0, "ignore_eos": True,
                "logprobs": 0}
        outs.append(httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]["logprobs"]
                    ["tokens"])
    return outs


def lm_eval_scores(url: str, tokenizer_dir: str) -> dict:
    with tempfile.TemporaryDirectory() as out:
        model_args = (f"model=smollm2,base_url={url}/v1/completions,tokenizer={tokenizer_dir},"
                      "tokenizer_backend=huggingface,num_concurrent=4,max_retries=1")
        command = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
                   "--include_path", "tests/real/evals", "--tasks", "hybridlb_smoke_mc,hybridlb_smoke_gen",
                   "--output_path", out, "--batch_size", "1"]
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True, timeout=1800)
        results = json.loads(next(Path(out).rglob("results_*.json")).read_text())["results"]
    return {"mc_acc": results["hybridlb_smoke_mc"]["acc,none"],
            "gen_exact_match": results["hybridlb_smoke_gen"]["exact_match,none"]}


def run_config(name: str, flags: list[str], seed: int, quality: bool, tokenizer_dir: str | None) -> dict:
    # --kv-cache-gib 0.5: the engine's default (the helper's 1 GiB would be most of the RSS compared).
    server = Server.hybridlb(f"quantized_{name}", SMOLLM2, "--served-model-name", "smollm2", "--dtype", "bfloat16",
                             "--kv-cache-gib", "0.5", *flags)
    try:
        ready_s = server.wait_ready()
        for input_len, output_len, concurrency in SHAPES:  # warm-up, every shape
            drive([server.url], "smollm2", VOCAB, input_len, output_len, 2 * concurrency, concurrency, seed=seed + 99)
        rows = {}
        for input_len, output_len, concurrency in SHAPES:
            s = drive([server.url], "smollm2", VOCAB, input_len, output_len, PROMPTS[concurrency], concurrency,
                      seed=seed)
            rows[f"c{concurrency}"] = {"output_tok_s": s["output_throughput"], "mean_tpot_ms": s["mean_tpot_ms"],
                                       "mean_ttft_ms": s["mean_ttft_ms"], "failed": s["failed"]}
            print(f"  {name:<5} c{concurrency:<3} {s['output_throughput']:7.1f} tok/s  "
                  f"TPOT {s['mean_tpot_ms']:6.1f} ms", flush=True)
        rss = httpx.get(f"{server.url}/ranks", timeout=10).json()["engines"][0]["rss_mib"]
        result = {"ready_s": ready_s, "rss_mib": rss, **rows}
        if quality:
            result["greedy"] = greedy(server.url)
            if tokenizer_dir:
                result["lm_eval"] = lm_eval_scores(server.url, tokenizer_dir)
                print(f"  {name:<5} lm-eval {result['lm_eval']}", flush=True)
        return result
    finally:
        server.stop()


def agreed(ours: list[str], theirs: list[str]) -> int:
    return next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), len(ours))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-lm-eval", action="store_true")
    parser.add_argument("--models-dir", type=Path, default=Path("/tmp/hybridlb-bench-models"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/quantized.json"))
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count())
    tokenizer_dir = None if args.no_lm_eval else smollm2_hf_dir(args.models_dir)
    streaming = weight_streaming(torch.bfloat16, 20, engine_path())  # nothing else running; the engine's path
    print(f"bfloat16 batch-1 weight streaming: {streaming['gb_s']:.1f} GB/s", flush=True)
    weights = {name: weight_bytes(METHODS[name]) for name in CONFIGS}
    step_bytes = {name: w["streamed"] for name, w in weights.items()}
    runs: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    names = list(CONFIGS)
    for round_ in range(args.rounds):
        order = names if round_ % 2 == 0 else names[::-1]
        print(f"round {round_ + 1}: {' -> '.join(order)}", flush=True)
        for name in order:
            runs[name].append(run_config(name, CONFIGS[name], seed=round_, quality=round_ == 0,
                                         tokenizer_dir=tokenizer_dir))
    rows = []
    for name in names:
        row = {"config": name, "weight_mb_per_step": step_bytes[name] / 1e6,
               "weights_held_mib": weights[name]["held"] / 2**20,
               "rss_mib": statistics.median(r["rss_mib"] for r in runs[name])}
        for shape in ("c1", "c16"):
            for metric in ("output_tok_s", "mean_tpot_ms", "mean_ttft_ms"):
                values = [r[shape][metric] for r in runs[name]]
                row[f"{shape}_{metric}"] = statistics.median(values)
                row[f"{shape}_{metric}_rounds"] = values
        row["c1_gb_s"] = step_bytes[name] * row["c1_output_tok_s"] / 1e9
        row["c1_fraction_of_streaming"] = row["c1_gb_s"] / streaming["gb_s"]
        first = runs[name][0]
        row["greedy_tokens_agreeing_with_bf16"] = [agreed(a, b) for a, b in zip(first["greedy"],
                                                                                runs["bf16"][0]["greedy"],
                                                                                strict=True)]
        if "lm_eval" in first:
            row["lm_eval"] = first["lm_eval"]
        rows.append(row)
    base = rows[0]
    for row in rows:
        row["c1_speedup"] = row["c1_output_tok_s"] / base["c1_output_tok_s"]
        row["c16_speedup"] = row["c16_output_tok_s"] / base["c16_output_tok_s"]
        row["rss_ratio"] = row["rss_mib"] / base["rss_mib"]
        row["weight_ratio"] = row["weight_mb_per_step"] / base["weight_mb_per_step"]
        row["weights_held_ratio"] = row["weights_held_mib"] / base["weights_held_mib"]
    print("\n| config | c1 tok/s | × bf16 | c16 tok/s | × bf16 | weights/step MB | c1 GB/s (of streaming) | RSS MiB "
          "| weights held MiB |")
    for row in rows:
        print(f"| {row['config']} | {row['c1_output_tok_s']:.1f} | {row['c1_speedup']:.2f} | "
              f"{row['c16_output_tok_s']:.0f} | {row['c16_speedup']:.2f} | {row['weight_mb_per_step']:.0f} | "
              f"{row['c1_gb_s']:.1f} ({row['c1_fraction_of_streaming']:.0%}) | {row['rss_mib']:.0f} | "
              f"{row['weights_held_mib']:.0f} ({row['weights_held_ratio']:.2f}x) |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": stamp(rounds=args.rounds), "streaming": streaming, "rows": rows,
                                    "runs": runs}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
