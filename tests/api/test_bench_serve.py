"""`hybridlb bench serve` against a running server: the table and the JSON fields."""

from __future__ import annotations

import json
import subprocess
import sys


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
