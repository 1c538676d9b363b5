"""The decode program (hybridlb/model/decode_program.py): decode steps replayed as one C call give
exactly the eager forward's tokens and log-probabilities; steps with prompt chunks run eagerly;
models it does not cover say why and run eagerly. Random checkpoints here; the real SmolLM2-135M
(bfloat16, int8 and 4-bit weights) in tests/real/test_decode_program.py."""

from __future__ import annotations

import pytest

from hybridlb import LLM, SamplingParams, kernels
from hybridlb.model.decode_program import unsupported

K = kernels.load()
PROGRAM = pytest.mark.skipif(K is None or not K.bf16_matmul_supported,
                             reason="the decode program runs bf16.c's matmuls: a CPU with AVX-512 BF16")
PROMPTS = [[5, 9, 17, 33, 2], [7] * 40, [11, 13, 19], list(range(3, 90))]


def generate(model: str, eager: bool, **options) -> tuple[list, LLM]:
    """Greedy tokens with top-3 log-probabilities; each prompt stops at its own length, so the batch shrinks;
    a 32-token step budget chunks the long prompts while the short ones decode (mixed steps)."""
    llm = LLM(model, dtype="bfloat16", enforce_eager=eager, num_kv_blocks=64, max_model_len=256,
              max_num_batched_tokens=32, **options)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=3) for n in (24, 9, 17, 30)]
    results = llm.generate(PROMPTS, params)
    return [(r.token_ids, [(p.logprob, p.top_ids, p.top_logprobs) for p in r.logprobs]) for r in results], llm


@PROGRAM
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: the q/k/v projection has a bias
def test_replayed_decode_steps_equal_eager_steps_exactly(checkpoints, arch):
    replayed, llm = generate(checkpoints(arch), eager=False)
    eager, eager_llm = generate(checkpoints(arch), eager=True)
    assert eager_llm.engine.runner.program is None
    program = llm.engine.runner.program
    assert program is not None and program.steps >= 20  # most of the 30 steps after the prompts
    assert replayed == eager


def test_models_the_program_does_not_cover_say_why_and_run_eagerly(checkpoints):
    llm = LLM(checkpoints("qwen3"), dtype="bfloat16", num_kv_blocks=16, max_model_len=256)
    runner = llm.engine.runner
    assert runner.program is None
    if runner.kernels is not None:
        assert unsupported(runner.model, runner.kernels) == "layer 0 normalises q and k per head"
    float32 = LLM(checkpoints("llama"), dtype="float32", num_kv_blocks=16, max_model_len=256).engine.runner
    assert float32.program is None
    if K is not None:
        assert "the model runs in torch.float32" in unsupported(float32.model, float32.kernels or K)
    moe = LLM(checkpoints("mixtral"), dtype="bfloat16", num_kv_blocks=16, max_model_len=256).engine.runner
    assert moe.program is None
    if moe.kernels is not None:
        assert unsupported(moe.model, moe.kernels) == "layer 0 is a mixture of experts"
    assert llm.generate([5, 6, 7], SamplingParams(max_tokens=4, temperature=0))[0].token_ids
