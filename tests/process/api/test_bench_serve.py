"""`hybridlb bench serve` against a running server: the table and the JSON fields."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from hybridlb.testing.servers import start_server


def test_bench_serve_prints_the_table_and_writes_json(server, tmp_path, tiny_qwen3):
    out = tmp_path / "result.json"
    run = subprocess.run(
        [sys.executable, "-m", "hybridlb", "bench", "serve", "--base-url", server.url, "--tokenizer", tiny_qwen3,
         "--random-input-len", "16", "--random-output-len", "8", "--num-prompts", "20", "--max-concurrency", "8",
         "--ignore-eos", "--save-result", str(out)],
        capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    for label in ("Successful requests:", "Output token throughput (tok/s):", "Mean TTFT (ms):",
                  "P99 TPOT (ms):", "Median ITL (ms):", "Peak output token throughput"):
        assert label in run.stdout
    result = json.loads(out.read_text())
    assert result["completed"] == 20 and result["failed"] == 0
    assert result["total_output_tokens"] == 20 * 8 and result["total_input_tokens"] == 20 * 16
    for field in ("duration", "request_throughput", "output_throughput", "total_token_throughput",
                  "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_itl_ms",
                  "max_output_tokens_per_s"):
        assert result[field] > 0, field


def test_bench_serve_takes_openai_api_key_and_the_servers_own_tokenizer(tiny_qwen3, tmp_path):
    """A client of another machine: the key from OPENAI_API_KEY, and no local tokenizer (the model
    name is not a directory here), so the prompts come from the server's /tokenizer_info and
    /detokenize."""
    server = start_server(tiny_qwen3, "--api-key", "sekret", "--served-model-name", "remote-model")
    try:
        args = [sys.executable, "-m", "hybridlb", "bench", "serve", "--base-url", server.url, "--random-input-len",
                "8", "--random-output-len", "4", "--num-prompts", "6", "--prompt-format", "text"]
        env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "HYBRIDLB_API_KEY")}
        refused = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env)
        assert refused.returncode == 2 and "Traceback" not in refused.stderr
        assert "401" in refused.stderr and "OPENAI_API_KEY" in refused.stderr, refused.stderr
        out = tmp_path / "result.json"
        run = subprocess.run([*args, "--save-result", str(out)], capture_output=True, text=True, timeout=300,
                             env={**env, "OPENAI_API_KEY": "sekret"})
        assert run.returncode == 0, run.stderr
        assert "no local tokenizer" not in run.stderr and "random ids" not in run.stderr
        result = json.loads(out.read_text())
        assert result["completed"] == 6 and result["model_id"] == "remote-model"
        assert result["total_input_tokens"] >= 6 * 4  # text prompts, re-tokenized by the server
    finally:
        assert server.stop() == 0
