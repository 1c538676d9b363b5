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
from hybridlb.params import MAX_LOGPROBS, SamplingParams

MAX_PROMPTS = 1024  # prompts in one completion request (each becomes an engine request)
MAX_STOP = 64  # stop strings per request
MAX_STOP_CHARS = 1024  # characters per stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_CHOICES = 128  # n / best_of: sequences per prompt (prompts x sequences stays within MAX_PROMPTS)
MAX_TOOLS = 128
# Fields of OpenAI's and vLLM's APIs hybridlb does not implement, with the value that asks for
# nothing: a request setting anything else gets a 400 naming the field (never silently ignored).
UNSUPPORTED_FIELDS = {
    "logits_processors": (None, "custom logits processors are not implemented; drop it"),
    "use_beam_search": (False, "beam search is not implemented; drop it (or sample with n / best_of)"),
    "length_penalty": (1.0, "length_penalty applies to beam search, which is not implemented; drop it"),
    "prompt_logprobs": (None, "prompt_logprobs is not returned; use /v1/completions with echo and logprobs"),
    "return_tokens_as_token_ids": (False, "tokens are returned as text; use /tokenize for ids"),
    "return_token_ids": (False, "token ids are not returned; use /tokenize"),
    "priority": (0, "priority scheduling is not implemented; drop it"),
    "cache_salt": (None, "per-tenant prefix-cache isolation (cache_salt) is not implemented; drop it, or run "
                         "tenants on separate servers"),
    "kv_transfer_params": (None, "KV transfer (disaggregated prefill) is not implemented; drop it"),
    "vllm_xargs": (None, "vllm_xargs has no meaning here; drop it"),
    "mm_processor_kwargs": (None, "the models served are text-only; drop it"),
    "prompt_embeds": (None, "prompts are text or token ids; drop prompt_embeds"),
    "guided_whitespace_pattern": (None, "set disable_any_whitespace in structured_outputs instead"),
    "chat_template": (None, "a per-request chat template is not accepted; start the server with --chat-template"),
    "functions": (None, "functions is OpenAI's deprecated form; send tools"),
    "function_call": (None, "function_call is OpenAI's deprecated form; send tool_choice"),
    "audio": (None, "the models served are text-only; drop audio"),
    "prediction": (None, "predicted outputs are not implemented; drop prediction"),
    "web_search_options": (None, "web search is not available; drop web_search_options"),
    "store": (False, "stored completions are not kept; drop store"),
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
    continuous_usage_stats: bool = False  # usage (so far) in every chunk, as vLLM sends it


class JsonSchemaFormat(BaseModel):
    name: Text = "response"
    description: Text | None = None
    schema_: dict | bool | None = Field(None, alias="schema")  # None: any JSON (as OpenAI reads it)
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: text, JSON mode, a JSON schema (and vLLM's structural tag)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # vLLM's structural tag (type structural_tag): the tag's own fields
    structures: list[dict] | None = None
    triggers: list[Text] | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of json, regex, choice, grammar, json_object,
    structural_tag; the two switches override the server's for this request."""

    model_config = ConfigDict(extra="forbid")

    json_: dict | bool | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    structural_tag: Text | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    disable_fallback: bool = False  # one backend here: nothing to fall back to
    whitespace_pattern: None = None  # not supported: set disable_any_whitespace


class SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, populate_by_name=True)

    model: Text | None = None  # None: the (first) model this server serves, as vLLM does
    max_tokens: int | None = None
    # Unset sampling fields take the model's generation_config.json defaults, then OpenAI's.
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None  # 0 or -1: off
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
    min_tokens: int = Field(0, ge=0)
    allowed_token_ids: list[Int64] | None = None
    bad_words: list[Text] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # the fast tokenizer's decoding: false is a 400
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # keep the last k prompt tokens (-1: max_model_len)
    # Structured outputs (see hybridlb.api.openai.structured): one of these at most.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | bool | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    guided_decoding_backend: Text | None = None  # must name the server's backend, if given
    request_id: Text | None = Field(None, max_length=128)  # the response id's suffix (vLLM's)

    def check_supported(self) -> None:
        extra = self.model_extra or {}  # not getattr: pydantic raises and catches inside for a missing extra
        for name, (default, what) in UNSUPPORTED_FIELDS.items():
            value = extra.get(name, self.__dict__.get(name))
            if value is not None and value != default and value != []:
                raise APIError(400, f"{name} is not supported: {what}", param=name)
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
        if len(self.stops) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in self.stops):
            raise APIError(400, f"at most {MAX_STOP} stop strings of up to {MAX_STOP_CHARS} characters each",
                           param="stop")
        if len(self.stop_token_ids or []) > MAX_STOP_TOKEN_IDS:
            raise APIError(400, f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids", param="stop_token_ids")
        if not self.spaces_between_special_tokens:
            raise APIError(400, "spaces_between_special_tokens=false is not supported: the fast tokenizer decodes "
                                "special tokens as the model's tokenizer.json says; drop it",
                           param="spaces_between_special_tokens")
        if self.top_k is not None and self.top_k < -1:
            raise APIError(400, f"top_k must be -1 or 0 (off) or positive, got {self.top_k}", param="top_k")

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
        """The request's params; fields it leaves unset come from ``defaults`` (the model's). The
        constraint and bad words (which need the tokenizer and the server's options) come later."""
        sampling = {**(defaults or {}), **{name: getattr(self, name) for name in SAMPLING_KEYS
                                           if getattr(self, name) is not None}}
        if sampling.get("top_k") == -1:
            sampling["top_k"] = 0  # vLLM's "off"
        params = SamplingParams(
            max_tokens=max_tokens, seed=self.seed, stop=self.stops, stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos, presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0, logit_bias=self._logit_bias(), **sampling,
            **self.logprob_params(), min_tokens=self.min_tokens,
            allowed_token_ids=list(self.allowed_token_ids) if self.allowed_token_ids is not None else None,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
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

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

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
    add_special_tokens: bool = True  # the tokenizer's BOS (and the like) before a text prompt

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
