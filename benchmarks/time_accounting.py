"""Where a served token's time goes: one served run at one shape, accounted for.

``hybridlb serve`` with one engine, a workload of random token-id prompts (``--ignore-eos``) at a
fixed concurrency, driven from this process; then the same workload through the same engine
options in-process (``hybridlb.LLM``, in a process of its own), each alone on the machine,
alternating which goes first, ``--rounds`` times, then one more served run with samplers
attached (py-spy and the per-thread core sampler; they take CPU from what they measure, so that
run's speed is not in the ratios). For each served run it accounts for:

* **the engine's loop**, from its /metrics counters before and after (``hybridlb:engine_step_*``
  by kind, ``engine_loop_seconds`` by phase; docs/usage.md): steps by kind (decode, mixed =
  prefill chunks joined to decode steps, prefill) with their count, seconds and mean, the rest
  of the step phase (scheduling, sampling's bookkeeping), taking requests in, publishing outputs
  and idle; the loop's own clock against the client's wall time (idle outside the run is
  left out and said);
* **the CPU**, from /proc: each process of the tree and the client (this process, less the
  sampler's own thread), seconds and per output token, context switches (voluntary: it waited;
  involuntary: it was preempted), and (profiled run) which cores each thread ran on (sampled
  every 100 ms, weighted by the CPU it used); with the machine's idle CPU (/proc/stat) they add
  up to cores x wall, which checks the accounting from outside;
* **the API server's CPU by what it did** (profiled run), from py-spy (non-blocking samples of
  its threads' stacks at 25 Hz; skipped without py-spy: ``pip install -e '.[bench]'``):
  tokenizing, routing, detokenizing, SSE and HTTP, engine I/O, the event loop's own, other;
* the served output tok/s against the in-process engine's, and the served TPOT against the
  engine's mean decode step.

    python benchmarks/time_accounting.py [--model smollm2|small|PATH] [--dtype float32] [--quantization none]
        [--input-len 32] [--output-len 64] [--concurrency 64] [--num-prompts 320] [--rounds 3] [--out JSON]

``small`` is the random 8-layer qwen3 checkpoint (``hybridlb make-model qwen3 small``): decode steps
a quarter of SmolLM2's, where the front end's share of each step is larger.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx
from common import SMOLLM2, Server, checkpoint, drive, stamp
from prometheus_client.parser import text_string_to_metric_families

from hybridlb.bench.client import BenchArgs, make_prompts

OUT = Path(__file__).parent / "results" / "time_accounting.json"
TICK = os.sysconf("SC_CLK_TCK")
SPY_HZ = 25  # py-spy at 100 Hz took ~20 % of a core, and the engine's steps slowed by as much
HEARTBEAT_WAIT_S = 1.5  # the engines' stats ride a heartbeat every second: wait one out before a scrape


# -- the engine's counters ---------------------------------------------------------
def engine_counters(url: str) -> dict:
    """Engine 0's step and loop totals from /metrics."""
    wanted = {"hybridlb:engine_step_seconds": "kind", "hybridlb:engine_steps": "kind",
              "hybridlb:engine_step_tokens": "kind", "hybridlb:engine_loop_seconds": "phase",
              "hybridlb:engine_uptime_seconds": None}
    out: dict = defaultdict(dict)
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        if family.name in wanted:
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.labels.get("engine") == "0":
                    out[family.name.split(":")[1]][sample.labels.get(wanted[family.name]) or "all"] = sample.value
    return out


def engine_account(before: dict, after: dict, wall_s: float) -> dict:
    def delta(name: str) -> dict:
        return {k: after[name].get(k, 0) - before[name].get(k, 0) for k in after[name]}

    seconds, steps, tokens = delta("engine_step_seconds"), delta("engine_steps"), delta("engine_step_tokens")
    phases, window = delta("engine_loop_seconds"), delta("engine_uptime_seconds")["all"]
    outside = max(0.0, window - wall_s)  # idle before the first request and after the last
    rows = {f"{kind} steps": {"s": seconds[kind], "count": int(steps[kind]), "tokens": int(tokens[kind]),
                              "mean_ms": 1000 * seconds[kind] / steps[kind]}
            for kind in ("decode", "mixed", "prefill", "unclassified") if steps.get(kind)}
    rows["scheduling and the step's other work"] = {"s": phases["step"] - sum(seconds.values())}
    rows["taking requests in"] = {"s": phases["take"]}
    rows["publishing outputs"] = {"s": phases["publish"]}
    rows["idle (waiting for work)"] = {"s": phases["idle"] - outside}
    return {"rows": rows, "loop_window_s": window, "idle_outside_run_s": outside,
            "accounted_s": sum(row["s"] for row in rows.values())}


# -- the OS's view -------------------------------------------------------------------
def _stat_fields(path: str) -> tuple[str, list[str]]:
    text = Path(path).read_text()
    return text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()


