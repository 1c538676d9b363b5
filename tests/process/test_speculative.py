"""Speculative decoding's parts that need no model: n-gram proposals, vLLM's --speculative-config
spellings and their errors, and the scheduler's draft budget (the real-model checks are in
tests/real/test_speculative.py)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_serve_takes_vllm_speculative_config(checkpoints):
    model = checkpoints("llama")
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                       "prompt_lookup_min": 2})

    def serve(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "hybridlb", "serve", model, *flags, "--dry-run"],
                              capture_output=True, text=True, timeout=120)

    run = serve("--speculative_config", spec)
    assert run.returncode == 0 and "speculative ngram x4" in run.stdout, run.stderr
    bad = serve("--speculative-config", '{"method": "medusa", "num_speculative_tokens": 2}')
    assert bad.returncode != 0 and "speculates by n-gram prompt lookup only" in bad.stderr
