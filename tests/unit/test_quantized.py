"""Weights kept quantized (engine.quantization, vLLM's --quantization): the layers hold the codes,
a GGUF file's 4-bit blocks are kept exactly as the file has them, and bad settings are refused
with the fix named. (Real-model agreement and memory: tests/real/test_quantized.py.)"""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from hybridlb import LLM, SamplingParams, kernels
from hybridlb.checkpoint.path import CheckpointError
from hybridlb.cli.vllm_args import FlagError, translate
from hybridlb.config import EngineConfig
from hybridlb.model.quantized import (
    GROUP,
    GROUP_ROWS_MAX,
    Int4Linear,
    Int8Embedding,
    Int8GroupLinear,
    Int8Linear,
    int4_groups,
    int8_groups,
)
from hybridlb.testing.gguf_writer import write_gguf
from tests.conftest import PROMPTS

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _runner(llm: LLM):
    return llm.engine.runner


def _linears(model) -> dict[str, torch.nn.Module]:
    return {name: module for name, module in model.named_modules()
            if name.endswith((".qkv", ".o", ".gate_up", ".down"))}


def test_int8_and_int4_layers_compute_what_their_codes_stand_for():
    torch.manual_seed(0)
    weight, x = torch.randn(96, 128) * 0.05, torch.randn(5, 128)
    for layer in (Int8Linear.from_weight(weight, None, torch.float32),
                  Int4Linear.from_weight(weight, None, torch.float32)):
        dense = layer.dense_weight()
        got = layer(x)
        assert got.dtype == torch.float32
        # 4-bit layers multiply bfloat16 activations into bfloat16 outputs (each rounded by at most 2^-9),
        # on vpdpbusd as two int8 digits in steps of each 32 inputs' max |x| / (127 * 254) (half a step each)
        half_step = x.abs().reshape(5, 4, 32).amax(-1) / (254 * 254)
        bound = 1e-4 if isinstance(layer, Int8Linear) else \
            2**-8 * (x.abs() @ dense.abs().T) + 1.01 * half_step @ dense.abs().reshape(96, 4, 32).sum(-1).T + 1e-6
        assert ((got - x @ dense.T).abs() <= bound).all()
        step = (weight.abs().amax() / 127) if isinstance(layer, Int8Linear) else (weight.amax() - weight.amin()) / 15
        assert (dense - weight).abs().max() <= step / 2 + 1e-6
        assert (dense - weight).abs().max() > 0  # really quantized


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_a_gguf_files_4_bit_blocks_are_kept_exactly(tmp_path, llama256_dir, qtype):
    """Each projection's codes stand for exactly the values the dequantized engine holds (float32):
    the file's own 4-bit grid, q/k rows in rotate-half order, nothing requantized."""
    path = str(write_gguf(llama256_dir, tmp_path / f"model.{qtype}.gguf", qtype))
    kept = LLM(path, max_model_len=256, num_kv_blocks=64, dtype="float32", quantization="gguf")
    plain = LLM(path, max_model_len=256, num_kv_blocks=64, dtype="float32", quantization="none")
    ours, theirs = _linears(_runner(kept).model), _linears(_runner(plain).model)
    assert len(ours) == 4 * len(_runner(kept).model.layers)
    for name, layer in ours.items():
        assert isinstance(layer, Int4Linear), name
        weight = theirs[name].weight
        if layer.kernels is not None:  # int4.c holds the file's codes, scales and lows as they are
            assert torch.equal(layer.dense_weight(), weight), name
        else:  # torch's 4-bit kernel holds scales and zeros in bfloat16, and returns bfloat16
            assert ((layer.dense_weight() - weight).abs() <= _BF16_STEP * (weight.abs() + 8 * _group_max(weight))).all()
    assert all(out.token_ids for out in kept.generate(PROMPTS, GREEDY))


_BF16_STEP = 2**-8  # a bfloat16 rounding (2^-9 of the value), for each of a scale, a zero and the output


def _group_max(weight: torch.Tensor) -> torch.Tensor:
    """Each weight's group's largest magnitude (GROUP inputs of a row): bounds its scale and zero."""
    groups = weight.abs().reshape(weight.shape[0], -1, GROUP).amax(-1, keepdim=True)
    return groups.expand(-1, -1, GROUP).reshape(weight.shape)


@pytest.mark.skipif(not (kernels.load() and kernels.load().int8_matmul_supported),
                    reason="the output layer's codes run on int8.c, which needs AVX-512 VNNI")
