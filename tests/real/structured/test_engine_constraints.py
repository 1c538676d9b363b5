"""Constraints inside the engine, on the real SmolLM2 (offline ``LLM``, one process): the mask
path leaves sampling alone where the grammar allows everything, constrained and free requests
share batches, and the grammar survives preemption; min_tokens, allowed_token_ids and
bad_words restrict what they say."""

from __future__ import annotations

import json
import re

import pytest

from hybridlb.llm import LLM
from hybridlb.params import Constraint, SamplingParams
from tests.conftest import SMOLLM2

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm():
    # A request alone and batched must give the same tokens: float32, and the file dequantized. Kept 4-bit,
    # the output layer stays a float32 matmul whose 1-row and 2-row results differ in the last bits on an
    # AVX2-only EPYC, and a near-tie there moved a free request's 22nd token.
    return LLM(SMOLLM2, max_model_len=512, num_kv_blocks=256, dtype="float32", quantization="none")


def _prompt(llm, text: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def test_a_grammar_that_allows_everything_changes_no_token(llm):
    prompts = [_prompt(llm, "Tell me about Paris."), _prompt(llm, "Write a haiku about rain.")]
    free = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0))
    anything = SamplingParams(max_tokens=40, temperature=0, constraint=Constraint("regex", r"(.|\n)*"))
    masked = llm.generate(prompts, anything)
    assert [o.token_ids for o in masked] == [o.token_ids for o in free]
    seeded = SamplingParams(max_tokens=40, temperature=0.8, seed=7)
    assert llm.generate(prompts, seeded)[0].token_ids == llm.generate(
        prompts, SamplingParams(max_tokens=40, temperature=0.8, seed=7, constraint=anything.constraint))[0].token_ids


def test_constrained_and_free_requests_share_a_batch(llm):
    prompt = _prompt(llm, "Describe a person.")
    json_params = SamplingParams(max_tokens=80, temperature=0, constraint=Constraint("json", json.dumps(SCHEMA)))
    free_params = SamplingParams(max_tokens=30, temperature=0)
    alone = llm.generate([prompt], free_params)[0].token_ids
    outputs = llm.generate([prompt] * 4, [json_params, free_params, json_params, free_params])
    for output in outputs[0::2]:
        assert output.finish_reason == "stop"
        value = json.loads(output.text)
        assert set(value) == {"name", "age"} and 0 <= value["age"] <= 120
    assert [o.token_ids for o in outputs[1::2]] == [alone, alone]


def test_regex_choice_and_a_grammar_finish_when_complete(llm):
    prompt = _prompt(llm, "Give me a phone number.")
    outputs = llm.generate([prompt] * 3, [
        SamplingParams(max_tokens=30, temperature=0, constraint=Constraint("regex", r"\d{3}-\d{4}")),
        SamplingParams(max_tokens=30, temperature=0, constraint=Constraint("choice", '["yes", "no", "maybe"]')),
        SamplingParams(max_tokens=30, temperature=0,
                       constraint=Constraint("grammar", 'start: "(" NUM ")"\nNUM: /[0-9]+/')),
    ])
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", outputs[0].text) and outputs[0].finish_reason == "stop"
    assert outputs[1].text in {"yes", "no", "maybe"} and outputs[1].finish_reason == "stop"
    assert re.fullmatch(r"\([0-9]+\)", outputs[2].text)


def test_the_grammar_survives_preemption():
    """A KV cache too small for every request at once preempts some; recomputed, they stay valid JSON."""
    small = LLM(SMOLLM2, max_model_len=128, num_kv_blocks=12, block_size=16, dtype="bfloat16", prefix_caching=False)
    prompt = _prompt(small, "Describe a person as JSON.")
    params = [SamplingParams(max_tokens=60, temperature=0.9, seed=s, constraint=Constraint("json", json.dumps(SCHEMA)))
              for s in range(6)]
    outputs = small.generate([prompt] * 6, params)
    assert small.engine.scheduler.num_preemptions > 0
    for output in outputs:
        if output.finish_reason == "stop":
            assert set(json.loads(output.text)) == {"name", "age"}


def test_min_tokens_allowed_token_ids_and_bad_words(llm):
    prompt = _prompt(llm, "Say hi.")
    short = llm.generate([prompt], SamplingParams(max_tokens=50, temperature=0))[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 40
    longer = llm.generate([prompt], SamplingParams(max_tokens=50, temperature=0, min_tokens=40))[0]
    assert len(longer.token_ids) >= 40
    allowed = list(range(300, 340))
    limited = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=1.0, seed=1,
                                                    allowed_token_ids=allowed))[0]
    assert set(limited.token_ids) <= set(allowed)
    first = short.token_ids[0]
    banned = llm.generate([prompt], SamplingParams(max_tokens=5, temperature=0, bad_words=[[first]]))[0]
    assert first not in banned.token_ids
    pair = short.token_ids[:2]
    after = llm.generate([prompt], SamplingParams(max_tokens=5, temperature=0, bad_words=[pair]))[0]
    assert after.token_ids[0] == pair[0] and after.token_ids[1] != pair[1]  # only the completing token is banned


def test_an_invalid_constraint_is_the_callers_error(llm):
    with pytest.raises(ValueError, match="unclosed group"):
        llm.generate(["x"], SamplingParams(max_tokens=4, constraint=Constraint("regex", "(ab")))


def test_a_reasoning_models_grammar_starts_after_its_thinking_or_at_once(llm):
    """``after``: free text until ``</think>``, then the grammar. ``opener`` (Qwen3): an output
    that opens ``<think>`` thinks first; one that does not is constrained from its first token."""
    tok = llm.tokenizer
    opener, end = tok.encode("<think>", add_special_tokens=False), tok.encode("</think>", add_special_tokens=False)
    prompt = _prompt(llm, "Describe a person.")
    regex = r"[a-z]{2,6}"

    def run(opener_ids, bias):
        constraint = Constraint("regex", regex, after=end, opener=opener_ids)
        return llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, constraint=constraint,
                                                     logit_bias=bias))[0]

    at_once = run(opener, {opener[0]: -100.0})
    assert at_once.finish_reason == "stop" and re.fullmatch(regex, at_once.text), at_once.text
    thinking = run(opener, {opener[0]: 100.0})
    assert thinking.text.startswith("<think>") and thinking.finish_reason == "length", thinking.text
    waiting = run([], {})  # no opener: nothing constrained before </think>, which SmolLM2 never writes
    assert not re.fullmatch(regex, waiting.text) and waiting.finish_reason == "length", waiting.text


def test_the_xgrammar_backend_gives_valid_json_too():
    """``engine.structured_outputs.backend: xgrammar``: the same request, the same guarantee."""
    other = LLM(SMOLLM2, max_model_len=512, num_kv_blocks=64, dtype="float32",
                structured_outputs={"backend": "xgrammar"})
    params = SamplingParams(max_tokens=80, temperature=0.8, seed=3, constraint=Constraint("json", json.dumps(SCHEMA)))
    outputs = other.generate([_prompt(other, "Describe a person.")] * 3, params)
    for output in outputs:
        value = json.loads(output.text)
        assert output.finish_reason == "stop" and set(value) == {"name", "age"}, output.text
