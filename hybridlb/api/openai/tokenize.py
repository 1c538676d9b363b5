"""/tokenize, /detokenize and /tokenizer_info as vLLM serves them: a client counts and
inspects tokens with the server's own tokenizer and chat template (lm-evaluation-harness's
remote tokenizer uses all three, and prefers them to loading the tokenizer itself)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, model_validator

from hybridlb.api.errors import APIError
from hybridlb.api.openai.chat_schemas import ChatMessage
from hybridlb.api.openai.context import ApiContext
from hybridlb.api.openai.schemas import Int64, Text


class TokenizeRequest(BaseModel):
    """A ``prompt``, or chat ``messages`` rendered with the chat template first."""

    model_config = ConfigDict(extra="allow")

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (as vLLM)
    add_generation_prompt: bool | None = True
    return_token_strs: bool | None = False
    tools: list[dict] | None = None  # with messages: the tools the chat template lists

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Text | None = None
    tokens: list[Int64]


def tokenize(ctx: ApiContext, body: TokenizeRequest) -> dict:
    tokenizer = ctx.tokenizer
    if body.messages is not None:
        try:
            messages = [m.for_template() for m in body.messages]
            text = tokenizer.apply_chat_template(messages, tools=body.tools,
                                                 add_generation_prompt=body.add_generation_prompt is not False)
        except APIError:
            raise
        except Exception as exc:
            raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from None
        ids = tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))
    else:
        ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    strings = [ctx.logprob_format.text(t) for t in ids] if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": ctx.pool.max_model_len, "tokens": ids, "token_strs": strings}


def detokenize(ctx: ApiContext, body: DetokenizeRequest) -> dict:
    vocab = ctx.tokenizer.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
    return {"prompt": ctx.tokenizer.decode(body.tokens)}


def tokenizer_info(ctx: ApiContext) -> dict:
    tokenizer = ctx.tokenizer
    specials = {name: tokenizer.config.get(name) for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
    return {"tokenizer_class": tokenizer.config.get("tokenizer_class", "PreTrainedTokenizerFast"), **specials,
            "chat_template": tokenizer.chat_template_text, "model_max_length": ctx.pool.max_model_len,
            "vocab_size": tokenizer.vocab_size}
