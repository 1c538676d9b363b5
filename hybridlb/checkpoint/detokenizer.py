"""Incremental detokenization with stop strings.

Tokens arrive a few at a time; text must come out as soon as it is whole, never as
half of a multi-byte UTF-8 character, and the concatenation of every delta must be
exactly the final text. Each step decodes only a short window: the tokens since the
last emitted boundary plus the ones before it as context (decoders such as
SentencePiece's strip a leading space at the start of a string, so the context keeps
that space where it belongs).

Stop strings: text that could still turn out to start a stop string is held back until
it cannot; when one matches, the text ends just before it (or after it, with
``include_stop``); with ``min_tokens``, only a match that ends after that many tokens
counts. ``take`` is what a front end calls with each engine output (the API server's
request runner and the offline ``LLM``).
"""

from __future__ import annotations

from hybridlb.checkpoint.tokenizer import Tokenizer
from hybridlb.params import SamplingParams

_PROMPT_CONTEXT = 6
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stop: list[str] | None = None,
                 skip_special_tokens: bool = True, include_stop: bool = False, min_tokens: int = 0):
        """``include_stop``: a matched stop string stays in the text (vLLM's include_stop_str_in_output).
        ``min_tokens``: stop strings count only once they end after that many tokens."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.include_stop = include_stop
        self.min_tokens = min_tokens
        self.num_tokens = 0
        self.ids = list(prompt_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop or []
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # all decoded output text so far (cut at a stop string)
        self.emitted = 0  # how much of self.text has been handed out
        self.stop_string: str | None = None

    @classmethod
    def for_request(cls, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer:
        """The detokenizer a request's sampling params ask for (stops, special tokens, min_tokens)."""
        return cls(tokenizer, prompt_ids, params.stop, params.skip_special_tokens, params.include_stop_str_in_output,
                   params.min_tokens)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, self.skip_special_tokens)

    def _advance(self) -> None:
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
            self._append(full[len(prefix) :])
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)

    def _append(self, new_text: str) -> None:
        # A match that involves new text starts at most `hold` characters before it.
        searched_from = max(0, len(self.text) - self.hold)
        self.text += new_text
        if self.num_tokens < self.min_tokens:
            return
        hits = [(at, s) for s in self.stop if (at := self.text.find(s, searched_from)) != -1]
        if hits:
            at, self.stop_string = min(hits)
            self.text = self.text[: at + len(self.stop_string) if self.include_stop else at]

    def push(self, new_ids: list[int]) -> str:
        """Add tokens; return the text that is now safe to emit ('' if none)."""
        if self.stop_string is not None:
            return ""
        self.ids.extend(new_ids)
        self.num_tokens += len(new_ids)
        self._advance()
        safe = len(self.text) if self.stop_string is not None else len(self.text) - self.hold
        return self._emit(max(safe, self.emitted))

    def take(self, new_ids: list[int], finish_reason: str | None) -> tuple[str, str | None]:
        """One engine output: (the text now safe to emit, the request's finish reason). A matched
        stop string finishes it with "stop" (the front end aborts it in the engine); when the
        engine finished it, the text held back comes out too."""
        text = self.push(new_ids)
        if self.stopped:
            return text, "stop"
        if finish_reason is not None:
            text += self.finish()
        return text, finish_reason

    def finish(self) -> str:
        """The request ended: flush whatever text is still held back."""
        if self.stop_string is None and self.read_offset < len(self.ids):
            full = self._decode(self.ids[self.prefix_offset :])
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            self._append(full[len(prefix) :])
            self.read_offset = len(self.ids)
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        delta = self.text[self.emitted : upto]
        self.emitted = max(self.emitted, upto)
        return delta

    @property
    def stopped(self) -> bool:
        return self.stop_string is not None


def visible(new_ids: list[int], stop_token_id: int | None, params: SamplingParams) -> list[int]:
    """The tokens of an engine output whose text the client sees: not the stop token (eos or one
    of stop_token_ids) that ended the request, unless it asked for stops in the output (vLLM's
    include_stop_str_in_output)."""
    if stop_token_id is not None and new_ids and new_ids[-1] == stop_token_id and not params.include_stop_str_in_output:
        return new_ids[:-1]
    return new_ids
