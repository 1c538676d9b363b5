"""``hybridlb bench serve``: load any OpenAI-compatible server, report like ``vllm bench serve``.

Random dataset: each prompt is ``random_input_len`` token ids drawn from the model's
vocabulary (sent as a token-id prompt, which hybridlb and vLLM accept; ``--prompt-format
text`` decodes them to text instead, for servers that take text only). Requests stream
with ``stream_options.include_usage`` so output token counts come from the server.
TTFT is the time to the first chunk with text, ITL the gaps between later chunks, TPOT
(e2e - TTFT) / (output tokens - 1).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime

import httpx


class BenchError(RuntimeError):
    """The benchmark cannot run (server unreachable, bad arguments)."""


class Unauthorized(BenchError):
    """The server wants an API key the benchmark does not have."""


@dataclass
class BenchArgs:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None
    tokenizer: str | None = None
    dataset_name: str = "random"
    random_input_len: int = 1024
    random_output_len: int = 128
    num_prompts: int = 1000
    max_concurrency: int | None = None
    request_rate: float = float("inf")
    ignore_eos: bool = False
    seed: int = 0
    prompt_format: str = "ids"
    api_key: str | None = None
    save_result: str | None = None
    progress: bool = True


@dataclass
class RequestResult:
    ok: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)
    error: str = ""


def make_prompts(args: BenchArgs, vocab_size: int, decode=None) -> list[list[int] | str]:
    rng = random.Random(args.seed)
    prompts: list[list[int] | str] = []
    for _ in range(args.num_prompts):
        ids = [rng.randrange(vocab_size) for _ in range(args.random_input_len)]
        prompts.append(decode(ids) if args.prompt_format == "text" and decode else ids)
    return prompts


async def _one(client: httpx.AsyncClient, args: BenchArgs, prompt, start_of_run: float, url: str,
               max_tokens: int, model: str | None = None) -> RequestResult:
    body = {"model": model or args.model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0.0, "ignore_eos": args.ignore_eos}
    result = RequestResult(prompt_tokens=len(prompt) if isinstance(prompt, list) else 0)
    sent = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error")
                    return result
                now = time.perf_counter()
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                if any(c.get("text") for c in chunk.get("choices", [])):
                    if last is None:
                        result.ttft = now - sent
                    else:
                        result.itls.append(now - last)
                    last = now
                    result.chunk_times.append(now - start_of_run)
        result.e2e = time.perf_counter() - sent
        result.ok = result.output_tokens > 0
        if not result.ok:
            result.error = "no usage in the stream"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def _intervals(rate: float, count: int, seed: int) -> list[float]:
    if rate == float("inf"):
        return [0.0] * count
    rng = random.Random(seed)
    return [rng.expovariate(rate) for _ in range(count)]


def _progress(done: int, total: int) -> None:
    """On a terminal, one line rewritten in place; piped, a line at every tenth and at the end."""
    if sys.stderr.isatty():
        print(f"\r{done}/{total} requests", end="", file=sys.stderr, flush=True)
    elif done == total or done * 10 // total != (done - 1) * 10 // total:
        print(f"{done}/{total} requests", file=sys.stderr, flush=True)


async def run_benchmark(args: BenchArgs, prompts: list, urls: list[str] | None = None,
                        max_tokens: list[int] | None = None,
                        models: list[str] | None = None) -> tuple[list[RequestResult], float]:
    """Send every prompt (request ``i`` to ``urls[i % len(urls)]``, default the base URL; naming
    ``models[i]``, default ``args.model``: a LoRA adapter per request)."""
    urls = urls or [args.base_url]
    max_tokens = max_tokens or [args.random_output_len] * len(prompts)
    limit = args.max_concurrency or len(prompts)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    semaphore = asyncio.Semaphore(limit)
    done = 0

    async def guarded(index: int, prompt) -> RequestResult:
        nonlocal done
        async with semaphore:
            result = await _one(client, args, prompt, start, urls[index % len(urls)], max_tokens[index],
                                models[index] if models else None)
        done += 1
        if args.progress:
            _progress(done, len(prompts))
        return result

    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=httpx.Timeout(None, connect=30)) as client:
        start = time.perf_counter()
        tasks = []
        gaps = _intervals(args.request_rate, len(prompts), args.seed)
        for index, (prompt, gap) in enumerate(zip(prompts, gaps, strict=True)):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(guarded(index, prompt)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    if args.progress and sys.stderr.isatty():
        print(file=sys.stderr)  # past the line rewritten in place
    return results, duration


async def run_sessions(args: BenchArgs, sessions: list[list], url: str | None = None,
                       max_tokens: int | None = None, think_s: float = 0.0,
                       seed: int = 0) -> tuple[list[RequestResult], float]:
    """Multi-turn: each session sends its prompts in order, the next once the previous
    finished; up to ``max_concurrency`` requests at once. A turn takes a slot only while
    it runs, so with more sessions than slots their turns interleave as many users' do
    (each waits for a slot like a user thinking), instead of each chat owning a slot.
    ``think_s``: a user's mean pause between reading an answer and sending the next turn
    (exponential, drawn from ``seed``), holding no slot meanwhile."""
    url = url or args.base_url
    limit = args.max_concurrency or len(sessions)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    semaphore = asyncio.Semaphore(limit)

    async def turn(prompt) -> RequestResult:
        async with semaphore:
            return await _one(client, args, prompt, start, url, max_tokens or args.random_output_len)

    pauses = random.Random(seed)

    async def session(prompts: list) -> list[RequestResult]:
        results = []
        for index, prompt in enumerate(prompts):
            if index and think_s > 0:
                await asyncio.sleep(pauses.expovariate(1 / think_s))
            results.append(await turn(prompt))
        return results

    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=httpx.Timeout(None, connect=30)) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(session(prompts) for prompts in sessions))
        duration = time.perf_counter() - start
    return [r for turns in results for r in turns], duration


def _ms(values: list[float], stat: str) -> float:
    if not values:
        return 0.0
    if stat == "mean":
        return statistics.fmean(values) * 1000
    if stat == "median":
        return statistics.median(values) * 1000
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))] * 1000


def summarize(args: BenchArgs, results: list[RequestResult], duration: float) -> dict:
    good = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in good)
    prompt = sum(r.prompt_tokens for r in good)
    per_second: dict[int, int] = {}
    for r in good:
        for t in r.chunk_times:
            per_second[int(t)] = per_second.get(int(t), 0) + 1
    ttfts = [r.ttft for r in good]
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in good if r.output_tokens > 1]
    itls = [gap for r in good for gap in r.itls]
    summary = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "openai", "base_url": args.base_url,
        "model_id": args.model, "num_prompts": len(results), "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency, "duration": duration, "completed": len(good),
        "failed": len(results) - len(good), "total_input_tokens": prompt, "total_output_tokens": output,
        "request_throughput": len(good) / duration, "output_throughput": output / duration,
        "total_token_throughput": (prompt + output) / duration,
        "max_output_tokens_per_s": max(per_second.values(), default=0),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls)):
        for stat in ("mean", "median", "p99"):
            summary[f"{stat}_{name}_ms"] = _ms(values, stat)
    return summary


def print_summary(s: dict) -> None:
    rows = [
        ("Successful requests:", s["completed"]), ("Failed requests:", s["failed"]),
        ("Maximum request concurrency:", s["max_concurrency"]),
        ("Benchmark duration (s):", f"{s['duration']:.2f}"),
        ("Total input tokens:", s["total_input_tokens"]), ("Total generated tokens:", s["total_output_tokens"]),
        ("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
        ("Peak output token throughput (tok/s):", f"{s['max_output_tokens_per_s']:.2f}"),
        ("Total Token throughput (tok/s):", f"{s['total_token_throughput']:.2f}"),
    ]
    print(f"{' Serving Benchmark Result ':=^50}")
    for label, value in rows:
        print(f"{label:<40}{value!s:<10}")
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency")):
        print(f"{title:-^50}")
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p99", "P99")):
            print(f"{f'{label} {name.upper()} (ms):':<40}{s[f'{stat}_{name}_ms']:<10.2f}")
    print("=" * 50)
    for error in s["errors"]:
        print(f"error: {error}")


def bench_serve(args: BenchArgs) -> dict:
    """Run the benchmark end to end; print the table, save JSON if asked, return the summary."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    if args.model is None:
        models = _get(f"{args.base_url}/v1/models", headers, args.api_key)
        args.model = models["data"][0]["id"]
    vocab_size, decode = _tokenizer(args, headers)
    prompts = make_prompts(args, vocab_size, decode)
    results, duration = asyncio.run(run_benchmark(args, prompts))
    summary = summarize(args, results, duration)
    print_summary(summary)
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump({**summary, "args": {k: v for k, v in asdict(args).items() if k != "api_key"}}, f, indent=2)
    return summary


