"""LoRA adapters on the real SmolLM2-135M-Instruct, made with peft: `hybridlb serve` answers as
peft + transformers do (float32, greedy) for each adapter alone and in one batch mixing three
adapters and the base model; adapters load and unload at run time through vLLM's endpoints and
stay exact while evicted under --max-loras 2; on a DP=2 node each adapter's requests go to
the rank holding it while both ranks stay equally busy."""

from __future__ import annotations

import random
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch

from hybridlb.testing.models import peft_adapters
from hybridlb.testing.servers import Server, start_servers

# name -> (rank, alpha, target modules): different ranks, modules and scalings.
ADAPTERS = {
    "alpha": (8, 16, ["q_proj", "v_proj"]),
    "beta": (16, 32, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "gamma": (8, 8, ["o_proj", "up_proj", "down_proj"]),
    "delta": (4, 8, ["k_proj", "gate_proj"]),
}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "My favourite colour is"]
NEW_TOKENS = 16
RUNTIME = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


@pytest.fixture(scope="module")
def adapters(smollm2_hf_dir, tmp_path_factory) -> dict[str, Path]:
    """The adapters, saved by peft with random non-zero B (each changes the greedy output)."""
    return peft_adapters(smollm2_hf_dir, tmp_path_factory.mktemp("adapters"), ADAPTERS)


