"""One `lm_eval --model local-completions` run over the repository's local tasks (tests/real/evals), as its
users run it against a served model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TASKS = ("hybridlb_smoke_mc", "hybridlb_smoke_gen")


def run_lm_eval(url: str, tokenizer_dir: str, out: Path, log_samples: bool = False) -> dict:
    """lm_eval's per-task results (its results_*.json "results"); with ``log_samples`` its samples land
    under ``out`` too."""
    model_args = (f"model=smollm2,base_url={url}/v1/completions,tokenizer={tokenizer_dir},"
                  "tokenizer_backend=huggingface,num_concurrent=4,max_retries=1")
    command = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
               "--include_path", "tests/real/evals", "--tasks", ",".join(TASKS), "--output_path", str(out),
               "--batch_size", "1", *(["--log_samples"] if log_samples else [])]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    return json.loads(next(out.rglob("results_*.json")).read_text())["results"]
