"""Structured outputs, measured: what a JSON-schema constraint costs per step, what compiling a
schema costs (cold and cached), and whether compiling ever stalls other requests.

SmolLM2 bfloat16, one engine, concurrency 16, chat requests of 32 and 64 output tokens:

* ``free``: no constraint (``ignore_eos``, so every request writes its full length);
* ``json``: every request constrained by a JSON schema that cannot end sooner (a long
  required string), so both write the same number of tokens and differ only by the mask.

Also, in this process and for both grammar backends (llguidance, xgrammar), the setup, the
compile time for each of the 20 schemas of ``tests/process/structured/test_structured_api.py`` (cold:
compile plus the first mask; cached: a matcher from the cache) and one step's mask fill for 16
requests, and, against the server, the TPOT of free requests while 20
never-seen schemas compile beside them (``--compile-load``). Each server runs alone on the
machine (the other stopped), in alternating order, ``--rounds`` times; figures are medians
with each round's. With vLLM (``--vllm``), the same requests against ``vllm serve`` (its
default structured-output backend), each server alone.

    python benchmarks/structured.py [--rounds 3] [--vllm] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
from common import SMOLLM2, Server, previous_results, smollm2_hf_dir, stamp, vllm_executable, wait_quiet

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.process.structured.test_structured_api import SCHEMAS

LONG = {"type": "object", "properties": {"story": {"type": "string", "minLength": 600, "maxLength": 2000}},
        "required": ["story"]}
PROMPT = "Write a long story about a lighthouse keeper, as JSON with the story in one field."
CONCURRENCY = 16
REQUESTS = 64


async def _request(client: httpx.AsyncClient, url: str, model: str, max_tokens: int, schema: dict | None) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if schema is None:
        body["ignore_eos"] = True
    else:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    sent = time.perf_counter()
    first, tokens = None, 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if first is None and any(c["delta"].get("content") for c in chunk.get("choices", [])):
                first = time.perf_counter()
    done = time.perf_counter()
    return {"ttft": (first or done) - sent, "e2e": done - sent, "tokens": tokens}


async def _load(url: str, model: str, max_tokens: int, schemas: list[dict | None]) -> dict:
    limit = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(schema):
            async with limit:
                return await _request(client, url, model, max_tokens, schema)

        started = time.perf_counter()
        results = await asyncio.gather(*(one(s) for s in schemas))
        duration = time.perf_counter() - started
    tpots = [(r["e2e"] - r["ttft"]) / (r["tokens"] - 1) for r in results if r["tokens"] > 1]
    return {"output_tok_s": sum(r["tokens"] for r in results) / duration, "mean_tpot_ms": 1e3 * statistics.mean(tpots),
            "mean_tokens": statistics.mean(r["tokens"] for r in results),
            "p50_ttft_ms": 1e3 * statistics.median(r["ttft"] for r in results)}


def measure(server: Server) -> dict:
    rows = {}
    for max_tokens in (32, 64):
        for kind, schema in (("free", None), ("json", LONG)):
            wait_quiet([server.process.pid])
            row = rows[f"{kind}-{max_tokens}"] = asyncio.run(_load(server.url, server.model, max_tokens,
                                                                   [schema] * REQUESTS))
            print(f"  {server.name:<10}{kind:<5}{max_tokens:>3} tokens {row['output_tok_s']:>7.1f} tok/s  "
                  f"TPOT {row['mean_tpot_ms']:>6.1f} ms  ({row['mean_tokens']:.0f} tokens each)", flush=True)
    return rows


def compile_load(server: Server, round_index: int) -> dict:
    """Free requests' TPOT alone, then with 20 never-seen schemas compiling beside them."""
    async def run(with_schemas: bool) -> dict:
        fresh = [{**s, "description": f"round {round_index} {i} {time.time_ns()}"} for i, s in enumerate(SCHEMAS)]
        free = asyncio.create_task(_load(server.url, server.model, 64, [None] * 32))
        if with_schemas:
            await _load(server.url, server.model, 8, fresh)
        return await free

    wait_quiet([server.process.pid])
    alone = asyncio.run(run(False))
    wait_quiet([server.process.pid])
    beside = asyncio.run(run(True))
    return {"free_tpot_ms": alone["mean_tpot_ms"], "free_tpot_with_compiles_ms": beside["mean_tpot_ms"],
            "free_p50_ttft_ms": alone["p50_ttft_ms"], "free_p50_ttft_with_compiles_ms": beside["p50_ttft_ms"]}