def _get(url: str, headers: dict, api_key: str | None) -> dict:
    """A GET the benchmark cannot do without, or a BenchError saying why it failed."""
    try:
        response = httpx.get(url, headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        raise BenchError(f"no server answers at {url} ({type(exc).__name__}: {exc}); is it up?") from None
    if response.status_code == 401:
        given = "the key given was refused" if api_key else "none was given"
        raise Unauthorized(f"{url} answered 401: the server wants an API key and {given}; pass --api-key or set "
                           "OPENAI_API_KEY / HYBRIDLB_API_KEY")
    if response.status_code != 200:
        raise BenchError(f"{url} answered {response.status_code}: {response.text[:200]}")
    return response.json()


def _tokenizer(args: BenchArgs, headers: dict):
    """(vocabulary size, decode) for making prompts: from a local tokenizer (--tokenizer, or --model
    when it is a local checkpoint), else the server's own (/tokenizer_info, /detokenize)."""
    local = args.tokenizer or args.model
    try:
        from hybridlb.checkpoint.tokenizer import Tokenizer

        tokenizer = Tokenizer(local)
        return tokenizer.vocab_size, tokenizer.decode
    except Exception:
        if args.tokenizer is not None:
            raise BenchError(f"--tokenizer {args.tokenizer!r} is not a tokenizer this machine can load") from None
    try:
        info = _get(f"{args.base_url}/tokenizer_info", headers, args.api_key)
    except Unauthorized:
        raise
    except BenchError as exc:
        print(f"note: no local tokenizer for {local!r} and the server's is not available ({exc}); "
              "random ids below 1000", file=sys.stderr)
        return 1000, None

    def decode(ids: list[int]) -> str:
        response = httpx.post(f"{args.base_url}/detokenize", json={"model": args.model, "tokens": ids},
                              headers=headers, timeout=30)
        response.raise_for_status()
        return response.json()["prompt"]

    return info["vocab_size"], decode
