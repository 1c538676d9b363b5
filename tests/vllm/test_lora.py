"""LoRA through the vLLM backend: adapters made by peft, served by `hybridlb serve --engine-backend
vllm --enable-lora`, answer greedily exactly as vLLM's own `vllm serve --enable-lora` does, each
adapter alone and the base model beside them."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from hybridlb.testing.models import peft_adapters
from hybridlb.testing.servers import Server, start_servers

pytestmark = pytest.mark.slow
ADAPTERS = {"alpha": (8, 16, ["q_proj", "v_proj"]),
            "beta": (16, 32, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "My favourite colour is"]
FLAGS = ("--dtype", "float32", "--enforce-eager", "--enable-lora", "--max-lora-rank", "16", "--max-loras", "2",
         "--served-model-name", "smollm2")


@pytest.fixture(scope="module")
def adapters(smollm2_hf_dir, tmp_path_factory) -> dict[str, Path]:
    """peft's adapters with random non-zero B, so each changes the greedy output."""
    return peft_adapters(smollm2_hf_dir, tmp_path_factory.mktemp("adapters"), ADAPTERS)


def _texts(url: str) -> dict[str, list[str]]:
    found = {}
    for model in ("smollm2", *ADAPTERS):
        found[model] = []
        for prompt in PROMPTS:
            body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0}
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
            assert response.status_code == 200, response.text
            found[model].append(response.json()["choices"][0]["text"])
    return found


def test_adapters_answer_as_vllms_own_lora(smollm2_hf_dir, adapters, vllm_command, tmp_path):
    modules = [f"{name}={path}" for name, path in adapters.items()]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu"}
    (reference,) = start_servers(Server.vllm("vllm-lora", vllm_command, smollm2_hf_dir, *FLAGS, "--lora-modules",
                                             *modules, env=env, log_dir=tmp_path), timeout_s=300)
    try:
        expected = _texts(reference.url)
    finally:
        reference.stop()
    assert expected["alpha"] != expected["smollm2"] != expected["beta"]  # each adapter changes the output
    (server,) = start_servers(Server(smollm2_hf_dir, "--engine-backend", "vllm", *FLAGS, "--lora-modules", *modules,
                                     "--max-model-len", "1024", "--kv-cache-gib", "0.5"), timeout_s=300)
    try:
        assert _texts(server.url) == expected
    finally:
        server.stop()
