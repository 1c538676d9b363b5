"""Load and soak: a thousand streaming clients at once, then long steady load watching memory.

Both modes run ``hybridlb serve --config configs/local.yaml --model <tiny random qwen3>`` (DP=2, one
hybrid API server) on a free port and stop it afterwards.

* ``load``: ``--clients`` (1,000) streaming completions, ``--input-len`` token ids in and
  ``--max-tokens`` out (ignore_eos), all released at the same instant from one asyncio
  httpx client with a connection per request. Goal: zero failures. Reported: failures,
  total time, TTFT and end-to-end P50 / P99, output tok/s, and peak open connections
  (client streams in flight, and the server port's ESTABLISHED sockets in /proc/net/tcp).
* ``soak``: ``--concurrency`` closed-loop clients for ``--duration-s`` (warm-up included)
  rotating streaming and plain completions and streaming chat, every 20th stream cut after
  its first chunk (a client disconnect, which must free the request). Every
  ``--interval-s`` it samples the RSS of each process in the serve tree (VmRSS of
  /proc/<pid>/status, children from /proc/<pid>/task/*/children) and requests done / failed.
  PASS when nothing failed and every process's least-squares RSS slope over the second
  half of the run after ``--warmup-s`` stays under ``--max-slope`` MiB/min; otherwise FLAG.
  A leak grows at a steady rate, so it shows in the late half; a high-water mark (an
  allocator or kernel cache filling up, then full) grows early and flattens. Both halves'
  slopes are reported.

    python benchmarks/load_soak.py load [--quick] [--clients 1000]
    python benchmarks/load_soak.py soak [--quick] [--duration-s 600]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from common import Server, checkpoint, free_port, process_tree, stamp

CONFIG = Path("configs/local.yaml")
VOCAB = 1024  # the tiny checkpoint's vocabulary


def start_node(model: str, *flags: str) -> Server:
    """``hybridlb serve`` on the default config's shape (DP=2) with a free rpc port, so the
    coordinator's sockets sit clear of other servers' defaults."""
    port = free_port()
    command = [sys.executable, "-m", "hybridlb", "serve", "--config", str(CONFIG), "--model", model,
               "--served-model-name", model, "--port", str(port), "--data-parallel-rpc-port", str(free_port()), *flags]
    return Server("load_soak", command, port, model)


def raise_fd_limit(needed: int) -> int:
    """Lift this process's soft open-files limit to ``needed`` (up to the hard limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        soft = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if soft != resource.RLIM_INFINITY and soft < needed:
        print(f"warning: open-files limit {soft} < {needed}; connections may fail client-side", file=sys.stderr)
    return soft


def established(port: int) -> int:
    """Server-side ESTABLISHED TCP sockets on ``port`` (IPv4 loopback)."""
    suffix = f":{port:04X}"
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        count += fields[1].endswith(suffix) and fields[3] == "01"
    return count


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``bench serve``'s), 0 for no values."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0


def meta(args: argparse.Namespace) -> dict:
    return stamp(python=platform.python_version(), quick=args.quick)


# -- load -------------------------------------------------------------------------------------
@dataclass
class Outcome:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    tokens: int = 0
    error: str = ""


class OpenStreams:
    def __init__(self) -> None:
        self.now = self.peak = 0

    def add(self, delta: int) -> None:
        self.now += delta
        self.peak = max(self.peak, self.now)


