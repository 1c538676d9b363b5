"""Log-probabilities in the two shapes of the OpenAI API.

Completions (legacy): parallel lists ``tokens`` / ``token_logprobs`` / ``top_logprobs``
(a token → log-probability map per position) / ``text_offset``; with ``echo`` the prompt's
tokens come first, the very first with ``None`` (nothing precedes it). Chat: a ``content``
list with one entry per token: its text, log-probability, UTF-8 bytes and top alternatives.

Tokens are shown as the text they decode to alone, so a token that is part of a multi-byte
character reads as U+FFFD, as in vLLM. JSON has no -inf: log-probabilities are floored at
-9999.0, vLLM's convention.
"""

from __future__ import annotations

import functools

from hybridlb.checkpoint.tokenizer import Tokenizer
from hybridlb.protocol import TokenLogprobs

FLOOR = -9999.0


class LogprobFormatter:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.text = functools.lru_cache(maxsize=65536)(self._text)

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def completion(self, token_ids: list[int], entries: list[TokenLogprobs | None], offset: int) -> dict:
        """The completions ``logprobs`` object of these tokens, ``offset`` characters into the text."""
        texts = [self.text(t) for t in token_ids]
        offsets = []
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        top = [None if e is None else self._top_map(e) for e in entries]
        return {"tokens": texts, "token_logprobs": [None if e is None else _finite(e.logprob) for e in entries],
                "top_logprobs": top, "text_offset": offsets}

    def _top_map(self, entry: TokenLogprobs) -> dict[str, float]:
        found = {self.text(t): _finite(lp) for t, lp in zip(entry.top_ids, entry.top_logprobs, strict=True)}
        found.setdefault(self.text(entry.token_id), _finite(entry.logprob))  # the chosen token is always listed
        return found

    def chat(self, entries: list[TokenLogprobs]) -> dict:
        """The chat ``logprobs`` object of these tokens."""
        return {"content": [{**self._chat_token(e.token_id, e.logprob),
                             "top_logprobs": [self._chat_token(t, lp) for t, lp in
                                              zip(e.top_ids, e.top_logprobs, strict=True)]}
                            for e in entries]}

    def _chat_token(self, token_id: int, logprob: float) -> dict:
        text = self.text(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}


def _finite(logprob: float) -> float:
    return logprob if logprob > FLOOR else FLOOR
