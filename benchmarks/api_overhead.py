"""What the API server costs: the same workload through HTTP vs straight to the engine.

One engine process and one API server process over it. The same random workload
(token-id prompts, ``--ignore-eos``) runs (a) through HTTP streaming completions and (b)
directly over the engine's ZMQ socket, alternating, ``--rounds`` times (3); each round's
ratio of output throughputs is the API server's overhead, reported as the median and
the spread. A second phase floods the API server with
short requests on the tiny model to find the most streamed chunks per second one API
server process sustains, with its CPU use.

    python benchmarks/api_overhead.py [--size small] [--concurrency 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import zmq
import zmq.asyncio
from common import checkpoint, free_port, stamp

from hybridlb.api.http_server import run_api_server
from hybridlb.api.spec import ApiServerSpec
from hybridlb.bench.client import BenchArgs, run_benchmark, summarize
from hybridlb.config import ApiConfig, Config, EngineConfig
from hybridlb.engine.spawn import start_engine, stop_engines, wait_until_ready
from hybridlb.params import SamplingParams
from hybridlb.protocol import AddRequest, EngineOutputs, Hello, encoder, from_engine_decoder


async def direct(address: str, prompts: list[list[int]], output_len: int, concurrency: int) -> float:
    """Output tokens/s sending the prompts straight to the engine's socket."""
    context = zmq.asyncio.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"bench-{os.getpid()}-{random.random()}".encode())
    sock.connect(address)
    await sock.send(encoder.encode(Hello("bench")))
    await sock.recv()
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    pending = list(enumerate(prompts))[::-1]
    live, tokens = 0, 0
    start = time.perf_counter()
    while pending or live:
        while pending and live < concurrency:
            index, ids = pending.pop()
            await sock.send(encoder.encode(AddRequest(f"d{index}-{start}", ids, params)))
            live += 1
        message = from_engine_decoder.decode(await sock.recv())
        if isinstance(message, EngineOutputs):
            for output in message.outputs:
                tokens += len(output.new_token_ids)
                live -= output.finish_reason is not None
    elapsed = time.perf_counter() - start
    sock.close(linger=0)
    context.term()
    return tokens / elapsed


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_node(model: str, port: int, threads: int):
    runtime = tempfile.mkdtemp(prefix="hybridlb-bench-")
    config = Config(engine=EngineConfig(model=model, max_model_len=1024, kv_cache_gib=1.0),
                    api=ApiConfig(port=port, served_model_name="bench"))
    engine = start_engine(config.engine, 0, f"ipc://{runtime}/engine-0", torch_threads=threads)
    wait_until_ready([engine])
    spawn = multiprocessing.get_context("spawn")
    ready = spawn.Event()
    spec = ApiServerSpec(((0, engine.address),))
    api = spawn.Process(target=run_api_server, args=(config, spec, "127.0.0.1", port, False, ready))
    api.start()
    if not ready.wait(120):
        raise RuntimeError("the API server did not come up")
    return engine, api, f"http://127.0.0.1:{port}"


def overhead_phase(model: str, args) -> dict:
    engine, api, url = start_node(model, free_port(), args.engine_threads)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    bench = BenchArgs(base_url=url, model="bench", random_input_len=args.input_len,
                      random_output_len=args.output_len, num_prompts=args.num_prompts,
                      max_concurrency=args.concurrency, ignore_eos=True, progress=False)
    rows = {"http": [], "direct": []}
    try:
        for _ in range(args.rounds):
            rows["direct"].append(asyncio.run(direct(engine.address, prompts, args.output_len, args.concurrency)))
            results, duration = asyncio.run(run_benchmark(bench, prompts))
            summary = summarize(bench, results, duration)
            assert summary["failed"] == 0, summary["errors"]
            rows["http"].append(summary["output_throughput"])
    finally:
        api.terminate()
        api.join()
        stop_engines([engine])
    ratios = [http / raw for http, raw in zip(rows["http"], rows["direct"], strict=True)]
    return {"http_tok_s": rows["http"], "direct_tok_s": rows["direct"], "ratios": ratios,
            "ratio_median": statistics.median(ratios)}


def chunk_rate_phase(model: str, concurrency: int, num_prompts: int, threads: int) -> dict:
    engine, api, url = start_node(model, free_port(), threads)
    bench = BenchArgs(base_url=url, model="bench", random_input_len=8, random_output_len=64,
                      num_prompts=num_prompts, max_concurrency=concurrency, ignore_eos=True, progress=False)
    prompts = [[5 + i % 50] * 8 for i in range(num_prompts)]
    try:
        before = cpu_seconds(api.pid)
        results, duration = asyncio.run(run_benchmark(bench, prompts))
        api_cpu = (cpu_seconds(api.pid) - before) / duration
    finally:
        api.terminate()
        api.join()
        stop_engines([engine])
    chunks = sum(len(r.chunk_times) for r in results)
    return {"chunks_per_s": chunks / duration, "api_server_cpu": api_cpu, "concurrency": concurrency}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    parser.add_argument("--models-dir", type=Path, default=Path("models"))
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--engine-threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads of the engine (default: every core, as serve gives one engine)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating HTTP / direct rounds")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/api_overhead.json"))
    parser.add_argument("--quick", action="store_true", help="tiny model, few requests: checks the script works")
    args = parser.parse_args()
    chunk_prompts, chunk_concurrency = 512, 256
    if args.quick:
        args.size, args.num_prompts, args.concurrency, args.output_len = "tiny", 16, 4, 8
        chunk_prompts, chunk_concurrency = 32, 8
    models = {size: checkpoint(args.models_dir, "qwen3", size) for size in {args.size, "tiny"}}
    overhead = overhead_phase(models[args.size], args)
    chunks = chunk_rate_phase(models["tiny"], concurrency=chunk_concurrency, num_prompts=chunk_prompts,
                              threads=args.engine_threads)
    print(f"\n{'path':<28}{f'output tok/s ({args.rounds} rounds)':>28}")
    print(f"{'HTTP + API server':<28}{', '.join(f'{v:.0f}' for v in overhead['http_tok_s']):>28}")
    print(f"{'direct to engine (ZMQ)':<28}{', '.join(f'{v:.0f}' for v in overhead['direct_tok_s']):>28}")
    print(f"HTTP / direct per round at concurrency {args.concurrency}, {args.size}: "
          f"{', '.join(f'{r:.3f}' for r in overhead['ratios'])}; median {overhead['ratio_median']:.3f}")
    print(f"one API server process: {chunks['chunks_per_s']:.0f} streamed chunks/s at concurrency "
          f"{chunks['concurrency']} "
          f"(tiny model), API server CPU {chunks['api_server_cpu']:.0%} of a core")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": stamp(quick=args.quick, rounds=args.rounds), "size": args.size,
                                    "concurrency": args.concurrency,
                                    "engine_threads": args.engine_threads,
                                    "overhead": overhead, "chunk_rate": chunks}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
