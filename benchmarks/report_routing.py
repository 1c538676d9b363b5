"""The report section of benchmarks/prefix_routing.py (see report_sections.py)."""

from __future__ import annotations


def prefix_routing(page, data: dict) -> str:
    def vs(row: dict, ref: dict | None, key: str) -> str:
        return f"{row[key] / ref[key]:.2f}x" if ref else "-"

    for setting, run in data["settings"].items():
        table, meta = run["results"], run["meta"]
        base = table.get("hybridlb:least_loaded", {})
        page.text(f"**{setting}** (`{meta['command']}`, commit {meta['commit']}; medians of {meta['rounds']} "
                  "alternating rounds; ratios against `least_loaded`)")
        page.table(["server", "workload", "output tok/s", "vs least_loaded", "TTFT P50 ms", "vs least_loaded",
                    "TTFT P99 ms", "mean TPOT ms", "prefix hits", "failed"],
                   [[name, w, r["output_tok_s"], vs(r, base.get(w), "output_tok_s"), r["p50_ttft_ms"],
                     vs(r, base.get(w), "p50_ttft_ms"), r["p99_ttft_ms"], r["mean_tpot_ms"], f"{r['hit_rate']:.0%}",
                     r["failed"]] for name, workloads in table.items() for w, r in workloads.items()])
        if run.get("raw"):
            page.text("Output tok/s in each round (the spread the medians above hide):")
            page.table(["server", "workload", "per round", "min", "max"],
                       [[name, w, ", ".join(f"{r['output_tok_s']:.0f}" for r in rows),
                         min(r["output_tok_s"] for r in rows), max(r["output_tok_s"] for r in rows)]
                        for name, workloads in run["raw"].items() for w, rows in workloads.items() if rows])
    table = next(iter(data["settings"].values()))["results"]
    aware, base, vllm = (table.get(k, {}).get("system") for k in ("hybridlb:cache_aware", "hybridlb:least_loaded",
                                                                  "vllm"))
    if not (aware and base):
        return ""
    return (f"shared system prompts: cache_aware {aware['output_tok_s'] / base['output_tok_s']:.2f}x least_loaded's "
            "tok/s" + (f", {aware['output_tok_s'] / vllm['output_tok_s']:.2f}x vLLM's" if vllm else ""))
