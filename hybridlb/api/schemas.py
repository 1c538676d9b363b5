"""Request bodies of the OpenAI endpoints and their mapping to SamplingParams.

Fields hybridlb does not implement are rejected with a 400 naming them rather than
silently ignored; unknown extra fields are allowed (clients send many), as OpenAI does.
Everything that reaches an engine is bounded here: integers fit the wire (int64), floats
are finite, text is valid unicode, and a request has at most ``MAX_PROMPTS`` prompts and
``MAX_STOP`` stop strings of ``MAX_STOP_CHARS`` — which also bounds the size of an
engine's input messages (``hybridlb.protocol.engine_input_limit``).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from hybridlb.api.errors import APIError
from hybridlb.checkpoint.generation_config import SAMPLING_KEYS
from hybridlb.protocol import MAX_LOGPROBS, SamplingParams

MAX_PROMPTS = 1024  # prompts in one completion request (each becomes an engine request)
MAX_STOP = 64  # stop strings per request
MAX_STOP_CHARS = 1024  # characters per stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_CHOICES = 128  # n / best_of: sequences per prompt (prompts x sequences stays within MAX_PROMPTS)
# Fields of OpenAI's API hybridlb does not implement: a request setting one gets a 400 naming it.
UNSUPPORTED_FIELDS = {
    "response_format": "structured output (JSON schema / JSON mode) is not implemented; drop it (or send "
                       "{\"type\": \"text\"})",
    "guided_json": "guided decoding is not implemented; drop it",
    "guided_regex": "guided decoding is not implemented; drop it",
    "guided_choice": "guided decoding is not implemented; drop it",
    "logits_processors": "custom logits processors are not implemented; drop it",
}


def _valid_unicode(text: str) -> str:
    try:
        text.encode()
    except UnicodeEncodeError:
        raise ValueError("text must be valid unicode; it contains a lone surrogate") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]  # what the wire (msgpack) carries


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: Text | None = None  # None: the (first) model this server serves, as vLLM does
    max_tokens: int | None = None
    # Unset sampling fields take the model's generation_config.json defaults, then OpenAI's.
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    repetition_penalty: float | None = None
    n: int | None = Field(1, ge=1, le=MAX_CHOICES)
    seed: Int64 | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[Int64] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string, as OpenAI sends it) -> bias

    def check_supported(self) -> None:
        extra = self.model_extra or {}  # not getattr: pydantic raises and catches inside for a missing extra
        for name, what in UNSUPPORTED_FIELDS.items():
            value = extra.get(name, self.__dict__.get(name))
            if value is not None and not (name == "response_format" and value == {"type": "text"}):
                raise APIError(400, f"{name} is not supported: {what}", param=name)
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
        if len(self.stops) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in self.stops):
            raise APIError(400, f"at most {MAX_STOP} stop strings of up to {MAX_STOP_CHARS} characters each",
                           param="stop")
        if len(self.stop_token_ids or []) > MAX_STOP_TOKEN_IDS:
            raise APIError(400, f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids", param="stop_token_ids")

    @property
    def choices(self) -> int:
        """Sequences returned per prompt (``n``; null means 1)."""
        return self.n or 1

    @property
    def candidates(self) -> int:
        """Sequences generated per prompt (best_of for completions, else n)."""
        return self.choices

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def sampling_params(self, max_tokens: int | None, defaults: dict | None = None) -> SamplingParams:
        """The request's params; fields it leaves unset come from ``defaults`` (the model's)."""
        sampling = {**(defaults or {}), **{name: getattr(self, name) for name in SAMPLING_KEYS
                                           if getattr(self, name) is not None}}
        params = SamplingParams(
            max_tokens=max_tokens, seed=self.seed, stop=self.stops, stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos, presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0, logit_bias=self._logit_bias(), **sampling,
            **self.logprob_params(),
        )
        for param, message in params.problems():
            raise APIError(400, message, param=param)
        return params

    def _logit_bias(self) -> dict[int, float]:
        try:
            return {int(token): bias for token, bias in (self.logit_bias or {}).items()}
        except ValueError:
            raise APIError(400, "logit_bias keys must be token ids (integers as strings)", param="logit_bias") from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def logprob_params(self) -> dict:
        """SamplingParams.logprobs / prompt_logprobs for what this request asks to be shown."""
        return {}

    @property
    def wants_logprobs(self) -> bool:
        """Whether the response shows log-probabilities."""
        return False


class CompletionRequest(SamplingRequest):
    prompt: Text | list[Text] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    # The top alternatives shown per token (0: only the token's own); with echo, the prompt's too.
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    suffix: Text | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of < self.choices:
            raise APIError(400, f"best_of ({self.best_of}) must be at least n ({self.choices})", param="best_of")
        if self.stream and self.candidates > self.choices:
            raise APIError(400, "best_of > n cannot stream: the best are known only at the end", param="best_of")

    @property
    def candidates(self) -> int:
        return self.best_of or self.choices

    def logprob_params(self) -> dict:
        if self.logprobs is None:
            return {"logprobs": 0} if self.candidates > self.choices else {}  # best_of ranks by log-probability
        return {"logprobs": self.logprobs, "prompt_logprobs": self.logprobs if self.echo else None}

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request: texts or token-id lists (OpenAI allows batches)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if all(isinstance(p, int) for p in prompt):
            return [prompt]
        if len(prompt) > MAX_PROMPTS:
            raise APIError(400, f"at most {MAX_PROMPTS} prompts in one request, got {len(prompt)}", param="prompt")
        return list(prompt)


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # Passed to the chat template as transformers passes them (tool calls in the output are
    # returned as text: there is no tool-call parser).
    tools: list[dict] | None = None
    tool_choice: Text | dict | None = None  # none or auto (anything else is a 400 naming it)
    documents: list[dict] | None = None
    chat_template_kwargs: dict | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tool_choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice can only be none or auto: tools reach the chat template, and tool "
                                "calls come back as the model's text (there is no tool-call parser)",
                           param="tool_choice")
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")

    def logprob_params(self) -> dict:
        return {"logprobs": self.top_logprobs or 0} if self.logprobs else {}

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.logprobs)

    def template_arguments(self) -> dict:
        """Keyword arguments for Tokenizer.apply_chat_template."""
        return {**(self.chat_template_kwargs or {}), "tools": self.tools, "documents": self.documents}

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
