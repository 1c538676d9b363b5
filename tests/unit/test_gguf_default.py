"""A .gguf file is served with its weights kept quantized unless ``quantization: none`` asks for them
dequantized (as vLLM serves GGUF files); other checkpoints are served as they are stored."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError
from torch import nn

from hybridlb.cli.vllm_args import translate
from hybridlb.config import EngineConfig, load_config
from hybridlb.engine.model_runner import ModelRunner
from hybridlb.engine.weights import engine_quantization, weights_summary
from hybridlb.model.quantized import Int4Linear, Int8Embedding, Int8GroupLinear, Int8Linear

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "local.yaml"
QUANTIZED = (Int4Linear, Int8Linear, Int8GroupLinear, Int8Embedding)
SMALL = {"max_model_len": 256, "num_kv_blocks": 16}  # the weights are what is checked, not the cache


def _runner(engine: EngineConfig, **update) -> ModelRunner:
    return ModelRunner(EngineConfig(**{**engine.model_dump(exclude_unset=True), **SMALL, **update}))


def _projections(runner: ModelRunner) -> dict[str, nn.Module]:
    return {name: module for name, module in runner.model.named_modules()
            if name.endswith((".qkv", ".o", ".gate_up", ".down"))}


@pytest.fixture(scope="module")
def default_engine() -> EngineConfig:
    engine = load_config(DEFAULT_CONFIG).engine
    assert engine.model.endswith(".gguf") and engine.quantization is None
    return engine


def test_the_default_config_keeps_the_bundled_gguf_files_weights_quantized(default_engine):
    runner = _runner(default_engine)
    projections = _projections(runner)
    assert len(projections) == 4 * runner.spec.num_layers
    # The file's Q4_1 projections stay 4-bit (no float copy of them is held), its Q8_0 embedding int8.
    assert all(isinstance(layer, Int4Linear) for layer in projections.values()), projections
    assert isinstance(runner.model.embed, Int8Embedding)
    assert runner.quantization == "gguf"
    assert "weights kept quantized, gguf (the default for a .gguf file)" in runner.label()


def test_quantization_none_dequantizes_it(default_engine):
    runner = _runner(default_engine, quantization="none", dtype="float32")
    for name, layer in _projections(runner).items():
        assert type(layer) is nn.Linear and layer.weight.is_floating_point(), name
    assert not [m for m in runner.model.modules() if isinstance(m, QUANTIZED)]
    assert type(runner.model.embed) is nn.Embedding
    assert runner.quantization is None and "weights dequantized from the .gguf file" in runner.label()


def test_a_hugging_face_checkpoint_is_served_as_stored(tiny_qwen3):
    runner = _runner(EngineConfig(model=tiny_qwen3, dtype="float32"))
    assert all(type(layer) is nn.Linear for layer in _projections(runner).values())
    assert not [m for m in runner.model.modules() if isinstance(m, QUANTIZED)]
    assert runner.quantization is None and "weights" not in runner.label()


def test_the_default_falls_back_to_dequantizing_where_the_kernels_cannot_run(default_engine):
    """On CUDA or in float16 a .gguf file is dequantized, and the summary says why; asking for gguf
    there is an error naming the fix."""
    model = default_engine.model
    for options in ({"device": "cuda"}, {"dtype": "float16"}):
        engine = EngineConfig(model=model, **options)
        assert engine_quantization(engine, gguf_file=True) is None
        assert "weights dequantized from the .gguf file (kept quantized only" in weights_summary(engine, gguf_file=True)
        with pytest.raises(ValidationError, match=r"engine\.quantization gguf runs torch's CPU|needs dtype bfloat16"):
            EngineConfig(model=model, quantization="gguf", **options)
        assert engine_quantization(EngineConfig(model=model, quantization="none", **options), gguf_file=True) is None
    assert engine_quantization(EngineConfig(model=model, dtype="bfloat16"), gguf_file=True) == "gguf"
    assert engine_quantization(EngineConfig(model=model, quantization="int8"), gguf_file=False) == "int8"


def test_none_is_spelt_the_same_in_yaml_and_on_the_command_line(tmp_path, default_engine):
    path = tmp_path / "config.yaml"
    path.write_text(f"engine: {{model: {default_engine.model}, quantization: none}}\n")
    assert load_config(path).engine.quantization == "none"
    assert translate(["m", "--quantization", "none"])[0] == ["--model", "m", "--quantization", "none"]
    # vLLM's own "None" means unset: the default, said in a note.
    words, notes = translate(["m", "-q", "None"])
    assert words == ["--model", "m"] and any("--quantization none" in note for note in notes)
