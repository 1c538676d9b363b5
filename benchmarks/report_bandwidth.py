"""REPORT.md's sections on going past the memory-bandwidth wall: weights kept quantized
(benchmarks/quantized.py) and speculative decoding (benchmarks/speculative.py)."""

from __future__ import annotations

from report_sections import Page, bars


def rounds(values: list[float]) -> str:
    return ", ".join(f"{v:.0f}" if v >= 100 else f"{v:.1f}" for v in values)


def quantized(page: Page, data: dict) -> str:
    rows, streaming = data["rows"], data["streaming"]
    page.text(f"{data['meta'].get('rounds', '?')} rounds, each configuration alone on the machine, the order "
              "alternating; medians, each round's figure in brackets. Measured batch-1 bfloat16 weight streaming "
              f"(the wall at concurrency 1): **{streaming['gb_s']:.1f} GB/s** "
              f"({streaming['weight_mb']:.0f} MB in {streaming['step_ms']:.1f} ms).")
    page.table(["config", "c1 tok/s (rounds)", "× bf16", "c1 TPOT ms", "c16 tok/s (rounds)", "× bf16",
                "c16 TPOT ms", "weights/step MB", "c1 GB/s (of streaming)", "engine RSS MiB", "weights held MiB"],
               [[r["config"], f"{r['c1_output_tok_s']:.1f} ({rounds(r['c1_output_tok_s_rounds'])})",
                 r["c1_speedup"], r["c1_mean_tpot_ms"],
                 f"{r['c16_output_tok_s']:.0f} ({rounds(r['c16_output_tok_s_rounds'])})", r["c16_speedup"],
                 r["c16_mean_tpot_ms"], r["weight_mb_per_step"],
                 f"{r['c1_gb_s']:.1f} ({r['c1_fraction_of_streaming']:.0%})", r["rss_mib"],
                 f"{r['weights_held_mib']:.0f} ({r['weights_held_ratio']:.2f}×)" if "weights_held_mib" in r else "-"]
                for r in rows])
    page.text("Engine RSS is the whole engine process: the Python and torch runtime (~240 MiB before a model "
              "loads) and the 0.5 GiB KV cache are the same in every configuration; weights held is what the "
              "model's tensors take as the engine holds them (packed copies included).")
    quality = [[r["config"], " ".join(str(n) for n in r["greedy_tokens_agreeing_with_bf16"]),
                r.get("lm_eval", {}).get("mc_acc", "-"), r.get("lm_eval", {}).get("gen_exact_match", "-")]
               for r in rows]
    page.text("Quality: leading greedy tokens (of 16) each of 8 prompts shares with bf16, and the repository's "
              "lm-eval tasks (50 multiple-choice items, 50 generations).")
    page.table(["config", "greedy tokens agreeing", "lm-eval mc acc", "lm-eval gen exact match"], quality)

    def draw(left, right):
        names = [r["config"] for r in rows]
        bars(left, names, {"c1": [r["c1_output_tok_s"] for r in rows]}, "output tok/s at concurrency 1")
        bars(right, names, {"c16": [r["c16_output_tok_s"] for r in rows]}, "output tok/s at concurrency 16")

    page.figure("quantized", "output tok/s by weight format", draw, 2)
    by = {r["config"]: r for r in rows}
    return (f"c1: int8 {by['int8']['c1_speedup']:.2f}×, Q4 {by['q4']['c1_speedup']:.2f}× bf16; "
            f"c16: {by['int8']['c16_speedup']:.2f}×, {by['q4']['c16_speedup']:.2f}×")


def speculative(page: Page, data: dict) -> str:
    """benchmarks/speculative.py: n-gram speculation against none, and against vLLM's."""
    rows, ratios = data["rows"], data["ratios"]
    servers = list(dict.fromkeys(r["server"] for r in rows))
    workloads = list(ratios)
    by = {(r["server"], r["workload"]): r for r in rows}
    page.text(f"{data['meta'].get('rounds', '?')} rounds, each server alone on the machine, the order reversing "
              "every other round; medians, each round's figure in brackets. `copy`: repeat or fix the spelling of "
              "a ~200-token passage, 128 tokens out; `random`: 32 random token ids in, 64 out.")
    header = ["workload", *(f"{s} tok/s (rounds)" for s in servers), "ngram / none"]
    if any("ngram_vs_vllm_ngram" in v for v in ratios.values()):
        header += ["ngram / vLLM ngram", "vLLM: ngram / none"]
    table = []
    for w in workloads:
        cells = [w]
        for s in servers:
            r = by[(s, w)]
            accepted = f", {r['acceptance']:.0%} accepted" if "acceptance" in r else ""
            cells.append(f"{r['output_tok_s']:.1f} ({rounds(r['output_tok_s_rounds'])}){accepted}")
        cells.append(f"{ratios[w]['ngram_vs_none']:.2f}×")
        if "ngram_vs_vllm_ngram" in ratios[w]:
            cells += [f"{ratios[w]['ngram_vs_vllm_ngram']:.2f}×", f"{ratios[w]['vllm_ngram_vs_none']:.2f}×"]
        table.append(cells)
    page.table(header, table)
    page.table(["workload", *(f"{s} TPOT ms" for s in servers)],
               [[w, *(by[(s, w)]["mean_tpot_ms"] for s in servers)] for w in workloads])

    if "worst_case" in data:
        worst = data["worst_case"]["rows"]
        page.text("What drafts cost when none holds (`--worst-case`: one engine in-process, random prompts, a "
                  "test proposer whose drafts are always rejected, with the shipped back-off; "
                  f"{data['worst_case']['meta'].get('rounds', '?')} alternating rounds, medians):")
        page.table(["batch", "no drafts tok/s (rounds)", "drafts all rejected tok/s (rounds)", "ratio"],
                   [[shape, f"{r['none_tok_s']:.1f} ({rounds(r['rounds']['none'])})",
                     f"{r['rejected_tok_s']:.1f} ({rounds(r['rounds']['rejected drafts'])})", f"{r['ratio']:.2f}×"]
                    for shape, r in worst.items()])

    def draw(ax):
        bars(ax, workloads, {s: [by[(s, w)]["output_tok_s"] for w in workloads] for s in servers}, "output tok/s")

    page.figure("speculative", "output tok/s with and without n-gram speculation", draw, 1)
    summary = ", ".join(f"{w} {ratios[w]['ngram_vs_none']:.2f}×" for w in workloads)
    return f"ngram / none: {summary}"
