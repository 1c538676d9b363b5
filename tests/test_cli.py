"""The command line, run as a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

from hybridlb import LLM, SamplingParams


def _hybridlb(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridlb", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


def test_make_model_then_generate(tmp_path):
    out = tmp_path / "llama"
    made = _hybridlb("make-model", "--arch", "llama", "--size", "tiny", "--seed", "3", "--out", str(out))
    assert made.returncode == 0, made.stderr
    run = _hybridlb("generate", "--model", str(out), "--prompt", "The weather", "--prompt", "GPU",
                    "--max-tokens", "6", "--ignore-eos", "--json")
    assert run.returncode == 0, run.stderr
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    expected = LLM(str(out)).generate(["The weather", "GPU"], SamplingParams(max_tokens=6, temperature=0,
                                                                          ignore_eos=True))
    assert [line["token_ids"] for line in lines] == [e.token_ids for e in expected]
    assert [line["text"] for line in lines] == [e.text for e in expected]


def test_default_config_makes_its_checkpoint_on_first_use(tmp_path):
    config = tmp_path / "local.yaml"
    config.write_text("engine: {model: models/m, make_if_missing: {arch: qwen3, size: tiny}, max_model_len: 128}\n")
    run = _hybridlb("generate", "--config", str(config), "--prompt", "Hi", "--max-tokens", "3", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "models/m/config.json").exists()
    assert run.stdout.startswith("Hi")


def test_errors_are_one_clear_line(tmp_path):
    missing = _hybridlb("generate", "--model", str(tmp_path / "none"), "--prompt", "x")
    assert missing.returncode == 2 and "does not exist" in missing.stderr and "Traceback" not in missing.stderr
    bad_arch = _hybridlb("make-model", "--arch", "gpt2", "--out", str(tmp_path / "g"))
    assert bad_arch.returncode == 2 and "unknown arch 'gpt2'" in bad_arch.stderr
    no_model = _hybridlb("generate", "--prompt", "x")
    assert no_model.returncode == 2 and "--model" in no_model.stderr


def test_generate_takes_a_gguf_model_and_the_default_config():
    from tests.conftest import SMOLLM2

    params = SamplingParams(max_tokens=8, temperature=0)
    expected = LLM(SMOLLM2, max_model_len=256, num_kv_blocks=32).generate(["The capital of France is"], params)[0]
    for source in (["--model", SMOLLM2], ["--config", "configs/local.yaml"]):
        run = _hybridlb("generate", *source, "--prompt", "The capital of France is", "--max-tokens", "8", "--json")
        assert run.returncode == 0, run.stderr
        assert json.loads(run.stdout)["token_ids"] == expected.token_ids
    assert "Paris" in expected.text