def compile_times() -> dict:
    """In this process, per grammar backend: making it (the tokenizer's vocabulary read once per
    engine), cold and cached compile per schema (median and max over 20), and one step's mask
    fill for 16 requests mid-way through their JSON (what the engine does each step)."""
    import numpy as np

    from hybridlb.checkpoint.tokenizer import Tokenizer
    from hybridlb.config import StructuredOutputsConfig
    from hybridlb.grammar import GrammarCache, make_backend
    from hybridlb.params import Constraint

    tokenizer = Tokenizer(SMOLLM2)
    words = (tokenizer.vocab_size + 31) // 32
    results = {}
    for name in ("llguidance", "xgrammar"):
        started = time.perf_counter()
        try:
            backend = make_backend(StructuredOutputsConfig(backend=name), tokenizer, tokenizer.vocab_size)
        except Exception as exc:  # xgrammar is optional outside the test extras
            print(f"  {name}: not measured ({exc})", flush=True)
            continue
        tokenizer_s = time.perf_counter() - started
        cache = GrammarCache(lambda backend=backend: backend, size=64)
        bitmask = np.zeros((16, words), dtype=np.int32)
        cold, cached, compiled = [], [], []
        for schema in SCHEMAS:
            constraint = Constraint("json", json.dumps(schema))
            started = time.perf_counter()
            cache.matcher(constraint).result().fill(bitmask, 0)
            cold.append(time.perf_counter() - started)
            started = time.perf_counter()
            cache.matcher(constraint).result().fill(bitmask, 0)
            cached.append(time.perf_counter() - started)
            compiled.append(constraint)
        prefix = tokenizer.encode('{"name": "Al', add_special_tokens=False)
        matchers = []
        for i in range(16):  # schemas 0, 10, 19 start with a name: all 16 rows inside a string
            matcher = cache.matcher(compiled[(0, 10, 19)[i % 3]]).result()
            for token in prefix:
                matcher.accept(token)
            matchers.append(matcher)
        fills = []
        for _ in range(50):
            started = time.perf_counter()
            for row, matcher in enumerate(matchers):
                matcher.fill(bitmask, row)
            fills.append(time.perf_counter() - started)
        cache.close()
        results[name] = {"tokenizer_ms": 1e3 * tokenizer_s,
                         "cold_ms_median": 1e3 * statistics.median(cold), "cold_ms_max": 1e3 * max(cold),
                         "cached_ms_median": 1e3 * statistics.median(cached), "cached_ms_max": 1e3 * max(cached),
                         "fill_16_rows_ms": 1e3 * statistics.median(fills)}
        row = results[name]
        print(f"  {name:<11} setup {row['tokenizer_ms']:.0f} ms; compile cold median {row['cold_ms_median']:.2f} ms "
              f"(max {row['cold_ms_max']:.2f}), cached {row['cached_ms_median']:.3f} ms; mask fill, 16 rows "
              f"{row['fill_16_rows_ms']:.3f} ms", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--vllm", action="store_true", help="also measure vllm serve (installs it once)")
    parser.add_argument("--models-dir", type=Path, default=Path("models"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/structured.json"))
    args = parser.parse_args()
    print("grammar backends, in this process:", flush=True)
    compile = compile_times()
    servers = ["hybridlb", "vllm"] if args.vllm else ["hybridlb"]
    raw: dict[str, list[dict]] = {name: [] for name in servers}
    load: list[dict] = []
    for round_index in range(args.rounds):
        print(f"round {round_index + 1}", flush=True)
        for name in servers if round_index % 2 == 0 else servers[::-1]:
            if name == "hybridlb":
                server = Server.hybridlb("hybridlb", SMOLLM2, "--dtype", "bfloat16", "--quantization", "none",
                                         "--served-model-name", "smollm2")  # vLLM's weights: the file dequantized
            else:
                server = Server.vllm("vllm", vllm_executable(), smollm2_hf_dir(args.models_dir), "--dtype", "bfloat16",
                                     "--served-model-name", "smollm2")
            server.model = "smollm2"
            try:
                server.wait_ready(900)
                asyncio.run(_load(server.url, server.model, 8, [None, LONG] * 4))  # warm up
                raw[name].append(measure(server))
                if name == "hybridlb":
                    load.append(compile_load(server, round_index))
                    print(f"  free TPOT {load[-1]['free_tpot_ms']:.1f} ms alone, "
                          f"{load[-1]['free_tpot_with_compiles_ms']:.1f} ms beside 20 cold compiles", flush=True)
            finally:
                server.stop()
    table = {name: {key: {field: statistics.median(r[key][field] for r in rounds) for field in rounds[0][key]}
                    for key in rounds[0]} for name, rounds in raw.items()}
    load_table = {field: statistics.median(r[field] for r in load) for field in load[0]}
    for name, rows in table.items():
        for key, row in rows.items():
            each = ", ".join(f"{r[key]['output_tok_s']:.0f}" for r in raw[name])
            print(f"{name:<10}{key:<8}{row['output_tok_s']:>7.1f} tok/s ({each})  TPOT {row['mean_tpot_ms']:.1f} ms")
    for tokens in (32, 64):
        ours = table["hybridlb"]
        ratio = ours[f"json-{tokens}"]["mean_tpot_ms"] / ours[f"free-{tokens}"]["mean_tpot_ms"]
        print(f"hybridlb TPOT constrained / free at {tokens} tokens: {ratio:.2f}x")
    meta = stamp(rounds=args.rounds, concurrency=CONCURRENCY, requests=REQUESTS)
    previous = previous_results(args.out)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**previous, "meta": meta, "results": table, "compile": compile,
                                    "compile_load": load_table, "raw": raw, "raw_load": load}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
