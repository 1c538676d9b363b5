"""make-model writes real Hugging Face checkpoints; bad ones fail with a precise message."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridlb import LLM
from hybridlb.checkpoint.spec import CheckpointError
from hybridlb.checkpoint.tokenizer import Tokenizer


@pytest.fixture
def broken(tmp_path, tiny_qwen3):
    """A private copy of the tiny checkpoint that a test may damage."""
    target = tmp_path / "broken"
    shutil.copytree(tiny_qwen3, target)
    return target


def _load(path) -> None:
    LLM(str(path), max_model_len=64, num_kv_blocks=8)


def test_make_model_writes_the_hugging_face_layout(tiny_qwen3):
    from pathlib import Path

    names = {p.name for p in Path(tiny_qwen3).iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    config = json.loads((Path(tiny_qwen3) / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["tie_word_embeddings"] is False


def test_tokenizer_and_chat_template_match_transformers(tiny_qwen3):
    from transformers import AutoTokenizer

    ours, theirs = Tokenizer(tiny_qwen3), AutoTokenizer.from_pretrained(tiny_qwen3)
    text = "Zürich café, 中文 and 🚀 rockets: 3.14 ≤ π"
    assert ours.encode(text) == theirs.encode(text)
    assert ours.decode(ours.encode(text)) == text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == expected
    assert set(ours.eos_token_ids) == {theirs.convert_tokens_to_ids("<|im_end|>"),
                                       theirs.convert_tokens_to_ids("<|endoftext|>")}


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        _load(tmp_path / "nope")


def test_unsupported_architecture(broken):
    config = json.loads((broken / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"GPT2LMHeadModel.*not supported.*Qwen3ForCausalLM"):
        _load(broken)


def test_missing_config_and_weights(broken):
    (broken / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        _load(broken)
    (broken / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json is missing"):
        _load(broken)


def test_missing_tensor_is_named(broken):
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, broken / "model.safetensors")
    missing = r"model\.layers\.1\.self_attn\.k_proj\.weight \(shape \[64, 128\]\) is missing"
    with pytest.raises(CheckpointError, match=missing):
        _load(broken)


def test_misshaped_tensor_names_file_tensor_and_expected_shape(broken):
    tensors = load_file(broken / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight"] = torch.zeros(128, 100)
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(CheckpointError) as info:
        _load(broken)
    message = str(info.value)
    assert "model.safetensors" in message and "model.layers.0.mlp.down_proj.weight" in message
    assert "[128, 100]" in message and "expected [128, 256]" in message


def test_missing_shard_is_named(tmp_path):
    from hybridlb.model.make_model import make_model

    sharded = make_model("qwen3", "tiny", tmp_path / "sharded", max_shard_mb=0.2)
    next(sharded.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match=r"lists shard model-00002-of-\d+\.safetensors, which is missing"):
        _load(sharded)


def test_missing_tokenizer(broken):
    (broken / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"tokenizer\.json is missing"):
        _load(broken)


def test_unknown_make_model_arch(tmp_path):
    from hybridlb.model.make_model import make_model

    with pytest.raises(ValueError, match="unknown arch 'gpt2'"):
        make_model("gpt2", "tiny", tmp_path / "x")


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "qwen2", "mixtral"])
def test_the_spec_counts_the_loaded_models_parameters(checkpoints, arch):
    """What `render k8s` sizes a pod's memory from: exactly the weights the engine holds."""
    from hybridlb.checkpoint.spec import load_spec

    model = checkpoints(arch)
    loaded = LLM(model, max_model_len=128, kv_cache_gib=0.01, dtype="float32").engine.runner.model
    assert load_spec(model).num_parameters == sum(p.numel() for p in loaded.parameters())
