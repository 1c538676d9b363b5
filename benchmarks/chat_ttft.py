"""Does a client timing chat streams see the server's real time to first token?

`vllm bench serve --backend openai-chat` times the first streamed event of each chat
request. A server that sent its role chunk before the request reached an engine would make
that read as HTTP latency. This runs vLLM's own client against `hybridlb serve` (SmolLM2,
bfloat16) and compares its mean TTFT with the server's own,
``vllm:time_to_first_token_seconds`` (request arrival to first token, per engine), over
the same requests. The goal: within 10 %.

    bash benchmarks/vllm_env.sh        # once: vLLM in its own venv
    python benchmarks/chat_ttft.py [--num-prompts 64] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
from pathlib import Path

import httpx
from common import VLLM_ENV, Server, smollm2_hf_dir, stamp, vllm_executable


def server_ttft(url: str) -> tuple[float, float]:
    """(sum of seconds, count) of the TTFT histogram over every engine."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = sum(float(v) for v in re.findall(r"^vllm:time_to_first_token_seconds_sum\{[^}]*\} (\S+)$", text, re.M))
    count = sum(float(v) for v in re.findall(r"^vllm:time_to_first_token_seconds_count\{[^}]*\} (\S+)$", text, re.M))
    return total, count


def bench_chat(vllm: str, server: Server, num_prompts: int, concurrency: int, result: Path) -> dict:
    command = [vllm, "bench", "serve", "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
               "--base-url", server.url, "--model", server.model, "--tokenizer", server.model,
               "--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "32",
               "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency), "--ignore-eos",
               "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name]
    run = subprocess.run(command, env={**os.environ, **VLLM_ENV}, capture_output=True, text=True, timeout=900)
    if run.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}")
    return json.loads(result.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models-dir", type=Path, default=Path("models"))
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/chat_ttft.json"))
    args = parser.parse_args()
    vllm = vllm_executable()
    model = smollm2_hf_dir(args.models_dir)
    server = Server.hybridlb("hybridlb", model, "--dtype", "bfloat16")
    try:
        server.wait_ready()
        bench_chat(vllm, server, 8, 4, Path("/tmp/chat_ttft_warmup.json"))  # warm-up
        before = server_ttft(server.url)
        client = bench_chat(vllm, server, args.num_prompts, args.concurrency, Path("/tmp/chat_ttft.json"))
        after = server_ttft(server.url)
    finally:
        server.stop()
    count = after[1] - before[1]
    served_ms = (after[0] - before[0]) / count * 1000
    client_ms = client["mean_ttft_ms"]
    row = {"client_mean_ttft_ms": client_ms, "server_mean_ttft_ms": served_ms, "ratio": client_ms / served_ms,
           "requests_client": client["completed"], "requests_server": count,
           "client_median_ttft_ms": client["median_ttft_ms"], "output_tok_s": client["output_throughput"]}
    print(f"vllm bench serve --backend openai-chat: mean TTFT {client_ms:.1f} ms; the server's own: "
          f"{served_ms:.1f} ms over {count:.0f} requests; client / server {row['ratio']:.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": stamp(num_prompts=args.num_prompts, concurrency=args.concurrency),
                                    "result": row}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