async def stream_completion(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int,
                            streams: OpenStreams) -> Outcome:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    sent, ttft, tokens = time.perf_counter(), 0.0, 0
    streams.add(1)
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                return Outcome(False, error=f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Outcome(False, error=f"stream error: {chunk['error'].get('message')}")
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if not ttft and any(c.get("text") for c in chunk.get("choices", [])):
                    ttft = time.perf_counter() - sent
    except (httpx.HTTPError, OSError, json.JSONDecodeError) as exc:
        return Outcome(False, error=f"{type(exc).__name__}: {exc}")
    finally:
        streams.add(-1)
    ok = tokens == max_tokens
    return Outcome(ok, ttft, time.perf_counter() - sent, tokens, "" if ok else f"{tokens}/{max_tokens} tokens")


async def burst(url: str, model: str, prompts: list[list[int]], max_tokens: int, port: int) -> dict:
    """Every prompt at once; outcomes, wall time and peak connections."""
    size = len(prompts) + 16
    limits = httpx.Limits(max_connections=size, max_keepalive_connections=size)
    streams, go, server_peak, finished = OpenStreams(), asyncio.Event(), [0], asyncio.Event()

    async def watch() -> None:
        while not finished.is_set():
            server_peak[0] = max(server_peak[0], established(port))
            await asyncio.sleep(0.1)

    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600, connect=120)) as client:
        async def one(prompt: list[int]) -> Outcome:
            await go.wait()
            return await stream_completion(client, url, model, prompt, max_tokens, streams)

        tasks = [asyncio.create_task(one(p)) for p in prompts]
        await asyncio.sleep(0.1)  # every task reaches the barrier
        watcher = asyncio.create_task(watch())
        start = time.perf_counter()
        go.set()
        outcomes = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        finished.set()
        await watcher
    return {"outcomes": outcomes, "duration": duration, "client_peak": streams.peak, "server_peak": server_peak[0]}


def run_load(args: argparse.Namespace, model: str) -> dict:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(args.input_len)] for _ in range(args.clients)]
    node = start_node(model, "--max-num-seqs", str(args.max_num_seqs))  # before the client lifts its own fd limit
    fd_limit = raise_fd_limit(args.clients + 256)
    try:
        node.wait_ready()
        asyncio.run(burst(node.url, model, prompts[:8], args.max_tokens, node.port))  # warm-up
        run = asyncio.run(burst(node.url, model, prompts, args.max_tokens, node.port))
        healthy = httpx.get(f"{node.url}/health", timeout=10).status_code == 200
    finally:
        node.stop()
    outcomes, good = run["outcomes"], [o for o in run["outcomes"] if o.ok]
    ttfts, e2es = [1000 * o.ttft for o in good], [1000 * o.e2e for o in good]
    summary = {
        "clients": args.clients, "completed": len(good), "failed": len(outcomes) - len(good),
        "duration_s": run["duration"], "output_tok_s": sum(o.tokens for o in good) / run["duration"],
        "ttft_p50_ms": percentile(ttfts, 0.5), "ttft_p99_ms": percentile(ttfts, 0.99),
        "e2e_p50_ms": percentile(e2es, 0.5), "e2e_p99_ms": percentile(e2es, 0.99),
        "peak_client_streams": run["client_peak"], "peak_server_connections": run["server_peak"],
        "healthy_after": healthy,
    }
    config = {"clients": args.clients, "input_len": args.input_len, "max_tokens": args.max_tokens,
              "max_num_seqs": args.max_num_seqs, "data_parallel_size": 2, "client_fd_limit": fd_limit}
    print(f"\n{args.clients} streaming clients at once, {args.input_len} in / {args.max_tokens} out, "
          f"DP=2 tiny qwen3, max_num_seqs {args.max_num_seqs} per engine")
    for key, value in summary.items():
        print(f"  {key:<26}{value:>12.1f}" if isinstance(value, float) else f"  {key:<26}{value!s:>12}")
    errors = sorted({o.error for o in outcomes if not o.ok})
    for error in errors[:5]:
        print(f"  error: {error}")
    print(f"  {'PASS' if summary['failed'] == 0 and healthy else 'FAIL'}: goal is zero failures")
    return {"meta": meta(args), "config": config, "summary": summary, "errors": errors[:20],
            "ttft_ms": [round(v, 2) for v in ttfts], "e2e_ms": [round(v, 2) for v in e2es]}


