"""The report sections of benchmarks/vs_vllm.py and benchmarks/step_budget.py (see report_sections.py)."""

from __future__ import annotations

from report_sections import bars


def round_ratios(raw: list[dict]) -> dict[tuple[int, int, int], list[float]]:
    """Per workload, hybridlb's output tok/s over vLLM's in each round of ``raw``."""
    tok = {(r["server"], r["input"], r["output"], r["concurrency"], r["round"]): r["output_tok_s"] for r in raw}
    spread: dict[tuple[int, int, int], list[float]] = {}
    for (server, *shape, round_), value in sorted(tok.items(), key=lambda item: item[0][-1]):
        other = tok.get(("vllm", *shape, round_))
        if server == "hybridlb" and other:
            spread.setdefault(tuple(shape), []).append(value / other)
    return spread


def _with_rounds(row: dict):
    """A row's median output tok/s, with each round's figure where the run kept them."""
    rounds = row.get("output_tok_s_rounds")
    if not rounds:
        return row["output_tok_s"]
    return f"{row['output_tok_s']:.0f} ({', '.join(f'{v:.0f}' for v in rounds)})"


def vs_vllm(page, data: dict) -> str:
    ratios = []
    current = data.get("meta", {}).get("script_sha")
    stamps = data.get("stamps", {})
    older = [size for size in data["results"] if stamps.get(size, {}).get("script_sha") != current]
    page.text("Each server alone on the machine (started, warmed up at every shape, measured, stopped; then the "
              "other), rounds alternating which goes first; medians, each round's figure in brackets.")
    for size, rows in data["results"].items():
        if size in older:
            continue
        page.text(f"**{size if ' ' in size else size + ' qwen3'}**")
        page.table(["server", "in / out", "concurrency", "output tok/s", "mean TTFT ms", "P99 TTFT ms",
                    "mean TPOT ms", "failed", "RSS MiB", "per engine MiB"],
                   [[r["server"], f"{r['input']} / {r['output']}", r["concurrency"], _with_rounds(r),
                     r["mean_ttft_ms"], r["p99_ttft_ms"], r["mean_tpot_ms"], r["failed"], r.get("rss_mib", ""),
                     ", ".join(map(str, r.get("engine_rss_mib", [])))]
                    for r in rows])
        by = {(r["server"], r["input"], r["output"], r["concurrency"]): r["output_tok_s"] for r in rows}
        ratios += [v / by[("vllm", *k[1:])] for k, v in by.items() if k[0] == "hybridlb" and ("vllm", *k[1:]) in by]
        if spread := round_ratios(data.get("raw", {}).get(size, [])):
            page.text("hybridlb / vLLM output tok/s in each round (the spread the medians above hide):")
            page.table(["in / out", "concurrency", "per round", "min", "max"],
                       [[f"{i} / {o}", c, ", ".join(f"{v:.2f}" for v in values), min(values), max(values)]
                        for (i, o, c), values in spread.items()])

    def draw(*axes):
        shown = [(size, rows) for size, rows in data["results"].items() if size not in older]
        for ax, (size, rows) in zip(axes, shown, strict=True):
            shapes = sorted({(r["input"], r["output"], r["concurrency"]) for r in rows})
            tok = {(r["server"], r["input"], r["output"], r["concurrency"]): r["output_tok_s"] for r in rows}
            bars(ax, [f"{i}/{o} c{c}" for i, o, c in shapes],
                 {s: [tok.get((s, *shape), 0) for shape in shapes] for s in ("hybridlb", "vllm")},
                 "output tok/s", size if " " in size else f"{size} qwen3")

    dp = data.get("meta", {}).get("dp", 1)
    figure = data.get("meta", {}).get("figure") or ("vs_vllm" if dp == 1 else f"vs_vllm_dp{dp}")
    page.figure(figure, "output tok/s, hybridlb vs vLLM", draw,
                len(data["results"]) - len(older))
    if older:
        page.text("Not shown: runs made by an older `vs_vllm.py` (each model and setting is one run; rerun it to "
                  "bring it back): " + "; ".join(f"{size} (commit {stamps.get(size, {}).get('commit', '?')})"
                                                 for size in older) + ".")
    if data.get("vllm_bench_serve_against_hybridlb"):
        page.text("`vllm bench serve` against hybridlb (API compatibility):")
        page.code(data["vllm_bench_serve_against_hybridlb"])
    return f"hybridlb/vLLM output tok/s {min(ratios):.2f}-{max(ratios):.2f}x" if ratios else ""


def step_budget(page, data: dict) -> str:
    rows = data["rows"]
    page.table(["budget (tokens per step)", "in / out", "concurrency", "output tok/s", "mean TTFT ms", "P99 TTFT ms",
                "mean TPOT ms"],
               [[r["budget"], f"{r['input']} / {r['output']}", r["concurrency"], _with_rounds(r), r["mean_ttft_ms"],
                 r["p99_ttft_ms"], r["mean_tpot_ms"]] for r in rows])

    def draw(ax):
        shapes = sorted({(r["input"], r["output"], r["concurrency"]) for r in rows})
        budgets = sorted({r["budget"] for r in rows}, reverse=True)
        by = {(r["budget"], r["input"], r["output"], r["concurrency"]): r["mean_ttft_ms"] for r in rows}
        bars(ax, [f"{i}/{o} c{c}" for i, o, c in shapes],
             {f"budget {b}": [by[(b, *s)] for s in shapes] for b in budgets}, "mean TTFT ms")

    page.figure("step_budget", "mean TTFT by step budget", draw)
    first = rows[0]
    at = {r["budget"]: r for r in rows if (r["input"], r["output"], r["concurrency"]) ==
          (first["input"], first["output"], first["concurrency"])}
    if len(at) >= 2:  # the largest budget against the next one down
        high, low = sorted(at, reverse=True)[:2]
        a, b = at[high], at[low]
        return (f"{first['input']}/{first['output']} c{first['concurrency']}, {low} vs {high}: TTFT "
                f"{b['mean_ttft_ms'] / a['mean_ttft_ms']:.2f}x, TPOT {b['mean_tpot_ms'] / a['mean_tpot_ms']:.2f}x, "
                f"tok/s {b['output_tok_s'] / a['output_tok_s']:.2f}x")
    return f"{len(rows)} rows"
