"""Shared fixtures (one tiny checkpoint per architecture per test session, the real SmolLM2 and
transformers' reference) and the tiers: each test is marked with the folder under tests/ it lives
in, and the tiers run in order, fastest first (docs/testing.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridlb.model.make_model import make_model
from hybridlb.testing.models import SMOLLM2, load_smollm2_transformers, save_hf_dir  # noqa: F401 - SMOLLM2: tests' import

# unit: in-process, no subprocess, no Ray (tests/unit/conftest.py enforces it); process: one engine
# or one `serve` tree; cluster: several ranks or nodes, Ray, namespaces, gateways, chaos; real: the
# real SmolLM2 against transformers, lm-eval, peft; gpu: CUDA only; vllm: vLLM's engine as the backend
# (its own venv and CI step).
TIERS = ("unit", "process", "cluster", "real", "gpu", "vllm")
_ROOT = Path(__file__).parent


def tier_of(item: pytest.Item) -> str:
    folder = Path(str(item.path)).relative_to(_ROOT).parts[0]
    if folder not in TIERS:
        raise pytest.UsageError(f"{item.nodeid}: a test lives in one of tests/{{{','.join(TIERS)}}}/")
    return folder


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(tier_of(item))
    items.sort(key=lambda item: TIERS.index(tier_of(item)))  # stable: each file keeps its order


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


REAL_NEW_TOKENS = 32


@pytest.fixture(scope="session")
def smollm2_transformers():
    """transformers' own float32 load of the GGUF file: the reference (model, tokenizer)."""
    return load_smollm2_transformers()


@pytest.fixture(scope="session")
def smollm2_hf_dir(smollm2_transformers, tmp_path_factory) -> str:
    """SmolLM2 as transformers 5 saves it: no lm_head tensor (tied), chat_template.jinja."""
    return save_hf_dir(*smollm2_transformers, tmp_path_factory.mktemp("smollm2-hf"))


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
    """The random Llama the GGUF tests write in each GGML type (hybridlb/testing/gguf_writer.py)."""
    from hybridlb.model.make_model import make_model

    return make_model("llama", "tiny", tmp_path_factory.mktemp("llama256") / "m", seed=2, dims=GGUF_DIMS)


@pytest.fixture
def context():
    """A ZMQ context of the test's own, for raw sockets that speak to a server's (closed at the end)."""
    import zmq

    context = zmq.Context()
    yield context
    context.destroy(linger=0)
