"""The report section of benchmarks/gguf_default.py: the bundled .gguf served as shipped (kept
quantized) against the bfloat16 Hugging Face checkpoint at concurrency 1, and a batch-1 step's
matmul time per projection kind. See report_sections.py."""

from __future__ import annotations

from report_sections import Page, bars

SERVED = {"default": "the .gguf, no flags (kept quantized; dtype auto)",
          "default-bf16": "the .gguf, --dtype bfloat16 (kept quantized)",
          "hf-bf16": "the Hugging Face directory, --dtype bfloat16"}
KINDS = ("qkv", "o", "gate_up", "down", "lm_head")


def gguf_default(page: Page, data: dict) -> str:
    c1, names = data["c1_tok_s"], list(SERVED)
    rounds = len(c1["rounds"]["default"])
    page.text(f"SmolLM2-135M-Instruct, one engine, 16 sequential requests of 32 random tokens in / 64 out per run; "
              f"each configuration alone, {rounds} rounds alternating the order; medians, each round in brackets. "
              "The 1-minute load average after each run shows whether something else shared the cores (the run's "
              "own engine counts 1-2).")
    page.table(["served", "output tok/s at c1", "vs the HF checkpoint in bfloat16", "load after the runs"],
               [[SERVED[n], f"{c1['median'][n]:.1f} ({', '.join(f'{v:.1f}' for v in c1['rounds'][n])})",
                 c1["ratio_to_hf_bf16"][n], ", ".join(f"{v:.1f}" for v in c1["load_1min_after"][n])]
                for n in names])
    if "noisy_run" in data:
        page.text("An earlier sitting whose load averages showed other work on the machine (3-8) is kept in the "
                  "JSON as `noisy_run` and not used here.")
    matmuls = data.get("matmul_ms")
    if matmuls:
        page.text("**Where a batch-1 step's matmul time goes**: each projection kind called on one row, summed over "
                  "the 30 layers, ms (median of 50); the layer class in brackets.")
        page.table(["loaded", *KINDS, "sum"],
                   [[matmuls[n]["label"], *(f"{matmuls[n][k]:.2f} ({matmuls[n][k + '_module']})" for k in KINDS),
                     sum(matmuls[n][k] for k in KINDS)] for n in names if n in matmuls])
    page.figure("gguf_default", "output tok/s at concurrency 1", lambda ax: bars(
        ax, [SERVED[n] for n in names], {"tok/s": [c1["median"][n] for n in names]}, "output tok/s at c1"))
    ratio = c1["ratio_to_hf_bf16"]
    return (f"c1: the .gguf as shipped {ratio['default']:.2f}x the HF checkpoint in bfloat16, "
            f"{ratio['default-bf16']:.2f}x with --dtype bfloat16")
