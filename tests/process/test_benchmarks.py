"""Every benchmark script still imports and parses its arguments (they do not run in CI)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# modules the scripts import, not scripts: the harness and the report's section renderers (report.py runs them)
HELPERS = {"common.py"} | {p.name for p in Path("benchmarks").glob("report_*.py")}
SCRIPTS = sorted(p for p in Path("benchmarks").glob("*.py") if p.name not in HELPERS)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_benchmark_script_loads(script):
    run = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "usage:" in run.stdout


@pytest.mark.slow
def test_api_overhead_runs_end_to_end(tmp_path):
    out = tmp_path / "api.json"
    run = subprocess.run([sys.executable, "benchmarks/api_overhead.py", "--quick", "--models-dir", str(tmp_path),
                          "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "HTTP / direct per round" in run.stdout
    overhead = json.loads(out.read_text())["overhead"]
    ratios = overhead["ratios"]
    assert len(ratios) == 3 and min(ratios) <= overhead["ratio_median"] <= max(ratios)
