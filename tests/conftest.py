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

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    outputs = []
    for ids in prompt_ids:
        tensor = torch.tensor([ids])
        out = model.generate(tensor, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        outputs.append(out[0, len(ids):].tolist())
    return outputs
