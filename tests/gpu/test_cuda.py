"""The same engine on CUDA: float32 greedy tokens equal the CPU run. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from hybridlb import LLM, SamplingParams
from tests.conftest import PROMPTS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("arch", ["qwen3", "mixtral"])
def test_cuda_greedy_matches_cpu(checkpoints, arch):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    options = dict(max_model_len=256, num_kv_blocks=64, dtype="float32")
    cpu = LLM(checkpoints(arch), device="cpu", **options).generate(PROMPTS, params)
    cuda = LLM(checkpoints(arch), device="cuda", **options).generate(PROMPTS, params)
    assert [o.token_ids for o in cuda] == [o.token_ids for o in cpu]


def test_cuda_auto_dtype_is_bfloat16(checkpoints):
    llm = LLM(checkpoints("qwen3"), device="cuda", max_model_len=256, num_kv_blocks=64)
    assert llm.engine.runner.dtype == torch.bfloat16
    out = llm.generate("GPU", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 8
