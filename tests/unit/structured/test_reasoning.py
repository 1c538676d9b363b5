"""<think>...</think> split off as reasoning, whole and streamed, for both parsers."""

from __future__ import annotations

import random

import pytest

from hybridlb.api.openai.reasoning import ReasoningStream, reasoning_ended, split

CASES = [
    ("deepseek_r1", "<think>\nadd 2 and 2\n</think>\n\nThe answer is 4.", "\nadd 2 and 2\n", "\n\nThe answer is 4."),
    ("deepseek_r1", "add 2 and 2</think>4", "add 2 and 2", "4"),  # the template opened <think>
    ("deepseek_r1", "still thinking", "still thinking", None),
    ("qwen3", "<think>hmm</think>4", "hmm", "4"),
    ("qwen3", "4, without thinking", None, "4, without thinking"),
    ("qwen3", "<think>cut off", "cut off", None),
]


@pytest.mark.parametrize(("kind", "text", "reasoning", "content"), CASES)
def test_whole_and_streamed_agree(kind, text, reasoning, content):
    assert split(kind, text) == (reasoning, content)
    for seed in range(6):
        rng, stream, got, at = random.Random(seed), ReasoningStream(kind), ["", ""], 0
        while at < len(text):
            size = rng.randint(1, 5)
            thought, said = stream.push(text[at : at + size], final=at + size >= len(text))
            got[0], got[1], at = got[0] + thought, got[1] + said, at + size
        assert (got[0] or None, got[1] or None) == (reasoning, content), seed


def test_a_prompt_that_closed_the_reasoning_constrains_from_the_start():
    assert reasoning_ended("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking switched off
    assert not reasoning_ended("<|im_start|>assistant\n<think>\n")
    assert not reasoning_ended("<|im_start|>assistant\n")
