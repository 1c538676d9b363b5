"""The decode program on the real SmolLM2-135M-Instruct in bfloat16, with its weights in bfloat16,
int8 (int8.c) and 4-bit (the GGUF file's own Q4_1 blocks, int4.c), and with n-gram speculation
(its drafts verified in replayed steps): the replayed steps give exactly the eager forward's tokens
and log-probabilities, alone and batched."""

from __future__ import annotations

import pytest

from hybridlb import LLM, SamplingParams, kernels
from tests.conftest import PROMPTS, SMOLLM2
from tests.real.test_speculative import COPY_PROMPTS, SPEC

K = kernels.load()
BF16 = K is not None and K.bf16_matmul_supported
SUPPORTED = {"bf16": BF16, "int8": BF16 and K.int8_matmul_supported, "gguf": BF16 and K.int4_matmul_supported,
             "speculative": BF16}


def run(case: str, eager: bool):
    # bf16 and speculative: the file dequantized (its dense path; the gguf case is its 4-bit one)
    options = {"quantization": case if case in ("int8", "gguf") else "none"}
    if case == "speculative":
        options["speculative"] = SPEC
    llm = LLM(SMOLLM2, dtype="bfloat16", enforce_eager=eager, max_model_len=512, num_kv_blocks=128, **options)
    if case == "speculative":  # every draft as long as its match: draft lengths that follow the measured step
        # times would differ between runs, and in bfloat16 a step's row count changes its sums' rounding
        llm.engine.scheduler.proposer.cost.threshold = lambda batch: 0.0
    prompts = [*COPY_PROMPTS, PROMPTS[1]] if case == "speculative" else PROMPTS[:4]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=2) for n in (20, 12, 28, 6)]
    batched = llm.generate(prompts, params[: len(prompts)])
    alone = llm.generate(prompts[0], params[0])
    tokens = [(r.token_ids, [(p.logprob, p.top_ids, p.top_logprobs) for p in r.logprobs]) for r in batched + alone]
    return tokens, llm.engine.runner.program


@pytest.mark.parametrize("case", ["bf16", "int8", "gguf", "speculative"])
def test_replayed_steps_equal_eager_steps_on_smollm2(case):
    if not SUPPORTED[case]:
        pytest.skip("this CPU runs these weights' matmuls off the C kernels (no AVX-512 BF16 / VNNI)")
    replayed, program = run(case, eager=False)
    eager, no_program = run(case, eager=True)
    assert no_program is None
    assert sum(len(set(tokens)) for tokens, _ in replayed) >= 20, "degenerate output"
    assert replayed == eager
    if case == "speculative":  # replayed steps verify drafts: over two rows a step on average (101 / 38 here)
        assert program.steps >= 8 and program.rows >= 2 * program.steps
    else:  # every step after the prompts: 27 batched, 19 alone
        assert program.steps >= 40
