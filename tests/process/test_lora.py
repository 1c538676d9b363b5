"""LoRA adapters on tiny checkpoints: the adapter's math against its weights merged into the
base model, batches mixing adapters, slots and eviction, the scheduler's waiting rule, the
adapter checks and their errors, vLLM's flags, and adapter-aware routing (the real-model
checks against peft are in tests/real/test_lora.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx

from hybridlb.testing.adapters import write_adapter
from hybridlb.testing.servers import Server, completion, start_servers


def test_serve_checks_lora_flags_before_starting(checkpoints, tmp_path):
    model = checkpoints("llama")
    good = write_adapter(tmp_path / "good", model, ["q_proj"])
    json_form = json.dumps({"name": "j", "path": str(good), "base_model_name": "base"})

    def serve(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "hybridlb", "serve", model, "--dry-run", *flags],
                              capture_output=True, text=True, timeout=120)

    ran = serve("--enable-lora", "--lora-modules", f"a={good}", json_form, "--max-loras", "2")
    assert ran.returncode == 0, ran.stderr
    assert "LoRA (2 adapters, 2 per engine)" in ran.stdout
    ran = serve("--lora-modules", f"a={good}")
    assert ran.returncode != 0 and "--lora-modules needs --enable-lora; add it" in ran.stderr
    ran = serve("--lora-allowed-root", str(tmp_path), "--lora-load", "eager")
    assert ran.returncode != 0 and "--lora-load, --lora-allowed-root needs --enable-lora; add it" in ran.stderr
    ran = serve("--enable-lora", "--lora-modules", f"a={tmp_path / 'missing'}")
    assert ran.returncode != 0 and "--lora-modules a: no adapter directory at" in ran.stderr
    ran = serve("--enable-lora", "--lora-modules", "justaname")
    assert ran.returncode != 0 and "write name=path" in ran.stderr


def _held(url: str) -> list[list[str]]:
    return [sorted(engine["lora_adapters"]) for engine in httpx.get(f"{url}/ranks", timeout=10).json()["engines"]]


def _placements(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("hybridlb:lora_adapter_loads_total{"))


def _wait_for(condition, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return value


def test_eager_loading_places_adapters_in_every_engine_before_any_request(tiny_qwen3, tmp_path):
    """--lora-load eager: the adapters of --lora-modules, and one loaded at run time (from the
    --lora-allowed-root), are in each engine's slots before any request names them; a request
    then loads nothing more."""
    a, b, c = (write_adapter(tmp_path / directory / name, tiny_qwen3, ["q_proj", "v_proj"], seed=i)
               for i, (directory, name) in enumerate((("start", "a"), ("start", "b"), ("runtime", "c"))))
    server = start_servers(Server(tiny_qwen3, "--data-parallel-size", "2", "--enable-lora", "--lora-modules",
                                  f"a={a}", f"b={b}", "--max-loras", "3", "--lora-load", "eager",
                                  "--lora-allowed-root", str(tmp_path / "runtime"),
                                  env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}))[0]
    try:
        assert _wait_for(lambda: _held(server.url) == [["a", "b"], ["a", "b"]]), _held(server.url)
        loaded = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(c)})
        assert loaded.status_code == 200, loaded.text
        assert _wait_for(lambda: _held(server.url) == [["a", "b", "c"]] * 2), _held(server.url)
        assert _placements(server.url) == 6
        for name in "abc":
            completion(server.url, name)
        assert _placements(server.url) == 6
    finally:
        server.stop()
