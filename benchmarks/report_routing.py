"""The report section of benchmarks/prefix_routing.py (see report_sections.py)."""

from __future__ import annotations


def prefix_routing(page, data: dict) -> str:
    def vs(row: dict, ref: dict | None, key: str) -> str:
        return f"{row[key] / ref[key]:.2f}x" if ref else "-"

    current = data["meta"].get("script_sha")
    settings = {name: run for name, run in data["settings"].items() if run["meta"].get("script_sha") == current}
    older = [name for name in data["settings"] if name not in settings]
    for setting, run in settings.items():
        table, meta = run["results"], run["meta"]
        base = table.get("hybridlb:least_loaded", {})
        page.text(f"**{setting}** (`{meta['command']}`, commit {meta['commit']}; medians of {meta['rounds']} "
                  "alternating rounds; ratios against `least_loaded`)")
        page.table(["server", "workload", "output tok/s", "vs least_loaded", "TTFT P50 ms", "vs least_loaded",
                    "TTFT P99 ms", "mean TPOT ms", "prefix hits", "ideal hits", "failed"],
                   [[name, w, r["output_tok_s"], vs(r, base.get(w), "output_tok_s"), r["p50_ttft_ms"],
                     vs(r, base.get(w), "p50_ttft_ms"), r["p99_ttft_ms"], r["mean_tpot_ms"], f"{r['hit_rate']:.0%}",
                     f"{r['ideal_hit_rate']:.0%}" if "ideal_hit_rate" in r else "-", r["failed"]]
                    for name, workloads in table.items() for w, r in workloads.items()])
        page.text("Ideal hits: perfect routing to caches that never evict (every earlier prompt's full 16-token "
                  "blocks reused), the most any server can get on the workload.")
        if run.get("raw"):
            page.text("Output tok/s and prefix hits in each round (the spread the medians above hide):")
            page.table(["server", "workload", "tok/s per round", "min", "max", "hits per round"],
                       [[name, w, ", ".join(f"{r['output_tok_s']:.0f}" for r in rows),
                         min(r["output_tok_s"] for r in rows), max(r["output_tok_s"] for r in rows),
                         ", ".join(f"{r['hit_rate']:.0%}" for r in rows)]
                        for name, workloads in run["raw"].items() for w, rows in workloads.items() if rows])
    if older:
        page.text("Not shown: settings measured by an older `prefix_routing.py` (rerun with their `--kv-cache-gib` "
                  "to bring them back): " + "; ".join(f"{name} (commit {data['settings'][name]['meta']['commit']})"
                                                      for name in older) + ".")
    return "; ".join(filter(None, (headline(name.removesuffix(" per engine"), run["results"])
                                   for name, run in settings.items())))


def headline(setting: str, table: dict) -> str:
    """cache_aware against least_loaded (and vLLM, where it ran) in one setting, tok/s."""
    aware, base, vllm = (table.get(k, {}) for k in ("hybridlb:cache_aware", "hybridlb:least_loaded", "vllm"))
    ratios = [f"{workload} {aware[workload]['output_tok_s'] / base[workload]['output_tok_s']:.2f}x"
              for workload in ("system", "multiturn") if workload in aware and workload in base]
    if not ratios:
        return ""
    text = f"{setting}: cache_aware / least_loaded tok/s {', '.join(ratios)}"
    if "system" in aware and "system" in vllm:
        text += f"; system {aware['system']['output_tok_s'] / vllm['system']['output_tok_s']:.2f}x vLLM"
    return text


def vllm_ranks(page, data: dict) -> str:
    """benchmarks/vllm_ranks.py: balance over vLLM ranks and multi-turn prefix hits, per server."""
    table, meta = data["results"], data["meta"]
    page.text(f"Medians of {meta['rounds']} alternating rounds, {meta['dtype']}, {meta['concurrency']} in flight; "
              "max/min: the largest rank's count over the smallest's (1.00 is even).")
    page.table(["server", "mixed tok/s", "requests max/min", "tokens max/min", "multiturn tok/s",
                "multiturn TTFT P50 ms", "prefix hits", "failed"],
               [[name, r["mixed"]["output_tok_s"], round(r["mixed"]["requests_max_min"], 2),
                 round(r["mixed"]["tokens_max_min"], 2), r["multiturn"]["output_tok_s"],
                 r["multiturn"]["p50_ttft_ms"], f"{r['multiturn']['hit_rate']:.0%}",
                 r["mixed"]["failed"] + r["multiturn"]["failed"]] for name, r in table.items()])
    page.text("Each round (mixed: requests / tokens per rank; multiturn: hit rate):")
    page.table(["server", "mixed", "multiturn"],
               [[name, "; ".join(f"{list(r['requests_per_rank'].values())} / "
                                 f"{[round(v) for v in r['tokens_per_rank'].values()]}" for r in runs["mixed"]),
                 ", ".join(f"{r['hit_rate']:.0%}" for r in runs["multiturn"])] for name, runs in data["raw"].items()])
    ours, theirs = table.get("hybridlb", {}), table.get("vllm", {})
    if not ours or not theirs:
        return ""
    hits = ours["multiturn"]["hit_rate"] / theirs["multiturn"]["hit_rate"] if theirs["multiturn"]["hit_rate"] else 0
    return (f"vLLM engine: tokens max/min {ours['mixed']['tokens_max_min']:.2f} vs vLLM DP's "
            f"{theirs['mixed']['tokens_max_min']:.2f}; multi-turn prefix hits {hits:.2f}x vLLM's")
