"""One real-model `hybridlb serve` per session (SmolLM2-135M-Instruct from its GGUF file, dequantized:
its tests compare it with transformers' float32 load of the same file), and one lm_eval run against it
that the lm-eval tests and the quantized engines' scores share."""

from __future__ import annotations

import json

import pytest

from hybridlb.testing.servers import start_server
from tests.conftest import SMOLLM2
from tests.real.lm_eval_runner import TASKS, run_lm_eval


@pytest.fixture(scope="session")
def smollm2_server():
    server = start_server(SMOLLM2, "--served-model-name", "smollm2", "--dtype", "float32", "--quantization", "none")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def lm_eval_run(smollm2_server, smollm2_hf_dir, tmp_path_factory) -> dict:
    """One lm_eval run over both tasks against ``smollm2_server``: its logged samples per task, and
    its scores under "results"."""
    pytest.importorskip("lm_eval")
    out = tmp_path_factory.mktemp("lm_eval")
    results = run_lm_eval(smollm2_server.url, smollm2_hf_dir, out, log_samples=True)
    samples = {}
    for task in TASKS:
        files = list(out.rglob(f"samples_{task}_*.jsonl"))
        assert files, f"no samples written for {task}"
        samples[task] = [json.loads(line) for line in files[0].read_text().splitlines()]
    samples["results"] = results
    return samples
