"""Speculative decoding's parts that need no model: n-gram proposals, vLLM's --speculative-config
spellings and their errors, and the scheduler's draft budget (the real-model checks are in
tests/real/test_speculative.py)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from hybridlb.config import EngineConfig, SpeculativeConfig
from hybridlb.engine.block_manager import BlockManager
from hybridlb.engine.request import Request
from hybridlb.engine.scheduler import Scheduler
from hybridlb.engine.speculative import NgramProposer, StepCost
from hybridlb.params import SamplingParams


def _proposer(k=4, longest=3, shortest=2) -> NgramProposer:
    return NgramProposer(SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_max=longest,
                                           prompt_lookup_min=shortest))


def test_proposals_follow_the_longest_latest_match():
    propose = _proposer().propose
    tokens = [1, 2, 3, 9, 8, 0, 2, 3, 7, 6, 0, 1, 2, 3]
    assert propose(tokens, 10) == [9, 8, 0, 2]  # "1 2 3" (3 tokens) beats the later "2 3"
    assert propose([*tokens[:-3], 5, 2, 3], 10) == [7, 6, 0, 5]  # only "2 3" matches: its latest occurrence
    assert propose(tokens, 2) == [9, 8]  # the caller's limit (max_tokens, the step's budget)
    assert propose([4, 5, 6, 7], 10) == []  # no earlier occurrence
    assert propose([5, 6, 1, 5, 6], 10) == [1, 5, 6]  # up to the end of what is there
    assert _proposer(shortest=3).propose([7, 2, 3, 4, 1, 2, 3], 10) == []  # "2 3" is under prompt_lookup_min


def test_vllm_spellings_and_errors_name_the_fix():
    config = SpeculativeConfig.model_validate({"model": "[ngram]", "num_speculative_tokens": 3})
    assert (config.method, config.prompt_lookup_min, config.prompt_lookup_max) == ("ngram", 5, 5)  # vLLM's defaults
    config = SpeculativeConfig.model_validate({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (2, 2)
    with pytest.raises(ValidationError, match=r"method 'eagle': hybridlb speculates by n-gram prompt lookup only"):
        SpeculativeConfig.model_validate({"method": "eagle", "model": "some/drafter", "num_speculative_tokens": 3})
    with pytest.raises(ValidationError, match=r"prompt_lookup_min \(5\) is above prompt_lookup_max \(2\)"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=5, prompt_lookup_max=2)
    with pytest.raises(ValidationError, match=r"engine\.simulate has no model to check drafts"):
        EngineConfig(model="m", simulate={"step_ms": 1}, speculative={"method": "ngram", "num_speculative_tokens": 2})


def test_drafts_fit_the_budget_max_tokens_and_free_blocks():
    """A draft never takes more than the step's leftover budget, never runs past max_tokens, and
    never preempts anyone: with too few free blocks it is cut short."""
    blocks = BlockManager(num_blocks=4, block_size=4, caching=False)
    scheduler = Scheduler(max_num_seqs=4, max_num_batched_tokens=16, block_manager=blocks,
                          proposer=_proposer(k=8, longest=2, shortest=1))
    request = Request("a", [1, 2, 3, 4, 5, 6, 1, 2], SamplingParams(max_tokens=5), 5, None)
    scheduler.add(request)
    (prefill,) = scheduler.schedule()
    assert prefill.num_tokens == 8 and not prefill.draft  # prompts never draft
    request.num_computed = 8
    request.token_ids.append(3)  # the first output: "2 3" occurred earlier, followed by 4 5 6 1 2 3
    (decode,) = scheduler.schedule()
    assert decode.draft == [4, 5, 6] and decode.num_tokens == 4  # 5 max_tokens: 1 out, 3 drafted, 1 past them
    assert decode.token_ids == [3, 4, 5, 6] and decode.samples
    assert len(request.block_ids) == 3  # 12 positions: every draft token has its KV slot
    scheduler.finish(request)
    other = Request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1], SamplingParams(max_tokens=20), 20, None)
    scheduler.add(other)
    scheduler.schedule()
    other.num_computed = 12
    other.token_ids.append(2)
    (decode,) = scheduler.schedule()  # "1 2" matched: 8 tokens proposed, but 1 block of 4 is left
    assert decode.draft == [3, 4, 5] and len(other.block_ids) == 4 and other.status.value == "running"


def test_a_draft_never_takes_the_block_another_request_needs():
    blocks = BlockManager(num_blocks=4, block_size=4, caching=False)
    scheduler = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, block_manager=blocks,
                          proposer=_proposer(k=4, longest=2, shortest=2))
    first = Request("a", [1, 2, 3, 4, 1, 2, 3], SamplingParams(max_tokens=20), 20, None)
    second = Request("b", [5, 6, 7, 8], SamplingParams(max_tokens=20), 20, None)
    for request in (first, second):
        scheduler.add(request)
    scheduler.schedule()  # both prompts: 3 of 4 blocks
    for request in (first, second):
        request.num_computed = request.num_tokens
        request.token_ids.append(4)
    chunks = scheduler.schedule()  # "3 4" matched for the first, but the last block is the second's next token
    assert [c.request.request_id for c in chunks] == ["a", "b"] and scheduler.num_preemptions == 0
    assert chunks[0].draft == []


def _timed(cost: StepCost, curve, rows: list[int]) -> None:
    for n in rows:
        cost.timed(n, curve(n) / 1000)


def _cpu_step_ms(rows: int) -> float:
    """A decode step here: flat while it streams the weights, ~0.6 ms a row beyond 16 rows."""
    return 20 + 0.6 * max(rows - 16, 0)


def test_the_step_cost_is_learnt_from_decode_steps():
    """While a step streams the weights its rows are free and any draft pays; where every row
    costs as much as the rest of the step, a draft token pays only if it surely holds; where
    the step turns compute-bound, a row costs what the slope above says."""
    flat, dear, cpu = StepCost(), StepCost(), StepCost()
    _timed(flat, lambda n: 20.0, [16, 40, 1, 5] * 5)
    _timed(dear, lambda n: 1.0 * n, [16, 40, 1, 5] * 5)
    _timed(cpu, _cpu_step_ms, [1, 5, 16, 40, 80] * 5)
    assert flat.threshold(16) == 0 and flat.threshold(1) == 0
    assert dear.threshold(16) == pytest.approx(1) and dear.threshold(1) == pytest.approx(1)
    assert cpu.threshold(1) == 0 and cpu.threshold(16) == pytest.approx(0.6 * 16 / 20, rel=0.05)
    assert StepCost().threshold(16) == pytest.approx(16 / 46)  # nothing measured yet: the prior


def test_drafts_are_as_long_as_they_pay_and_probe_after_misses():
    """At batch 1 a row is free: a request drafts all k tokens whatever its misses. In a batch of
    16 whose rows cost 0.6 ms against a 20 ms step, a new request drafts one token, drafts that
    keep missing shrink to nothing, then one-token probes come after 3, 15, 63 decode steps; hits
    bring back full drafts."""
    proposer = _proposer(k=4, longest=2, shortest=2)
    _timed(proposer.cost, _cpu_step_ms, [1, 5, 16, 40, 80] * 5)
    request = Request("a", [1, 2, 3, 4, 5, 6, 1, 2], SamplingParams(max_tokens=50), 50, None)

    def drafts(steps: int, batch: int) -> list[int]:
        return [len(proposer.draft(request, 10, batch)) for _ in range(steps)]

    assert drafts(1, 1) == [4] and drafts(1, 16) == [1]  # a new request: the engine's prior of 1/2
    proposer.checked(request, drafted=1, accepted=0)
    assert drafts(4, 16) == [0, 0, 0, 1]  # waited 3 steps, then a one-token probe
    proposer.checked(request, drafted=1, accepted=0)
    assert drafts(16, 16) == [0] * 15 + [1]  # then 15
    proposer.checked(request, drafted=1, accepted=0)
    assert request.draft_wait == 63 and drafts(1, 1) == [4]  # a batch of one drafts anyway
    for _ in range(3):
        proposer.checked(request, drafted=4, accepted=4)
    assert request.draft_wait == 0 and drafts(1, 16) == [4]  # drafts that hold: full length again