@pytest.fixture(scope="module")
def expected(smollm2_hf_dir, adapters) -> dict[str | None, dict[str, str]]:
    """peft + transformers, float32, greedy: adapter (None: the base model) -> prompt -> text."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_hf_dir)
    texts: dict[str | None, dict[str, str]] = {}
    for name in [None, *ADAPTERS]:
        model = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32)
        if name is not None:
            model = PeftModel.from_pretrained(model, adapters[name])
        model.eval()
        texts[name] = {}
        with torch.no_grad():
            for prompt in PROMPTS:
                ids = tokenizer(prompt, return_tensors="pt").input_ids
                out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                     pad_token_id=0)
                texts[name][prompt] = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    for name in ADAPTERS:
        assert texts[name] != texts[None], f"adapter {name} does not change the output"
    return texts


def _complete(url: str, model: str, prompt: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    out = client.completions.create(model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.model == model
    return out.choices[0].text


def _all_at_once(url: str, jobs: list[tuple[str, str]]) -> list[str]:
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda job: _complete(url, *job), jobs))


def test_each_adapter_and_a_mixed_batch_equal_peft(smollm2_hf_dir, adapters, expected):
    modules = [f"{name}={adapters[name]}" for name in ("alpha", "beta", "gamma")]
    server = start_servers(Server(smollm2_hf_dir, "--served-model-name", "smollm2", "--enable-lora",
                                  "--max-loras", "3", "--lora-modules", *modules))[0]
    try:
        for name in ("alpha", "beta", "gamma"):
            assert _complete(server.url, name, PROMPTS[0]) == expected[name][PROMPTS[0]], name
        jobs = [(name, prompt) for prompt in PROMPTS for name in ("smollm2", "alpha", "beta", "gamma")]
        texts = _all_at_once(server.url, jobs)
        for (name, prompt), text in zip(jobs, texts, strict=True):
            assert text == expected[None if name == "smollm2" else name][prompt], (name, prompt)
        cards = {card["id"]: card for card in httpx.get(f"{server.url}/v1/models").json()["data"]}
        assert cards["beta"]["parent"] == "smollm2" and cards["beta"]["root"] == str(adapters["beta"])
        missing = httpx.post(f"{server.url}/v1/completions", json={"model": "delta", "prompt": "x"})
        assert missing.status_code == 404 and "the model `delta` does not exist" in missing.json()["error"]["message"]
        assert httpx.post(f"{server.url}/v1/load_lora_adapter", json={}).status_code == 404  # not without the env
    finally:
        server.stop()


def test_runtime_load_unload_and_eviction_under_max_loras_2(smollm2_hf_dir, adapters, expected, tmp_path):
    server = start_servers(Server(smollm2_hf_dir, "--served-model-name", "smollm2", "--enable-lora",
                                  "--max-loras", "2", "--lora-allowed-root", str(adapters["alpha"].parent),
                                  "--lora-allowed-root", str(tmp_path), env=RUNTIME))[0]
    url = server.url
    try:
        for name, path in adapters.items():
            loaded = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
            assert loaded.status_code == 200 and f"LoRA adapter '{name}' added" in loaded.text
        again = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "alpha", "lora_path": "/x"})
        assert again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]
        (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 64, "lora_alpha": 8}')
        bad = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path)})
        assert bad.status_code == 400 and "has no adapter_model.safetensors" in bad.json()["error"]["message"]

        jobs = [(name, prompt) for prompt in PROMPTS for name in ADAPTERS]  # four adapters, two slots
        random.Random(0).shuffle(jobs)
        for (name, prompt), text in zip(jobs, _all_at_once(url, jobs), strict=True):
            assert text == expected[name][prompt], (name, prompt)
        metrics = httpx.get(f"{url}/metrics").text
        loads = float(re.search(r'hybridlb:lora_adapter_loads_total\{[^}]*engine="0"[^}]*\} (\S+)', metrics)[1])
        assert loads >= 4  # every adapter was placed; some more than once (evicted, then needed again)

        gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "gamma"})
        assert gone.status_code == 200 and "removed successfully" in gone.text
        assert httpx.post(f"{url}/v1/completions", json={"model": "gamma", "prompt": "x"}).status_code == 404
        unknown = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "gamma"})
        assert unknown.status_code == 404 and unknown.json()["error"]["message"] == \
            "The lora adapter 'gamma' cannot be found."
        assert _complete(url, "delta", PROMPTS[1]) == expected["delta"][PROMPTS[1]]
        replaced = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "alpha", "lora_path": str(
            adapters["beta"]), "load_inplace": True})
        assert replaced.status_code == 200
        assert _complete(url, "alpha", PROMPTS[2]) == expected["beta"][PROMPTS[2]]  # the engine reloaded it
    finally:
        server.stop()


def _rank_stats(url: str) -> dict[int, dict]:
    return {engine["rank"]: engine for engine in httpx.get(f"{url}/ranks").json()["engines"]}


def _served(metrics: str, rank: int) -> float:
    return sum(float(v) for v in re.findall(rf'^vllm:request_success_total{{[^}}]*engine="{rank}"[^}}]*}} (\S+)$',
                                             metrics, re.M))


@pytest.mark.slow
def test_dp2_routes_each_adapter_to_the_rank_holding_it(smollm2_hf_dir, adapters):
    modules = [f"{name}={path}" for name, path in adapters.items()]
    server = start_servers(Server(smollm2_hf_dir, "--served-model-name", "smollm2", "--data-parallel-size", "2",
                                  "--enable-lora", "--max-loras", "2", "--lora-modules", *modules))[0]
    url = server.url
    rng = random.Random(1)
    try:
        for name in ADAPTERS:  # warm-up: each adapter finds a rank
            _complete(url, name, PROMPTS[0])
        before = _rank_stats(url)
        text = httpx.get(f"{url}/metrics").text
        before_served = [_served(text, rank) for rank in (0, 1)]
        jobs = [(name, rng.choice(PROMPTS)) for name in ADAPTERS for _ in range(12)]
        rng.shuffle(jobs)
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda job: _complete(url, *job), jobs))
        after = _rank_stats(url)
        metrics = httpx.get(f"{url}/metrics").text
    finally:
        server.stop()
    loads = {rank: float(re.search(rf'hybridlb:lora_adapter_loads_total\{{[^}}]*engine="{rank}"[^}}]*\}} (\S+)',
                                   metrics)[1]) for rank in (0, 1)}
    warm = {rank: len(before[rank]["lora_adapters"]) for rank in (0, 1)}
    assert sorted(warm.values()) == [2, 2]  # the four adapters spread over the two ranks' slots
    misses = sum(loads.values()) - 4  # loads after the four first ones: requests sent to a rank without it
    assert misses <= 0.1 * len(jobs), (loads, before, after)
    # Balanced: each rank holds two adapters and serves about half the requests (routing, not wall
    # times: a ratio of busy seconds is noise on a loaded 2-core machine).
    served = [_served(metrics, rank) - before_served[rank] for rank in (0, 1)]
    assert min(served) >= 0.35 * len(jobs), served
    for rank in (0, 1):  # vLLM's lora_requests_info, one series per rank
        assert re.search(rf'vllm:lora_requests_info\{{[^}}]*engine="{rank}"[^}}]*max_lora="2"', metrics), metrics
