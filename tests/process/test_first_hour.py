"""What a newcomer meets first on the command line: help that reads at 80 columns, a
`--dry-run` that shows what will run, a short name for the bundled model, and `status`
that says in one line why it finds no cluster."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from hybridlb.testing.ports import free_port

COMMANDS = [[], ["serve"], ["plan"], ["up"], ["status"], ["down"], ["generate"], ["make-model"], ["render", "k8s"],
            ["bench", "serve"]]


def _hybridlb(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridlb", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "hybridlb")
def test_help_reads_whole_at_80_columns(command):
    run = _hybridlb(*command, "--help", env={"COLUMNS": "80"})
    assert run.returncode == 0, run.stderr
    assert all(len(line) <= 80 for line in run.stdout.splitlines()), run.stdout
    described = [line for line in run.stdout.splitlines() if not line.startswith("Usage:")]
    assert not any("…" in line or line.rstrip().endswith("...") for line in described), run.stdout  # none cut


def test_serve_help_names_every_data_parallel_flag_whole():
    text = _hybridlb("serve", "--help", env={"COLUMNS": "80"}).stdout
    for flag in ("--data-parallel-size-local", "--data-parallel-start-rank", "--data-parallel-rpc-port",
                 "--max-concurrent-requests", "--async-dp-coordination", "--enable-expert-parallel"):
        assert flag in text
    assert "[vLLM]" in text  # the flags vLLM also has are marked


def test_dry_run_prints_what_the_engines_will_use(tiny_qwen3):
    run = _hybridlb("serve", "--model", tiny_qwen3, "--dry-run")
    assert run.returncode == 0, run.stderr
    assert "None" not in run.stdout
    assert re.search(r"dtype (float32|bfloat16) \(auto\)", run.stdout), run.stdout
    assert re.search(r"max_model_len \d+ \(the model's\)", run.stdout), run.stdout


def test_the_bundled_model_has_a_short_name_and_is_served_by_its_own_name():
    run = _hybridlb("serve", "smollm2-135m-instruct", "--data-parallel-size", "2", "--dry-run")
    assert run.returncode == 0, run.stderr
    assert "model ['SmolLM2-135M-Instruct', 'smollm2-135m-instruct']" in run.stdout
    assert "max_model_len 8192 (the model's)" in run.stdout and "ranks [0, 1]" in run.stdout
    assert "weights kept quantized, gguf (the default for a .gguf file)" in run.stdout
    wrong = _hybridlb("serve", "smollm2-135m", "--dry-run")
    assert wrong.returncode == 2 and "does not exist" in wrong.stderr and "Traceback" not in wrong.stderr


def _one_line_error(run: subprocess.CompletedProcess) -> str:
    assert run.returncode != 0
    assert "Traceback" not in run.stdout + run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    return lines[0]


def _no_ray_env(tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return {**env, "RAY_TMPDIR": str(tmp_path)}


def test_status_without_any_cluster_says_so(tmp_path):
    run = subprocess.run([sys.executable, "-m", "hybridlb", "status", "mine"], capture_output=True, text=True,
                         timeout=60, env=_no_ray_env(tmp_path))
    line = _one_line_error(run)
    assert "no Ray cluster is running on this machine" in line and "status --url" in line


def test_status_and_down_ignore_a_stale_address_file(tmp_path):
    """What a crashed Ray cluster leaves: an address nobody answers at."""
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{free_port()}")
    for command in ("status", "down"):
        run = subprocess.run([sys.executable, "-m", "hybridlb", command, "mine"], capture_output=True, text=True,
                             timeout=60, env=_no_ray_env(tmp_path))
        line = _one_line_error(run)
        assert "no Ray cluster answers at 127.0.0.1:" in line and "stale address file" in line
