"""benchmarks/report.py renders REPORT.md, plots and data copies from benchmark JSON."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PLOTS = importlib.util.find_spec("matplotlib") is not None


def load_result() -> dict:
    return {"meta": {"date": "2026-01-02T03:04:05", "command": "python benchmarks/load_soak.py load --clients 9"},
            "config": {"clients": 9, "input_len": 4, "max_tokens": 2, "max_num_seqs": 8, "data_parallel_size": 2},
            "summary": {"clients": 9, "completed": 9, "failed": 0, "duration_s": 1.5, "output_tok_s": 12.0,
                        "ttft_p50_ms": 10.0, "ttft_p99_ms": 20.0, "e2e_p50_ms": 30.0, "e2e_p99_ms": 40.0},
            "errors": [], "ttft_ms": [10.0, 12.0, 20.0], "e2e_ms": [30.0, 35.0, 40.0]}


def soak_result() -> dict:
    samples = [{"t_s": t, "done": t, "failed": 0, "rss_mib": {"hybridlb:api:0": 60.0, "hybridlb:engine:0": 500.0}}
               for t in (0, 5, 10, 15)]
    processes = {name: {"start_mib": v, "end_mib": v, "slope_mib_per_min": 0.5, "early_slope_mib_per_min": 1.5,
                        "late_slope_mib_per_min": -0.25, "flat": True}
                 for name, v in samples[0]["rss_mib"].items()}
    return {"meta": {"date": "2026-01-02T03:04:05"}, "completed": 15, "failed": 0, "healthy_after": True,
            "verdict": "PASS", "errors": [], "processes": processes, "samples": samples,
            "config": {"duration_s": 15, "warmup_s": 5, "interval_s": 5, "concurrency": 2,
                       "max_slope_mib_per_min": 1.0}}


def render(results: Path, out: Path) -> str:
    run = subprocess.run([sys.executable, "benchmarks/report.py", "--results", str(results), "--out", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return (out / "REPORT.md").read_text()


@pytest.fixture
def results(tmp_path) -> Path:
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "load.json").write_text(json.dumps(load_result()))
    (folder / "soak.json").write_text(json.dumps(soak_result()))
    (folder / "dp_overhead.json").write_text(json.dumps({"overhead": "a layout the renderer does not know"}))
    (folder / "mystery.json").write_text(json.dumps({"latency_ms": {"p50": 1.25}, "runs": [{"engines": 4}]}))
    return folder


def test_report_has_tables_commands_and_plots(results, tmp_path):
    out = tmp_path / "out"
    report = render(results, out)
    assert "## Load: 1,000 concurrent streams" in report
    assert "`python benchmarks/load_soak.py load --clients 9`" in report  # the command the JSON recorded
    assert "| TTFT P99 (ms) | 20.0 |" in report
    assert "Command: `python benchmarks/load_soak.py soak` (run 2026-01-02 03:04" in report  # the default command
    assert "| hybridlb:engine:0 | 500.0 | 500.0 | +0.50 | +1.50 | -0.25 | True |" in report
    assert "**not run yet**: `python benchmarks/engine_throughput.py`" in report
    assert "not run yet: `python benchmarks/control_plane.py`" in report  # in the summary too
    assert "layout did not match" in report and "| overhead | a layout the renderer does not know |" in report
    assert "| latency_ms.p50 | 1.25 |" in report and "| runs[0].engines | 4 |" in report  # unknown: generic
    copies = sorted(p.name for p in (out / "report" / "data").glob("*.json"))
    assert copies == sorted(p.name for p in results.iterdir())
    if PLOTS:
        pngs = {p.name for p in (out / "report").glob("*.png")}
        assert pngs == {"load_latency_cdf.png", "soak_rss.png"}
        assert "![latency CDF of the burst](report/load_latency_cdf.png)" in report
        assert all((out / "report" / name).read_bytes().startswith(b"\x89PNG") for name in pngs)


def test_report_re_renders_from_its_committed_data_copy(results, tmp_path):
    out = tmp_path / "out"
    first = render(results, out)
    (out / "report" / "stale.png").write_bytes(b"old plot")
    for copy in (out / "report" / "data").glob("*.json"):
        os.utime(copy, (0, 0))  # a fresh clone: file times say nothing about when a benchmark ran
    again = render(tmp_path / "no-results-here", out)
    drop_date = [line for line in first.splitlines() if not line.startswith("Rendered ")]
    assert [line for line in again.splitlines() if not line.startswith("Rendered ")] == drop_date
    assert not (out / "report" / "stale.png").exists()


def test_data_from_another_version_of_its_script_is_marked_stale(results, tmp_path):
    sys.path.insert(0, "benchmarks")
    try:
        from common import script_hash
    finally:
        sys.path.remove("benchmarks")
    current = load_result()
    current["meta"] |= {"script": "load_soak.py", "script_sha": script_hash(Path("benchmarks/load_soak.py"))}
    (results / "load.json").write_text(json.dumps(current))
    older = soak_result()
    older["meta"] |= {"script": "load_soak.py", "script_sha": "0" * 12, "commit": "abc1234"}
    (results / "soak.json").write_text(json.dumps(older))
    report = render(results, tmp_path / "out")
    load, soak = report.split("## Load: 1,000 concurrent streams")[1].split("## Soak: memory under steady load")
    assert "Stale" not in load
    assert "**Stale**: these figures were made by an older `load_soak.py` (commit abc1234)" in soak
    assert "2026-01-02 03:04 (**stale**)" in report  # the summary says it too