# -- soak -------------------------------------------------------------------------------------
def process_name(pid: int) -> str:
    """The title hybridlb gave the process (``hybridlb:engine:0``), else a short command."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    if argv[0].startswith("hybridlb:"):
        return argv[0].strip()
    text = " ".join(argv)
    return "resource_tracker" if "resource_tracker" in text else Path(argv[0]).name or text[:40]


def rss_sample(root: int) -> dict[str, float]:
    """MiB resident per process in the tree, keyed by name (pid appended on clashes)."""
    sample: dict[str, float] = {}
    for pid in process_tree(root):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            kib = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS")))
            name = process_name(pid)
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            continue
        sample[f"{name}#{pid}" if name in sample else name] = kib / 1024
    return sample


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (minutes, MiB) points, 0 with fewer than two."""
    if len(points) < 2:
        return 0.0
    mean_t = statistics.fmean(t for t, _ in points)
    mean_v = statistics.fmean(v for _, v in points)
    var = sum((t - mean_t) ** 2 for t, _ in points)
    return sum((t - mean_t) * (v - mean_v) for t, v in points) / var if var else 0.0


async def soak_request(client: httpx.AsyncClient, url: str, model: str, rng: random.Random, n: int) -> str:
    """One request of the rotation; '' when it succeeded, else why not."""
    kind = "abort" if n % 20 == 19 else ("stream", "complete", "chat")[n % 3]
    max_tokens = rng.randint(8, 64)
    body: dict = {"model": model, "max_tokens": max_tokens, "ignore_eos": True, "temperature": rng.choice([0, 0.8]),
                  "stream": kind != "complete"}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": " ".join(rng.choice("abcdefgh") * 3 for _ in range(40))}]
    else:
        body["prompt"] = [rng.randrange(3, VOCAB) for _ in range(rng.randint(16, 256))]
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    try:
        if kind == "complete":
            response = await client.post(f"{url}{path}", json=body)
            tokens = response.json().get("usage", {}).get("completion_tokens") if response.status_code == 200 else 0
            return "" if tokens == max_tokens else f"HTTP {response.status_code}, {tokens} tokens"
        async with client.stream("POST", f"{url}{path}", json=body) as response:
            if response.status_code != 200:
                return f"HTTP {response.status_code}"
            async for line in response.aiter_lines():
                if kind == "abort" and line.startswith("data: "):
                    return ""  # leaving the block closes the connection mid-stream
                if line == "data: [DONE]":
                    return ""
                if line.startswith("data: ") and '"error"' in line:
                    return f"stream error: {line[:200]}"
        return "stream ended without [DONE]"
    except (httpx.HTTPError, OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"


async def soak_loop(args: argparse.Namespace, node: Server, model: str) -> dict:
    counts = {"done": 0, "failed": 0}
    errors: set[str] = set()
    samples: list[dict] = []
    start = time.monotonic()
    deadline = start + args.duration_s
    limits = httpx.Limits(max_connections=args.concurrency + 8)

    async def worker(index: int, client: httpx.AsyncClient) -> None:
        rng, n = random.Random(index), index
        while time.monotonic() < deadline:
            error = await soak_request(client, node.url, model, rng, n)
            counts["failed" if error else "done"] += 1
            if error:
                errors.add(error)
            n += 1

    async def sampler() -> None:
        while True:
            samples.append({"t_s": round(time.monotonic() - start, 2), "rss_mib": rss_sample(node.process.pid),
                            **counts})
            if time.monotonic() >= deadline:
                return
            await asyncio.sleep(min(args.interval_s, max(0.0, deadline - time.monotonic())))

    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(300, connect=30)) as client:
        await asyncio.gather(sampler(), *(worker(i, client) for i in range(args.concurrency)))
    return {"counts": counts, "errors": sorted(errors)[:20], "samples": samples}


