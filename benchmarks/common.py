"""Helpers the benchmark scripts share: running servers (hybridlb or vLLM) and driving them."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import hybridlb.testing.servers as harness
from hybridlb.bench.client import BenchArgs, make_prompts, run_benchmark, summarize
from hybridlb.testing.models import SMOLLM2, checkpoint, smollm2_hf_dir  # noqa: F401 - the scripts' imports
from hybridlb.testing.ports import free_port
from hybridlb.testing.procs import process_tree, tree_rss_mib, wait_quiet  # noqa: F401 - the scripts' imports

VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
            "VLLM_HOST_IP": "127.0.0.1"}


def script_hash(script: Path) -> str:
    """The version of a benchmark: its own source and the helpers every script shares."""
    import hashlib

    digest = hashlib.sha256()
    for path in (script, Path(__file__)):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        import platform

        return platform.processor() or platform.machine()


def stamp(**extra) -> dict:
    """What a result JSON records about how it was made: commit, script version, date,
    command, machine. ``report.py`` marks a section stale when its script changed since."""
    import platform
    from datetime import UTC, datetime
    from importlib import metadata

    def git(*args: str) -> str:
        run = subprocess.run(["git", *args], capture_output=True, text=True)
        return run.stdout.strip() if run.returncode == 0 else ""

    script = Path(sys.argv[0]).resolve()
    return {"commit": git("rev-parse", "--short", "HEAD"), "dirty": bool(git("status", "--porcelain", "-uno")),
            "script": script.name, "script_sha": script_hash(script),
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "command": " ".join(["python", *sys.argv]), "cpu_count": os.cpu_count(), "cpu": cpu_name(),
            "machine": platform.machine(), "torch": metadata.version("torch"), **extra}


def previous_results(out: Path) -> dict:
    """The JSON an earlier run left at ``out`` (a benchmark re-run for some models keeps the
    others' rows, each with the stamp of the run that made it), or {}."""
    import json

    try:
        return json.loads(out.read_text())
    except (FileNotFoundError, ValueError):
        return {}


def vllm_executable() -> str:
    """Install (once) and locate vLLM in its own venv."""
    out = subprocess.run(["bash", "benchmarks/vllm_env.sh"], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


# A benchmark's hybridlb server: room for its longest workloads, the config's own dtype.
BENCH_DEFAULTS = {"--max-model-len": "1024", "--kv-cache-gib": "1"}


class Server(harness.Server):
    """A server this script started (the harness's, logging to /tmp/bench_NAME_PORT.log)."""

    @classmethod
    def hybridlb(cls, name: str, model: str, *flags: str, port: int | None = None) -> Server:
        port = port or free_port()
        return cls(model, *flags, port=port, log=Path(f"/tmp/bench_{name}_{port}.log"), defaults=BENCH_DEFAULTS,
                   name=name)

    @classmethod
    def vllm(cls, name: str, vllm: str, model: str, *flags: str, env: dict | None = None) -> Server:
        return super().vllm(name, vllm, model, *flags, env={**VLLM_ENV, **(env or {})})

    def wait_ready(self, timeout_s: float = 600) -> float:
        return super().wait_ready(timeout_s)

    def stop(self, timeout_s: float = 30) -> int:
        return super().stop(timeout_s)


def drive(urls: list[str], model: str, vocab: int, input_len: int, output_len: int, num_prompts: int,
          concurrency: int, seed: int = 1, prompts: list | None = None, max_tokens: list[int] | None = None,
          models: list[str] | None = None) -> dict:
    """Run one workload over ``urls`` (prompts spread evenly) and summarize it like bench serve;
    ``models``: each request's model name (LoRA adapters), default ``model``."""
    args = BenchArgs(base_url=urls[0], model=model, random_input_len=input_len, random_output_len=output_len,
                     num_prompts=num_prompts, max_concurrency=concurrency, ignore_eos=True, progress=False,
                     seed=seed)
    prompts = prompts or make_prompts(args, vocab)
    results, duration = asyncio.run(run_benchmark(args, prompts, urls=urls, max_tokens=max_tokens, models=models))
    return summarize(args, results, duration)