def threads_of(pid: int) -> dict[int, tuple[str, int, int]]:
    """tid: (name, CPU ticks, the core it last ran on)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name, fields = _stat_fields(f"/proc/{pid}/task/{tid}/stat")
        except (OSError, ValueError):
            continue
        out[int(tid)] = (name, int(fields[11]) + int(fields[12]), int(fields[36]))
    return out


def switches(pid: int) -> tuple[int, int]:
    voluntary = involuntary = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches"):
                    voluntary += int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches"):
                    involuntary += int(line.split()[1])
        except OSError:
            continue
    return voluntary, involuntary


def machine_idle_s() -> float:
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    return (int(fields[3]) + int(fields[4])) / TICK  # idle + iowait


class Sampler(threading.Thread):
    """Every 100 ms: which core each thread of ``pids`` ran on, weighted by the CPU it used since
    (reading /proc every 20 ms took ~10 % of a core from the run it measured)."""

    def __init__(self, pids: dict[str, int]):
        super().__init__(daemon=True)
        self.pids, self.stopped = pids, threading.Event()
        self.cores: dict[str, Counter] = defaultdict(Counter)  # "role/thread": core -> ticks
        self.own_cpu_s = 0.0

    def run(self) -> None:
        last: dict[tuple[int, int], int] = {}
        while not self.stopped.wait(0.1):
            for role, pid in self.pids.items():
                try:
                    threads = threads_of(pid)
                except OSError:
                    continue
                for tid, (name, ticks, core) in threads.items():
                    if (used := ticks - last.get((pid, tid), ticks)) > 0:
                        self.cores[f"{role}/{_thread_group(name)}"][core] += used
                    last[pid, tid] = ticks
        self.own_cpu_s = time.thread_time()


def _thread_group(name: str) -> str:
    return "".join(c for c in name if not c.isdigit()).rstrip("-_:") or name


def cpu_snapshot(pids: dict[str, int]) -> dict:
    snap = {}
    for role, pid in pids.items():
        threads = threads_of(pid)
        snap[role] = {"cpu_s": sum(t[1] for t in threads.values()) / TICK, "switches": switches(pid)}
    return snap


# -- the API server's CPU by what it did -------------------------------------------------
# First match wins, from the innermost frame out: (category, substrings of a frame).
CATEGORIES = [
    ("detokenize", ("detok",)),
    ("tokenize", ("tokeniz", "chat_template", "apply_chat")),
    ("route", ("dispatch/balance", "dispatch/pool", "prefix_index", "route")),
    ("engine I/O", ("zmq", "msgspec", "engine_client", "dispatch/engine", "dispatch/runner")),
    ("SSE and HTTP", ("openai/responses", "starlette", "uvicorn", "fastapi", "h11", "httptools", "json")),
    ("event loop", ("asyncio/",)),
]


def classify(stack: str) -> str:
    frames = stack.split(";")
    for frame in reversed(frames[1:]):  # the first is the thread
        for category, marks in CATEGORIES:
            if any(mark in frame for mark in marks):
                return category
    return "other"


def py_spy_profile(path: Path) -> dict[str, int]:
    counts: Counter = Counter()
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if stack:
            counts[classify(stack)] += int(n)
    return dict(counts)


# -- one served run, one in-process run ------------------------------------------------------
def served(args, prompts: list, profiled: bool) -> dict:
    server = Server.hybridlb("accounting", args.model, "--dtype", args.dtype, "--quantization", args.quantization)
    server.wait_ready()
    try:
        kids = server.children()
        pids = {"launcher": server.process.pid, "api server": kids["hybridlb:api:0"],
                "engine": kids["hybridlb:engine:0"], **{n.split(":")[1]: p for n, p in kids.items()
                                                        if n.startswith("hybridlb:") and ":api:" not in n
                                                        and ":engine:" not in n}}
        drive([server.url], server.model, 0, args.input_len, args.output_len, args.concurrency, args.concurrency,
              prompts=prompts[: args.concurrency])  # warm-up: every shape the run has
        time.sleep(HEARTBEAT_WAIT_S)
        spy = None
        py_spy = shutil.which("py-spy", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
        if profiled and py_spy:
            spy_out = Path(f"/tmp/time_accounting_{server.port}.txt")
            spy = subprocess.Popen([py_spy, "record", "--pid", str(pids["api server"]), "--rate", str(SPY_HZ),
                                    "--format", "raw", "--nonblocking", "--threads", "--output", str(spy_out)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            pids["py-spy (measuring)"] = spy.pid
            time.sleep(1.0)  # attached
        before, cpu_before = engine_counters(server.url), cpu_snapshot(pids)
        client_before, switches_before, idle_before = time.process_time(), switches(os.getpid()), machine_idle_s()
        sampler = Sampler({**pids, "client": os.getpid()})
        if profiled:
            sampler.start()
        started = time.monotonic()
        result = drive([server.url], server.model, 0, args.input_len, args.output_len, args.num_prompts,
                       args.concurrency, prompts=prompts)
        wall = time.monotonic() - started
        cpu_after, idle_after = cpu_snapshot(pids), machine_idle_s()
        if profiled:
            sampler.stopped.set()
            sampler.join()
        client = {"cpu_s": time.process_time() - client_before - sampler.own_cpu_s,
                  "switches": tuple(a - b for a, b in zip(switches(os.getpid()), switches_before, strict=True))}
        profile = {}
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes its samples on Ctrl-C
            spy.wait(60)
            profile = py_spy_profile(spy_out) if spy_out.exists() else {"py-spy wrote nothing": 0}
        time.sleep(HEARTBEAT_WAIT_S)
        after = engine_counters(server.url)
    finally:
        server.stop()
    output_tokens = result["total_output_tokens"]
    processes = {role: {"cpu_s": cpu_after[role]["cpu_s"] - cpu_before[role]["cpu_s"],
                        "voluntary": cpu_after[role]["switches"][0] - cpu_before[role]["switches"][0],
                        "involuntary": cpu_after[role]["switches"][1] - cpu_before[role]["switches"][1]}
                 for role in pids}
    processes["client"] = {"cpu_s": client["cpu_s"], "voluntary": client["switches"][0],
                           "involuntary": client["switches"][1]}
    for row in processes.values():
        row["ms_per_output_token"] = 1000 * row["cpu_s"] / output_tokens
    machine_idle = idle_after - idle_before
    return {"wall_s": wall, "output_tok_s": result["output_throughput"], "mean_tpot_ms": result["mean_tpot_ms"],
            "mean_ttft_ms": result["mean_ttft_ms"], "output_tokens": output_tokens, "failed": result["failed"],
            "engine": engine_account(before, after, wall), "processes": processes,
            "machine": {"cores": os.cpu_count(), "idle_cpu_s": machine_idle,
                        "accounted_cpu_s": sum(r["cpu_s"] for r in processes.values()) + machine_idle},
            "cores_by_thread": {name: dict(sorted(c.items())) for name, c in sorted(sampler.cores.items())},
            "api_server_profile": profile}


def in_process(options: dict, prompts: list, output_len: int, concurrency: int, queue) -> None:
    """The same workload straight into an engine (LLM.generate), after a warm-up; in a process of its own."""
    from hybridlb import LLM, SamplingParams

    llm = LLM(options.pop("model"), max_num_seqs=concurrency, **options)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    llm.generate(prompts[:concurrency], params)
    before = {k: dict(v) for k, v in llm.engine.clock.by_kind().items()}
    started = time.monotonic()
    outputs = llm.generate(prompts, params)
    wall = time.monotonic() - started
    after = llm.engine.clock.by_kind()
    steps = {kind: {"s": after["step_s"][kind] - before["step_s"].get(kind, 0),
                    "count": after["step_counts"][kind] - before["step_counts"].get(kind, 0)}
             for kind in after["step_s"]}
    tokens = sum(len(o.token_ids) for o in outputs)
    queue.put({"wall_s": wall, "output_tok_s": tokens / wall, "steps": steps})


def run_in_process(args, prompts: list) -> dict:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    options = {"model": args.model, "dtype": args.dtype, "quantization": args.quantization, "max_model_len": 1024,
               "kv_cache_gib": 1.0}
    child = context.Process(target=in_process, args=(options, prompts, args.output_len, args.concurrency, queue))
    child.start()
    result = queue.get(timeout=1800)
    child.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=320)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    args.model = {"smollm2": SMOLLM2, "small": None}.get(args.model, args.model) or checkpoint(
        Path("/tmp/hybridlb-bench-models"), "qwen3", "small", seed=1)
    from hybridlb.checkpoint.tokenizer import Tokenizer

    vocab = Tokenizer(args.model).vocab_size
    prompts = make_prompts(BenchArgs(random_input_len=args.input_len, num_prompts=args.num_prompts, seed=1), vocab)
    rounds = []
    for i in range(args.rounds):
        order = ("served", "in_process") if i % 2 == 0 else ("in_process", "served")
        result = {}
        for which in order:
            result[which] = served(args, prompts, False) if which == "served" else run_in_process(args, prompts)
            print(f"round {i + 1} {which}: {result[which]['output_tok_s']:.1f} output tok/s", flush=True)
        result["served_over_in_process"] = result["served"]["output_tok_s"] / result["in_process"]["output_tok_s"]
        rounds.append(result)
    profiled = served(args, prompts, True)  # apart: its samplers take CPU from what they measure
    print(f"profiled served run: {profiled['output_tok_s']:.1f} output tok/s", flush=True)
    ratios = [r["served_over_in_process"] for r in rounds]
    data = {"meta": stamp(model=Path(args.model).name, dtype=args.dtype, quantization=args.quantization,
                          shape=f"{args.input_len}/{args.output_len} c{args.concurrency}",
                          num_prompts=args.num_prompts),
            "served_over_in_process_median": statistics.median(ratios), "rounds": rounds, "profiled": profiled}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1))
    print(json.dumps({"served_over_in_process": ratios, "engine": rounds[-1]["served"]["engine"],
                      "processes": rounds[-1]["served"]["processes"], "machine": rounds[-1]["served"]["machine"],
                      "profiled": {k: profiled[k] for k in ("cores_by_thread", "api_server_profile", "processes")}},
                     indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
