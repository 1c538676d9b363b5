"""The markdown page of benchmarks/REPORT.md and one renderer per benchmark.

Each renderer is named after its benchmark's JSON file (``load`` renders load.json), takes
the page and the parsed JSON, adds a table of every figure and its plots, and returns a
one-line headline for the summary. ``benchmarks/report.py`` drives them (its ``SECTIONS``
names the renderer of each JSON file, here and in ``report_api``, ``report_routing`` and
``report_vs_vllm``).
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path


class Page:
    """Markdown lines under construction and the PNGs drawn for them."""

    def __init__(self, images: Path, plt):
        self.images, self.plt, self.lines = images, plt, []
        self.pngs: list[Path] = []

    def text(self, *paragraphs: str) -> None:
        for paragraph in paragraphs:
            self.lines += [paragraph, ""]

    def code(self, text: str) -> None:
        self.lines += ["```", text.strip(), "```", ""]

    def table(self, headers: list[str], rows: list[list]) -> None:
        """A markdown table; columns of numbers are right-aligned."""
        numeric = [all(isinstance(row[i], int | float) and not isinstance(row[i], bool) for row in rows)
                   for i in range(len(headers))]
        self.lines.append("| " + " | ".join(headers) + " |")
        self.lines.append("|" + "|".join("---:" if n else "---" for n in numeric) + "|")
        self.lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
        self.lines.append("")

    def figure(self, name: str, caption: str, draw: Callable, panels: int = 1) -> None:
        """Draw ``draw(*axes)`` into report/<name>.png and link it."""
        if self.plt is None:
            self.text(f"_(plot `{name}.png` skipped: matplotlib is not installed; `pip install -e '.[bench]'`)_")
            return
        fig, axes = self.plt.subplots(1, panels, figsize=(5.2 * panels, 3.4), squeeze=False)
        try:
            draw(*axes[0])
            fig.tight_layout()
            path = self.images / f"{name}.png"
            fig.savefig(path, dpi=100)
            self.pngs.append(path)
        finally:
            self.plt.close(fig)
        self.text(f"![{caption}](report/{name}.png)")


def cell(value) -> str:
    """A table cell: floats to three significant-ish figures, lists joined."""
    if isinstance(value, float):
        size = abs(value)
        return f"{value:.0f}" if size >= 100 else f"{value:.1f}" if size >= 10 else f"{value:.2f}" if size >= 0.1 \
            else f"{value:.3g}"
    if isinstance(value, list | tuple):
        return ", ".join(cell(v) for v in value)
    return str(value).replace("|", "\\|").replace("\n", " ")


# -- sections: one function per benchmark, named after its JSON; each returns a headline --------
def bars(ax, groups: list[str], series: dict[str, list[float]], ylabel: str, title: str = "") -> None:
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series.items()):
        ax.bar([g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))], values, width, label=label)
    ax.set_xticks(range(len(groups)), [textwrap.fill(g, 16) for g in groups], fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    if len(series) > 1:
        ax.legend(fontsize=7)


ARCHES = {"smollm2": "SmolLM2-135M", "dense": "qwen3", "moe": "qwen3_moe"}  # engine_throughput.py --models


def engine_throughput(page: Page, data: dict) -> str:
    rows, outside = [], []
    current = data.get("meta", {}).get("script_sha")
    older = [r for r in data["results"] if (r.get("meta") or {}).get("script_sha") != current]
    data = {**data, "results": [r for r in data["results"] if r not in older]}
    for r in data["results"]:
        m = r["mixed"]
        for key, theirs in ((k, v) for k, v in m.items() if k.startswith("transformers_")):
            rows.append([r["arch"], f"mixed {m['requests']} ({key.split('_')[1]})", m["hybridlb_tok_s"], theirs,
                         f"{m['hybridlb_tok_s'] / theirs:.2f}x"])
        rows += [[r["arch"], f"fixed batch {b}", f["hybridlb_tok_s"], f["transformers_tok_s"], f"{f['ratio']:.2f}x"]
                 for b, f in r["fixed"].items()]
        outside.append([r["arch"], *(f"{v:.0%}" for v in r["outside_torch_fraction"].values())])
    page.table(["model", "workload", "hybridlb tok/s", "transformers tok/s", "ratio"], rows)
    spread = [[r["arch"], label, cell(ratios), f"{min(ratios):.2f}x", f"{max(ratios):.2f}x"]
              for r in data["results"] for label, ratios in
              [("mixed (vs best)", r["mixed"].get("ratios", []))]
              + [(f"fixed batch {b}", f.get("ratios", [])) for b, f in r["fixed"].items()] if ratios]
    if spread:
        page.text(f"hybridlb / transformers in each of the {data['results'][0].get('rounds', '?')} alternating rounds "
                  "(the medians above are over these):")
        page.table(["model", "workload", "per round", "min", "max"], spread)
    page.text("Share of a decode step's wall time spent outside torch ops (torch profiler):")
    page.table(["model", *(f"batch {b}" for b in data["results"][0]["outside_torch_fraction"])], outside)

    def draw(*axes):
        for ax, r in zip(axes, data["results"], strict=True):
            best = max(v for k, v in r["mixed"].items() if k.startswith("transformers_"))
            bars(ax, ["mixed", *(f"batch {b}" for b in r["fixed"])],
                 {"hybridlb": [r["mixed"]["hybridlb_tok_s"], *(f["hybridlb_tok_s"] for f in r["fixed"].values())],
                  "transformers (best)": [best, *(f["transformers_tok_s"] for f in r["fixed"].values())]},
                 "output tok/s", r["arch"])

    page.figure("engine_throughput", "output tok/s, hybridlb vs transformers", draw, len(data["results"]))
    if older:
        page.text("Not shown: models measured by an older `engine_throughput.py` (rerun with `--models "
                  + ",".join(k for k, v in ARCHES.items() if v in {r["arch"] for r in older})
                  + "` to bring them back): "
                  + ", ".join(f"{r['arch']} (commit {(r.get('meta') or {}).get('commit', '?')})" for r in older) + ".")
    return "; ".join(f"{r['arch']} mixed {r['mixed']['ratio_vs_best_transformers']:.2f}x best transformers"
                     for r in data["results"])


def dp_overhead(page: Page, data: dict) -> str:
    page.table(["setup", "output tok/s", "mean TTFT ms", "P99 TTFT ms", "mean TPOT ms", "failed"],
               [[r["setup"], r["output_tok_s"], r["mean_ttft_ms"], r["p99_ttft_ms"], r["mean_tpot_ms"], r["failed"]]
                for r in data["overhead"]])
    page.text(f"Output throughput DP=2 / two independent servers (two API server processes and two engines on "
              f"each side): per round {cell(data['ratios'])}, median **{data['ratio']:.3f}** (goal >= 0.97).",
              "Balance under skew:")
    balance = data["balance"]
    page.table(["policy", "busy s per rank", "busy max / mean", "P99 TTFT ms", "output tok/s", "failed"],
               [[b["policy"], ", ".join(f"{k}: {v:.2f}" for k, v in b["busy_s"].items()), b["busy_max_over_mean"],
                 b["p99_ttft_ms"], b["output_tok_s"], b["failed"]] for b in balance])

    def draw(left, right):
        setups = list(dict.fromkeys(r["setup"] for r in data["overhead"]))
        means = [sum(r["output_tok_s"] for r in data["overhead"] if r["setup"] == s)
                 / sum(r["setup"] == s for r in data["overhead"]) for s in setups]
        bars(left, [s.split(",")[0].replace("--data-parallel-", "") for s in setups], {"mean": means}, "output tok/s",
             "overhead (mean over rounds)")
        ranks = sorted({k for b in balance for k in b["busy_s"]})
        bars(right, [b["policy"] for b in balance],
             {f"rank {k}": [b["busy_s"].get(k, 0) for b in balance] for k in ranks}, "busy s", "balance under skew")

    page.figure("dp_overhead", "DP overhead and balance", draw, 2)
    best = {b["policy"]: b["busy_max_over_mean"] for b in balance}
    return f"DP=2/independent {data['ratio']:.2f}; busy max/mean " + ", ".join(f"{k} {v:.2f}" for k, v in best.items())


def moe_waves(page: Page, data: dict) -> str:
    setups = data["setups"]
    page.table(["setup", "step ms", "metadata share", "MoE collectives share", "TPOT ms", "output tok/s", "failed"],
               [[s["setup"], s["step_ms"], f"{s['meta_share']:.1%}", f"{s['collective_share']:.1%}", s["tpot_ms"],
                 s["output_tok_s"], s["failed"]] for s in setups])
    if all("tpot_ms_rounds" in s for s in setups):
        page.text(f"Medians over {len(setups[0]['tpot_ms_rounds'])} alternating rounds; TPOT ms in each round: "
                  + "; ".join(f"{s['setup']} {cell(s['tpot_ms_rounds'])}" for s in setups) + ".")
    skew = data["skew"]
    ranks = sorted({r for s in skew for r in s["dummy_fraction"]})
    label = [f"{s['share_rank0']:.0%} on rank 0" for s in skew]
    page.text("Dummy-step fraction per rank under skewed load (4 concurrent, pinned by header):")
    page.table(["load", *(f"rank {r}" for r in ranks)],
               [[lb, *(f"{s['dummy_fraction'].get(r, 0):.1%}" for r in ranks)]
                for lb, s in zip(label, skew, strict=True)])

    def draw(left, right):
        names = [s["setup"].replace(", ", "\n") for s in setups]
        meta = [s["step_ms"] * s["meta_share"] for s in setups]
        coll = [s["step_ms"] * s["collective_share"] for s in setups]
        left.bar(names, [s["step_ms"] - m - c for s, m, c in zip(setups, meta, coll, strict=True)], label="compute")
        left.bar(names, coll, bottom=[s["step_ms"] - m - c for s, m, c in zip(setups, meta, coll, strict=True)],
                 label="MoE collectives")
        left.bar(names, meta, bottom=[s["step_ms"] - m for s, m in zip(setups, meta, strict=True)], label="metadata")
        left.set_ylabel("ms per step")
        left.tick_params(axis="x", labelsize=7)
        left.legend(fontsize=7)
        bars(right, label, {f"rank {r}": [100 * s["dummy_fraction"].get(r, 0) for s in skew] for r in ranks},
             "dummy steps %", "dummy steps vs skew")

    page.figure("moe_waves", "MoE step time breakdown and dummy steps under skew", draw, 2)
    by = {s["setup"]: s for s in setups}
    async_row = next((s for name, s in by.items() if "async" in name), setups[-1])
    worst = max(v for s in skew for v in s["dummy_fraction"].values())
    return f"async metadata {async_row['meta_share']:.1%} of step time; dummy steps <= {worst:.1%} under skew"


def up_time(page: Page, data: dict) -> str:
    local, three = data["local"], data["three_nodes"]
    page.table(["setup", "ready s", "RSS MiB", "PSS MiB"],
               [["`hybridlb serve` configs/local.yaml", local["serve"]["ready_s"], local["serve"]["tree_rss_mib"],
                 local["serve"].get("tree_pss_mib", "")],
                ["`hybridlb up` configs/local.yaml (private Ray)", local["up"]["ready_s"], local["up"]["tree_rss_mib"],
                 local["up"].get("tree_pss_mib", "")],
                ["`up` on 3 Ray nodes x 2 engines (raylet trees)", three["ready_s"], three["raylet_tree_rss_mib"], ""]])
    page.text("RSS counts a page shared by several processes of the tree in each; PSS splits it among them "
              "(a `serve` node's engines are forked from one server and share torch's pages).")
    page.text(f"Ray adds **{local['ray_adds_mib']:.0f} MiB** on one node.")

    def draw(left, right):
        bars(left, ["serve", "up", "up, 3 nodes"],
             {"ready s": [local["serve"]["ready_s"], local["up"]["ready_s"], three["ready_s"]]}, "seconds to ready")
        bars(right, ["serve", "up"], {"RSS": [local["serve"]["tree_rss_mib"], local["up"]["tree_rss_mib"]]},
             "process tree RSS MiB")

    page.figure("up_time", "time to ready and memory", draw, 2)
    return (f"serve ready {local['serve']['ready_s']:.1f} s, up {local['up']['ready_s']:.1f} s; "
            f"Ray +{local['ray_adds_mib']:.0f} MiB")


def load(page: Page, data: dict) -> str:
    s, c = data["summary"], data["config"]
    page.text(f"{c['clients']} streaming completions ({c['input_len']} token ids in, {c['max_tokens']} out, "
              f"ignore_eos) released at once; DP={c['data_parallel_size']}, max_num_seqs {c['max_num_seqs']} "
              "per engine (the rest queue).")
    page.table(["figure", "value"], [[label(k), v] for k, v in s.items()])
    if data.get("errors"):
        page.text("Errors:", "\n".join(f"* `{e}`" for e in data["errors"]))

    def draw(ax):
        for key, name in (("ttft_ms", "TTFT"), ("e2e_ms", "end to end")):
            values = sorted(v / 1000 for v in data[key])
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=name)
        ax.set_xlabel("seconds after the burst was sent")
        ax.set_ylabel("fraction of requests")
        ax.legend(fontsize=7)

    page.figure("load_latency_cdf", "latency CDF of the burst", draw)
    return (f"{s['clients']} clients: {s['failed']} failed, TTFT P99 {s['ttft_p99_ms'] / 1000:.1f} s, "
            f"{s['output_tok_s']:.0f} tok/s")


def soak(page: Page, data: dict) -> str:
    c = data["config"]
    duration = f"{c['duration_s'] / 60:.0f} min" if c["duration_s"] >= 120 else f"{c['duration_s']:.0f} s"
    page.text(f"{duration} at concurrency {c['concurrency']} (first {c['warmup_s']:.0f} s "
              f"warm-up), RSS sampled every {c['interval_s']:.0f} s: **{data['completed']}** requests done, "
              f"**{data['failed']}** failed, healthy after: {data['healthy_after']}. Verdict **{data['verdict']}** "
              f"(no failures and every slope over the late half of the run after warm-up < "
              f"{c['max_slope_mib_per_min']} MiB/min: a leak grows steadily, a cache filling up flattens).")
    page.table(["process", "RSS after warm-up MiB", "RSS at end MiB", "slope MiB/min", "early half", "late half",
                "flat"],
               [[n, f"{p['start_mib']:.1f}", f"{p['end_mib']:.1f}", f"{p['slope_mib_per_min']:+.2f}",
                 f"{p.get('early_slope_mib_per_min', float('nan')):+.2f}",
                 f"{p.get('late_slope_mib_per_min', float('nan')):+.2f}", p["flat"]]
                for n, p in data["processes"].items()])
    if data.get("errors"):
        page.text("Errors:", "\n".join(f"* `{e}`" for e in data["errors"]))
    samples = data["samples"]

    def draw(left, right):
        steady = [s for s in samples if s["t_s"] >= c["warmup_s"]] or samples
        changes = [0.0]
        for name in data["processes"]:
            points = [(s["t_s"] / 60, s["rss_mib"][name]) for s in samples if name in s["rss_mib"]]
            left.plot([t for t, _ in points], [v for _, v in points], label=name)
            after = [(s["t_s"] / 60, s["rss_mib"][name]) for s in steady if name in s["rss_mib"]]
            changes += [v - after[0][1] for _, v in after]
            right.plot([t for t, _ in after], [v - after[0][1] for _, v in after], label=name)
        right.set_ylim(min(-2.0, min(changes) - 0.5), max(2.0, max(changes) + 0.5))  # noise must not look like a trend
        for ax, title in ((left, "RSS MiB"), (right, "RSS change since warm-up, MiB")):
            ax.axvline(c["warmup_s"] / 60, color="grey", linestyle=":")
            ax.set_xlabel("minutes")
            ax.set_title(title, fontsize=9)
        left.legend(fontsize=6)

    page.figure("soak_rss", "RSS of every serve process over the soak", draw, 2)
    worst = max(p.get("late_slope_mib_per_min", p["slope_mib_per_min"]) for p in data["processes"].values())
    return f"{data['verdict']}: {data['failed']} failed of {data['completed']}; max late slope {worst:.2f} MiB/min"


def control_plane(page: Page, data: dict) -> str:
    if data.get("simulated"):
        page.text("Simulated engines (no model: each step sleeps a fixed time), so these are the control "
                  "plane's own figures and say nothing about model speed.")
    heads, panels = [], []
    if data.get("coordinator"):
        rows = data["coordinator"]
        page.text(f"**a. Coordinator**: N simulated engines publishing stats at {rows[0].get('hz', 0):g} Hz; "
                  "publish latency is engine send to the snapshot at an API server's socket.")
        page.table(["engines", "publish P50 ms", "P99 ms", "max ms", "coordinator CPU %", "RSS MiB",
                    "snapshot KiB", "snapshots/s", "undelivered"],
                   [[r["engines"], r["p50_ms"], r["p99_ms"], r["max_ms"], r["coordinator_cpu_pct"],
                     r["coordinator_rss_mib"], r["snapshot_bytes"] / 1024, r["snapshots_per_s"],
                     f"{r['undelivered']}/{r['updates']}"] for r in rows])
        heads.append(f"{rows[-1]['engines']} engines: publish P99 {rows[-1]['p99_ms']:.0f} ms")

        def coordinator(ax):
            for key, name in (("p50_ms", "P50"), ("p99_ms", "P99")):
                ax.plot([r["engines"] for r in rows], [r[key] for r in rows], marker="o", label=name)
            ax.set_xlabel("engines")
            ax.set_ylim(bottom=0)
            ax.set_ylabel("publish latency ms")
            ax.set_title("coordinator", fontsize=9)
            ax.legend(fontsize=7)
        panels.append(coordinator)
    if data.get("api_max_rate"):
        b = data["api_max_rate"]
        page.text(f"**b. One API server's request rate** (DP={b['dp']}, {b['step_ms']:g} ms steps, "
                  f"max_tokens={b['max_tokens']}, closed-loop clients): best clean **{b['max_req_s']:.0f} req/s** at "
                  f"concurrency {b['at_concurrency']} (P50 {b['p50_ms']:.1f} ms, P99 {b['p99_ms']:.1f} ms).")
        page.table(["concurrency", "req/s", "P50 ms", "P99 ms", "failed", "API server CPU %", "req per API CPU-s",
                    "engines CPU %", "client CPU %"],
                   [[r["concurrency"], r["req_s"], r["p50_ms"], r["p99_ms"], r["failed"], r["api_cpu_pct"],
                     r.get("req_per_api_cpu_s", ""), r["engines_cpu_pct"], r["client_cpu_pct"]] for r in b["levels"]])
        heads.append(f"one API server {b['max_req_s']:.0f} req/s")

        def rate(ax):
            levels = [r["concurrency"] for r in b["levels"]]
            ax.plot(levels, [r["req_s"] for r in b["levels"]], marker="o")
            ax.set_xscale("log", base=2)
            ax.set_xticks(levels, [str(level) for level in levels])
            ax.set_ylim(bottom=0)
            ax.set_xlabel("concurrent clients")
            ax.set_ylabel("requests/s")
            ax.set_title("one API server", fontsize=9)
        panels.append(rate)
    if data.get("dp_overhead"):
        d = data["dp_overhead"]
        page.text(f"**c. Dense DP overhead** ({d['step_ms']:g} ms steps, {d['per_engine_concurrency']} requests per "
                  f"engine, {d['input_len']} in / {d['output_len']} out): one API server over N engines at N x the "
                  "load of a DP=1 server; ratio = output tok/s / (N x DP=1), 1.0 is no overhead.")
        page.table(["ranks", "max_num_seqs", "output tok/s", "ideal tok/s", "ratio", "occupancy ratio", "P50 ms",
                    "P99 ms", "balance max/mean", "API CPU %", "engine RSS MiB", "failed"],
                   [[r["ranks"], f"{name} ({r[name]['max_num_seqs']})", r[name]["output_tok_s"], r["ideal_tok_s"],
                     r[name]["ratio"], r[name].get("occupancy_ratio", ""), r[name]["p50_ms"], r[name]["p99_ms"],
                     r[name]["balance_max_over_mean"],
                     r[name]["api_cpu_pct"], r[name]["engine_rss_mib"], r[name]["failed"]]
                    for r in d["rows"] for name in ("capped", "uncapped") if name in r])
        heads.append("DP=N / ideal " + ", ".join(f"N={r['ranks']} {r['uncapped']['ratio']:.2f}" for r in d["rows"]))

        def overhead(ax):
            bars(ax, [f"DP={r['ranks']}" for r in d["rows"]],
                 {name: [r[name]["ratio"] for r in d["rows"]] for name in ("capped", "uncapped")},
                 "throughput / ideal", "DP overhead")
            ax.axhline(1.0, color="grey", linestyle=":")
        panels.append(overhead)
    if panels:
        def draw(*axes):
            for panel, ax in zip(panels, axes, strict=True):
                panel(ax)

        page.figure("control_plane", "control plane at scale", draw, len(panels))
    return "; ".join(heads)


def label(key: str) -> str:
    """``ttft_p99_ms`` → ``TTFT P99 (ms)``."""
    words = key.replace("tok_s", "tok/s").split("_")
    unit = f" ({words.pop()})" if words[-1] in ("ms", "s", "mib") and len(words) > 1 else ""
    words = [w.upper() if w in ("ttft", "e2e", "tpot", "rss") else w.upper() if w[:1] == "p" and w[1:].isdigit()
             else w for w in words]
    return " ".join(words) + unit.replace("mib", "MiB")


def generic(page: Page, data) -> str:
    """Every scalar of an unknown layout, by its path."""
    rows: list[list] = []

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), inner)
        elif isinstance(value, list) and value and all(isinstance(v, dict | list) for v in value):
            for i, inner in enumerate(value):
                walk(f"{prefix}[{i}]", inner)
        elif isinstance(value, list) and len(value) > 12:
            rows.append([prefix, f"{len(value)} values: {cell(value[:6])}, ..."])
        else:
            rows.append([prefix, value])

    walk("", data)
    page.table(["figure", "value"], rows[:300])
    return ""