@pytest.mark.parametrize("qtype, exact", [("Q8_0", True), ("Q4_0", False)])
def test_a_gguf_files_quantized_output_layer_runs_on_its_codes(tmp_path, llama256_dir, qtype, exact):
    """The output layer (untied here) keeps the file's codes with a scale per 32 inputs: Q8_0's own values
    exactly, other types within half an int8 step. A float32 engine takes every step's logits from the
    codes and holds no dense copy; a bfloat16 one takes steps of more than a few rows from a dense copy of
    the codes' values. (A tied one, whose embedding reads the same codes: SmolLM2 in
    tests/real/test_quantized.py.)"""
    path = str(write_gguf(llama256_dir, tmp_path / f"model.{qtype}.gguf", qtype))
    kept = _runner(LLM(path, max_model_len=256, num_kv_blocks=64, dtype="float32", quantization="gguf")).model
    plain = _runner(LLM(path, max_model_len=256, num_kv_blocks=64, dtype="float32", quantization="none")).model
    assert isinstance(kept.lm_head, Int8GroupLinear) and not kept.spec.tie_word_embeddings
    weight, ours = plain.lm_head.weight, kept.lm_head.dense_weight()
    if exact:
        assert torch.equal(ours, weight)
    else:
        _, scale = int8_groups(weight)
        assert ((ours - weight).abs() <= scale.repeat_interleave(32, dim=1) / 2 + 1e-7).all()
    assert kept.lm_head.dense is None
    for rows in (1, GROUP_ROWS_MAX, GROUP_ROWS_MAX + 1, 20):
        hidden = torch.randn(rows, weight.shape[1])
        assert torch.allclose(kept.logits(hidden), hidden @ ours.T, atol=2e-3, rtol=1e-3), rows
    half = _runner(LLM(path, max_model_len=256, num_kv_blocks=64, dtype="bfloat16", quantization="gguf")).model
    assert half.lm_head.dense is not None
    for rows in (1, GROUP_ROWS_MAX + 1, 20):
        hidden = torch.randn(rows, weight.shape[1]).bfloat16()
        expected = hidden.float() @ ours.bfloat16().float().T  # the dense copy: the codes' values in bfloat16
        assert torch.allclose(half.logits(hidden), expected, atol=2e-2, rtol=1e-2), rows


def test_k_quants_are_regrouped_within_half_a_step(tmp_path, llama256_dir):
    path = str(write_gguf(llama256_dir, tmp_path / "model.Q4_K.gguf", "Q4_K"))
    kept = LLM(path, max_model_len=256, num_kv_blocks=64, dtype="float32", quantization="gguf")
    plain = LLM(path, max_model_len=256, num_kv_blocks=64, dtype="float32", quantization="none")
    theirs = _linears(_runner(plain).model)
    for name, layer in _linears(_runner(kept).model).items():
        assert isinstance(layer, Int4Linear), name
        weight = theirs[name].weight
        _, scale, low = int4_groups(weight)
        error = (layer.dense_weight() - weight).abs().reshape(*scale.shape, -1)
        stored = (low.abs() + 15 * scale) * 2**-11  # int4.c holds each group's scale and low as float16
        if layer.kernels is None:  # torch's kernel: bfloat16 scales, zeros and output
            largest = weight.abs().reshape(*scale.shape, -1).amax(-1)
            stored = _BF16_STEP * (low.abs() + 16 * scale + largest)
        assert (error <= scale[..., None] / 2 + stored[..., None] + 1e-6).all(), name


def test_int8_at_load_quantizes_every_projection(llama256_dir):
    llm = LLM(str(llama256_dir), max_model_len=256, num_kv_blocks=64, dtype="float32", quantization="int8")
    model = _runner(llm).model
    assert all(isinstance(layer, Int8Linear) for layer in _linears(model).values())
    assert isinstance(model.embed, Int8Embedding)
    if kernels.load() and kernels.load().int8_matmul_supported:  # the output layer on Q8_0's grid, within half a step
        plain = LLM(str(llama256_dir), max_model_len=256, num_kv_blocks=64, dtype="float32")
        weight = _runner(plain).model.lm_head.weight
        _, scale = int8_groups(weight)
        assert isinstance(model.lm_head, Int8GroupLinear) and model.lm_head.dense is None
        assert ((model.lm_head.dense_weight() - weight).abs() <= scale.repeat_interleave(32, dim=1) / 2 + 1e-7).all()
    assert llm.generate(PROMPTS[:2], GREEDY)[0].token_ids


def test_bad_quantization_settings_name_the_fix(llama256_dir, tmp_path):
    with pytest.raises(CheckpointError, match=r"not a \.gguf file; use int8 or int4"):
        LLM(str(llama256_dir), quantization="gguf", num_kv_blocks=64, max_model_len=256)
    with pytest.raises(ValidationError, match="needs dtype bfloat16, float32 or auto"):
        EngineConfig(model=str(llama256_dir), quantization="int8", dtype="float16")
    with pytest.raises(ValidationError, match="use device: cpu"):
        EngineConfig(model=str(llama256_dir), quantization="int4", device="cuda")
    with pytest.raises(ValidationError, match="'int8', 'int4', 'gguf' or 'none'"):
        EngineConfig(model=str(llama256_dir), quantization="awq")
    assert translate(["m", "--quantization", "gguf"])[0] == ["--model", "m", "--quantization", "gguf"]
    assert translate(["m", "-q", "int8"])[0] == ["--model", "m", "--quantization", "int8"]
    with pytest.raises(FlagError, match="--quantization awq: hybridlb keeps weights quantized as one of int8"):
        translate(["m", "--quantization", "awq"])


def test_a_shape_the_4_bit_kernel_cannot_take_is_kept_as_int8():
    from hybridlb.model.quantized import quantized_linear

    weight = torch.randn(40, 64)  # 40 output rows: torch packs 4-bit weights in rows of 16
    layer = quantized_linear("int4", weight, None, torch.float32)
    assert isinstance(layer, Int8Linear)
    assert isinstance(quantized_linear("int4", torch.randn(48, 64), None, torch.float32), Int4Linear)
