"""Elastic data parallelism on the real model: a step load against an autoscaled node, fixed DP=1 and
fixed DP=2, and explicit resizes under load.

The real SmolLM2 (a Hugging Face directory made from the bundled GGUF), float32, one node. The
step load: idle, then ``--concurrency`` closed-loop streams (32 random-word prompt tokens, 64
output tokens, ``ignore_eos``) for ``--load-s`` seconds, then idle again for ``--tail-s``. Each
server runs alone, started for its turn; rounds alternate the order. For each: output tok/s over
the load, TTFT P50/P99, failed requests, and rank-seconds (ranks up, integrated over the run:
what the node held). The autoscaled node (``autoscaling: {min_replicas: 1, max_replicas: 2,
target_ongoing_requests: 4, upscale_delay_s: 2, downscale_delay_s: 5}``) also gives the time
from its decision to grow to rank 1's first generated token, and when it shrank back.

The resize run: a DP=1 node under the same streams, ``POST /scale_elastic_ep`` to 2 (seconds to
the answer, and to rank 1's first token), then back to 1 with ``drain_timeout`` 30 (seconds
the drain took), failed requests over both.

    python benchmarks/elastic.py [--rounds 3] [--load-s 30] [--tail-s 15] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from common import Server, smollm2_hf_dir, stamp

OUTPUT_LEN, PROMPT_WORDS = 64, 32
AUTOSCALING = ("autoscaling: {min_replicas: 1, max_replicas: 2, target_ongoing_requests: 4, upscale_delay_s: 2, "
               "downscale_delay_s: 5, drain_timeout_s: 30}\n")
FLAGS = ("--dtype", "float32", "--quantization", "none", "--max-model-len", "1024", "--kv-cache-gib", "0.5")
WORDS = ("the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from", "it",
         "an", "be", "this", "are", "which", "or", "his")


class Load:
    """Closed-loop streams: each sends a request, reads its stream, sends the next."""

    def __init__(self, url: str, model: str, concurrency: int):
        self.url, self.model, self.concurrency = url, model, concurrency
        self.ttfts: list[float] = []
        self.tokens = self.failed = 0
        self.stop = asyncio.Event()
        self.rng = random.Random(0)

    async def _one(self, client: httpx.AsyncClient) -> None:
        while not self.stop.is_set():
            body = {"model": self.model, "prompt": " ".join(self.rng.choices(WORDS, k=PROMPT_WORDS)),
                    "max_tokens": OUTPUT_LEN, "temperature": 0, "ignore_eos": True, "stream": True}
            started, first, tokens = time.monotonic(), None, 0
            try:
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    if response.status_code != 200:
                        raise RuntimeError(response.status_code)
                    async for line in response.aiter_lines():
                        if line.startswith("data: {") and '"error"' not in line:
                            first = first or time.monotonic()
                            tokens += 1
                        elif '"error"' in line:
                            raise RuntimeError(line)
                if tokens < OUTPUT_LEN:
                    raise RuntimeError(f"{tokens} tokens")
            except Exception:
                self.failed += 1
                continue
            self.ttfts.append(first - started)
            self.tokens += tokens

    async def run(self, seconds: float) -> float:
        """Run for ``seconds``, then let the streams in flight finish; the wall time."""
        started = time.monotonic()
        async with httpx.AsyncClient(base_url=self.url, timeout=300) as client:
            workers = [asyncio.create_task(self._one(client)) for _ in range(self.concurrency)]
            await asyncio.sleep(seconds)
            self.stop.set()
            await asyncio.gather(*workers)
        return time.monotonic() - started


def _rank_steps(view: dict, rank: int) -> int:
    """Steps engine ``rank`` has run, from a /ranks answer: its first step computes its first token."""
    return next((engine["steps"] for engine in view["engines"] if engine["rank"] == rank), 0)


async def _watch(url: str, until: asyncio.Event, samples: list) -> None:
    """(time, ranks up, rank 1's steps) every 0.2 s until ``until``."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        while not until.is_set():
            view = (await client.get("/ranks")).json()
            samples.append((time.monotonic(), len(view["ranks"]), _rank_steps(view, 1)))
            await asyncio.sleep(0.2)


def step_load(server: Server, args) -> dict:
    """The step load against a started server: its figures."""
    async def run():
        samples, done = [], asyncio.Event()
        watcher = asyncio.create_task(_watch(server.url, done, samples))
        await asyncio.sleep(3)
        load = Load(server.url, server.model, args.concurrency)
        load_started = time.monotonic()
        wall = await load.run(args.load_s)
        await asyncio.sleep(args.tail_s)
        done.set()
        await watcher
        return load, load_started, wall, samples
    load, load_started, wall, samples = asyncio.run(run())
    rank_s = sum((b[0] - a[0]) * a[1] for a, b in itertools.pairwise(samples))
    row = {"output_tok_s": load.tokens / wall, "requests": len(load.ttfts), "failed": load.failed,
           "p50_ttft_ms": 1000 * statistics.median(load.ttfts), "p99_ttft_ms": 1000 * _p99(load.ttfts),
           "rank_s": rank_s, "run_s": samples[-1][0] - samples[0][0]}
    grown = next((t for t, ranks, _ in samples if ranks == 2), None)
    if grown is not None and samples[0][1] == 1:
        served = next((t for t, ranks, tokens in samples if tokens > 0), None)
        shrunk = next((t for t, ranks, _ in samples if t > grown and ranks == 1), None)
        row.update(grown_after_load_s=grown - load_started, first_token_after_load_s=(served or grown) - load_started,
                   shrunk_after_load_end_s=(shrunk - load_started - wall) if shrunk else None)
    return row


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def resize_run(model: str, args) -> dict:
    """Explicit resizes under the streams: 1 → 2, then 2 → 1 with a drain."""
    server = Server(model, *FLAGS, own_group=True)
    server.wait_ready(600)
    try:
        async def run():
            load = Load(server.url, server.model, args.concurrency)
            streams = asyncio.create_task(load.run(args.load_s))
            await asyncio.sleep(5)
            async with httpx.AsyncClient(base_url=server.url, timeout=600) as client:
                started = time.monotonic()
                grow = await client.post("/scale_elastic_ep", json={"new_data_parallel_size": 2})
                answered = time.monotonic() - started
                while _rank_steps((await client.get("/ranks")).json(), 1) == 0:
                    await asyncio.sleep(0.1)
                serving = time.monotonic() - started
                await asyncio.sleep(5)
                started = time.monotonic()
                shrink = await client.post("/scale_elastic_ep", json={"new_data_parallel_size": 1,
                                                                      "drain_timeout": 30})
                drained = time.monotonic() - started
            await streams
            assert grow.status_code == shrink.status_code == 200, (grow.text, shrink.text)
            return {"grow_answer_s": answered, "grow_first_token_s": serving, "shrink_drain_s": drained,
                    "failed": load.failed, "requests": len(load.ttfts)}
        return asyncio.run(run())
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--load-s", type=float, default=30.0)
    parser.add_argument("--tail-s", type=float, default=15.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--models-dir", default="/tmp/hybridlb-bench-models")
    parser.add_argument("--out", default="benchmarks/results/elastic.json")
    args = parser.parse_args()
    model = smollm2_hf_dir(Path(args.models_dir))
    config = Path(tempfile.mkdtemp()) / "autoscaling.yaml"
    config.write_text(AUTOSCALING)
    setups = {"fixed DP=1": (), "fixed DP=2": ("--data-parallel-size", "2"),
              "autoscaled 1..2": ("--config", str(config))}
    rounds = []
    for index in range(args.rounds):
        order = list(setups) if index % 2 == 0 else list(reversed(setups))
        found = {}
        for name in order:
            server = Server(model, *FLAGS, *setups[name], own_group=True)
            server.wait_ready(600)
            try:
                found[name] = step_load(server, args)
            finally:
                server.stop()
            print(name, json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in found[name].items()}),
                  flush=True)
        found["resize"] = resize_run(model, args)
        print("resize", json.dumps({k: round(v, 2) for k, v in found["resize"].items()}), flush=True)
        rounds.append(found)
    meta = stamp(rounds=args.rounds, load_s=args.load_s, tail_s=args.tail_s, concurrency=args.concurrency,
                 autoscaling=AUTOSCALING.strip(), model="SmolLM2-135M-Instruct", dtype="float32")
    Path(args.out).write_text(json.dumps({"meta": meta, "rounds": rounds}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
