"""Streaming detokenization: no broken characters, deltas add up to the full text, stops cut cleanly."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridlb.checkpoint.detokenizer import IncrementalDetokenizer
from hybridlb.checkpoint.tokenizer import Tokenizer

TEXT = "Zürich café — naïve 中文字符 and 日本語 with 🚀🎉 emoji, α ≤ β, done."


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3) -> Tokenizer:
    return Tokenizer(tiny_qwen3)


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    deltas = [detok.push([token]) for token in ids]
    return [*deltas, detok.finish()]


def test_multibyte_characters_are_never_split(tokenizer):
    ids = tokenizer.encode(TEXT)
    assert len(ids) > len(TEXT.encode()) // 4, "expected multi-byte characters to span several tokens"
    deltas = _stream(IncrementalDetokenizer(tokenizer, prompt_ids=tokenizer.encode("Say: ")), ids)
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) == TEXT


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(min_value=0, max_value=1023), max_size=40),
       prompt=st.lists(st.integers(min_value=3, max_value=1023), max_size=8))
def test_deltas_always_add_up_to_the_full_decode(tokenizer, ids, prompt):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt)
    streamed = "".join(_stream(detok, ids))
    context = prompt[-6:]
    full = tokenizer.decode(context + ids)
    prefix = tokenizer.decode(context)
    if not prefix.endswith("\ufffd"):  # a context cut mid-character cannot be compared this way
        assert streamed == full[len(prefix):]
    assert streamed == "".join(_stream(IncrementalDetokenizer(tokenizer, prompt_ids=prompt), ids))


def test_stop_string_spanning_tokens_is_cut_and_never_emitted(tokenizer):
    text = "Hello world, stop here please and more words after it"
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=[], stop=["stop here", "never"])
    deltas = []
    for token in tokenizer.encode(text):
        deltas.append(detok.push([token]))
        if detok.stopped:
            break
    deltas.append(detok.finish())
    assert "".join(deltas) == "Hello world, "
    assert detok.stop_string == "stop here"


def test_earliest_of_several_stop_strings_wins(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=[], stop=["gamma", "beta"])
    text = "".join(_stream(detok, tokenizer.encode("alpha beta gamma")))
    assert text == "alpha " and detok.stop_string == "beta"
