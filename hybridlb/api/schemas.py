"""Request bodies of the OpenAI endpoints and their mapping to SamplingParams.

Fields hybridlb does not implement are rejected with a 400 naming them rather than
silently ignored; unknown extra fields are allowed (clients send many), as OpenAI does.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from hybridlb.api.errors import APIError
from hybridlb.protocol import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: bool | int | None = None

    def check_supported(self) -> None:
        if self.n != 1:
            raise APIError(400, f"n={self.n} is not supported; only n=1", param="n")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported; leave it at 0", param=name)
        if self.logprobs:
            raise APIError(400, "logprobs are not supported", param="logprobs")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        params = SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            seed=self.seed, stop=stop, stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
        )
        for param, message in params.problems():
            raise APIError(400, message, param=param)
        return params

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        for name in ("echo", "suffix"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported", param=name)
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of is not supported", param="best_of")

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request: texts or token-id lists (OpenAI allows batches)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if all(isinstance(p, int) for p in prompt):
            return [prompt]
        return list(prompt)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