def run_soak(args: argparse.Namespace, model: str) -> dict:
    node = start_node(model)
    try:
        node.wait_ready()
        run = asyncio.run(soak_loop(args, node, model))
        healthy = httpx.get(f"{node.url}/health", timeout=10).status_code == 200
    finally:
        node.stop()
    samples = run["samples"]
    steady = [s for s in samples if s["t_s"] >= args.warmup_s] or samples[-1:]
    processes = {}
    middle = (steady[0]["t_s"] + steady[-1]["t_s"]) / 2
    for name in samples[-1]["rss_mib"]:
        points = [(s["t_s"] / 60, s["rss_mib"][name]) for s in steady if name in s["rss_mib"]]
        early = slope([p for p in points if p[0] * 60 <= middle])
        late = slope([p for p in points if p[0] * 60 >= middle])
        processes[name] = {"start_mib": points[0][1], "end_mib": points[-1][1], "slope_mib_per_min": slope(points),
                           "early_slope_mib_per_min": early, "late_slope_mib_per_min": late,
                           "flat": late < args.max_slope}
    failed = run["counts"]["failed"]
    verdict = "PASS" if failed == 0 and healthy and all(p["flat"] for p in processes.values()) else "FLAG"
    print(f"\nsoak: {args.duration_s:.0f} s at concurrency {args.concurrency} (warm-up {args.warmup_s:.0f} s), "
          f"{run['counts']['done']} requests done, {failed} failed, healthy after: {healthy}")
    print(f"  {'process':<24}{'start MiB':>11}{'end MiB':>10}{'MiB/min':>10}{'early':>8}{'late':>8}")
    for name, p in processes.items():
        print(f"  {name:<24}{p['start_mib']:>11.1f}{p['end_mib']:>10.1f}{p['slope_mib_per_min']:>10.2f}"
              f"{p['early_slope_mib_per_min']:>8.2f}{p['late_slope_mib_per_min']:>8.2f}"
              f"{'' if p['flat'] else '  <- growing'}")
    for error in run["errors"][:5]:
        print(f"  error: {error}")
    note = " (a --quick run is too short to judge memory)" if args.quick else ""
    print(f"  {verdict}: no failures and every late-half slope < {args.max_slope} MiB/min{note}")
    config = {"duration_s": args.duration_s, "warmup_s": args.warmup_s, "interval_s": args.interval_s,
              "concurrency": args.concurrency, "max_slope_mib_per_min": args.max_slope, "data_parallel_size": 2}
    return {"meta": meta(args), "config": config, "completed": run["counts"]["done"], "failed": failed,
            "healthy_after": healthy, "verdict": verdict, "processes": processes, "errors": run["errors"],
            "samples": samples}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["load", "soak"])
    parser.add_argument("--quick", action="store_true", help="small and short: checks the script works")
    parser.add_argument("--models-dir", type=Path, default=Path("models"))
    parser.add_argument("--out", type=Path, help="default benchmarks/results/<mode>.json")
    load = parser.add_argument_group("load")
    load.add_argument("--clients", type=int, default=1000)
    load.add_argument("--input-len", type=int, default=32)
    load.add_argument("--max-tokens", type=int, default=32)
    load.add_argument("--max-num-seqs", type=int, default=256, help="per engine; the rest queue")
    soak = parser.add_argument_group("soak")
    soak.add_argument("--duration-s", type=float, default=600)
    soak.add_argument("--warmup-s", type=float, default=60)
    soak.add_argument("--interval-s", type=float, default=5)
    soak.add_argument("--concurrency", type=int, default=16)
    soak.add_argument("--max-slope", type=float, default=1.0, help="MiB/min of RSS growth that flags a process")
    args = parser.parse_args()
    if args.quick:
        args.clients, args.max_tokens = min(args.clients, 50), min(args.max_tokens, 8)
        args.duration_s, args.warmup_s, args.interval_s = 30, 5, 2
    model = checkpoint(args.models_dir, "qwen3", "tiny")
    result = run_load(args, model) if args.mode == "load" else run_soak(args, model)
    out = args.out or Path(f"benchmarks/results/{args.mode}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    failed = result["summary"]["failed"] if args.mode == "load" else result["failed"]
    if failed or (result.get("verdict", "PASS") != "PASS" and not args.quick):
        raise SystemExit(1)  # `just bench-load` / `bench-soak` fail with the goal


if __name__ == "__main__":
    main()
