"""Checkpoint layouts real models use, each written by transformers' own save_pretrained:
greedy tokens equal transformers'; each broken variant fails with an error naming the fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridlb import LLM, SamplingParams
from hybridlb.checkpoint.spec import CheckpointError
from tests.conftest import PROMPTS, hf_greedy

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
BASE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
            initializer_range=0.2, tie_word_embeddings=False)
ROPES = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
}


def _save(out: Path, tiny: str, arch: str = "llama", dtype: torch.dtype = torch.float32, **overrides) -> Path:
    """A random model built and saved by transformers, with the tiny checkpoint's tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    vocab = json.loads(Path(tiny, "config.json").read_text())["vocab_size"]
    config = AutoConfig.for_model(arch, vocab_size=vocab, **{**BASE, **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):  # transformers zero-inits biases; make them matter
                param.normal_(0, 0.2)
    model.to(dtype).save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(tiny, name), out / name)
    return out


def _assert_same_greedy(path: Path) -> None:
    ours = LLM(str(path), max_model_len=256, num_kv_blocks=64, dtype="float32").generate(PROMPTS, GREEDY)
    expected = hf_greedy(str(path), [o.prompt_token_ids for o in ours], GREEDY.max_tokens)
    assert sum(len(set(t)) for t in expected) / len(expected) >= 4, f"degenerate reference: {expected}"
    assert [o.token_ids for o in ours] == expected


def _edit_config(path: Path, edit) -> None:
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))


LAYOUTS = {
    "tied_embeddings": dict(tie_word_embeddings=True),
    "head_dim_not_hidden_over_heads": dict(head_dim=48),
    "qwen2_attention_bias": dict(arch="qwen2"),
    "bfloat16": dict(dtype=torch.bfloat16),
    "float16": dict(dtype=torch.float16),
    **{f"rope_{name}": dict(rope_parameters={"rope_theta": 10000.0, **rope}) for name, rope in ROPES.items()},
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_gives_transformers_tokens(tmp_path, tiny_qwen3, layout):
    path = _save(tmp_path / layout, tiny_qwen3, **LAYOUTS[layout])
    if layout == "tied_embeddings":
        assert "lm_head.weight" not in load_file(path / "model.safetensors")
    _assert_same_greedy(path)


def test_tied_checkpoint_that_also_stores_lm_head(tmp_path, tiny_qwen3):
    path = _save(tmp_path / "both", tiny_qwen3, tie_word_embeddings=True)
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    _assert_same_greedy(path)


def test_transformers_4_field_names(tmp_path, tiny_qwen3):
    path = _save(tmp_path / "v4", tiny_qwen3, rope_parameters={"rope_theta": 5000.0, **ROPES["linear"]})

    def to_v4(config: dict) -> None:
        rope = config.pop("rope_parameters")
        config["rope_theta"] = rope.pop("rope_theta")
        config["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
        config["torch_dtype"] = config.pop("dtype")
        config["transformers_version"] = "4.46.0"

    _edit_config(path, to_v4)
    _assert_same_greedy(path)


def test_scaled_rope_extends_the_model_length(tmp_path, tiny_qwen3):
    path = _save(tmp_path / "yarn", tiny_qwen3, rope_parameters={"rope_theta": 10000.0, **ROPES["yarn"]})
    assert LLM(str(path), num_kv_blocks=1024).engine.max_model_len == 1024  # 4 × 256, at least the stated 1024
    with pytest.raises(ValueError, match=r"max_model_len=2048 exceeds the model's maximum length 1024"):
        LLM(str(path), max_model_len=2048)


BROKEN = {
    "untied_without_lm_head": (dict(tie_word_embeddings=True), lambda c: c.update(tie_word_embeddings=False),
                               r"lm_head\.weight .* is missing; .*\"tie_word_embeddings\": true"),
    "unknown_rope_type": (dict(), lambda c: c.update(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}),
                          r"rope type 'longrope' is not supported; supported: default, linear, dynamic"),
    "llama3_rope_without_its_keys": (dict(), lambda c: c.update(rope_parameters={"rope_type": "llama3", "factor": 8}),
                                     r"needs low_freq_factor, high_freq_factor"),
    "unknown_dtype": (dict(), lambda c: c.update(dtype="int4"), r"dtype 'int4' is not supported"),
    "quantized": (dict(), lambda c: c.update(quantization_config={"quant_method": "awq"}),
                  r"quantized checkpoints \(awq\) are not supported"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_broken_layout_names_the_problem(tmp_path, tiny_qwen3, case):
    overrides, edit, message = BROKEN[case]
    path = _save(tmp_path / case, tiny_qwen3, **overrides)
    _edit_config(path, edit)
    with pytest.raises(CheckpointError, match=message):
        LLM(str(path), max_model_len=128, num_kv_blocks=64)


def test_dynamic_rope_beyond_the_pretraining_length_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from hybridlb.model.layers import _inverse_frequencies

    rope = {"rope_theta": 10000.0, "rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 1024}
    config = LlamaConfig(**{**BASE, "rope_parameters": dict(rope)})
    for length in (512, 3000):
        expected, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=length)
        ours, scale = _inverse_frequencies(32, rope, length)
        assert scale == 1.0 and torch.allclose(ours, expected, rtol=1e-5), length
