"""lm-evaluation-harness against the real-model server, as its users run it: `lm_eval --model
local-completions` on the repository's local tasks (tests/real/evals), loglikelihood and
generate_until. Each scored choice's log-likelihood equals transformers' (float32) for the
same tokens, and each generation equals transformers' greedy text. The run: tests/real/conftest.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lm_eval")


def test_loglikelihoods_equal_transformers(lm_eval_run, smollm2_transformers):
    model, tokenizer = smollm2_transformers
    samples = lm_eval_run["hybridlb_smoke_mc"]
    assert len(samples) == 50
    checked = 0
    for sample in samples[:12]:  # 48 (context, continuation) pairs
        for request, response in zip(sample["arguments"].values(), sample["resps"], strict=True):
            context, continuation = request["arg_0"], request["arg_1"]
            assert continuation.startswith(" ") and not continuation.startswith("  ")
            context_ids = tokenizer.encode(context)
            whole = tokenizer.encode(context + continuation)
            assert whole[: len(context_ids)] == context_ids
            with torch.no_grad():
                logits = model(torch.tensor([whole])).logits[0].float()
            logprobs = torch.log_softmax(logits, dim=-1)
            expected = sum(logprobs[p - 1, whole[p]].item() for p in range(len(context_ids), len(whole)))
            served = float(response[0][0])
            assert abs(served - expected) < 1e-3, (context, continuation, served, expected)
            checked += 1
    assert checked == 48
    assert 0.0 <= lm_eval_run["results"]["hybridlb_smoke_mc"]["acc,none"] <= 1.0


def test_generations_equal_transformers_greedy(lm_eval_run, smollm2_transformers):
    model, tokenizer = smollm2_transformers
    samples = lm_eval_run["hybridlb_smoke_gen"]
    assert len(samples) == 50
    for sample in samples[:6]:
        context = sample["arguments"]["gen_args_0"]["arg_0"]
        ids = tokenizer.encode(context)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=0)
        text = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
        expected = min((text.split(stop)[0] for stop in ("\n", ".")), key=len)
        assert sample["resps"][0][0] == expected, (context, sample["resps"][0][0], text)
    assert "exact_match,none" in lm_eval_run["results"]["hybridlb_smoke_gen"]
