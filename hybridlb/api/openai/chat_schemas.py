"""The chat completions request body: messages (with tool calls and their results), tools,
tool choice, and what reaches the chat template. Shared fields and bounds are in
``hybridlb.api.openai.schemas``."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from hybridlb.api.errors import APIError
from hybridlb.api.openai.schemas import MAX_TOOLS, SamplingRequest, Text
from hybridlb.params import MAX_LOGPROBS


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class FunctionCall(BaseModel):
    name: Text
    arguments: Text | dict = "{}"  # a JSON object as text (OpenAI); some clients send the object


class ToolCall(BaseModel):
    id: Text | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: Text | None = None  # a tool's result: which call it answers
    reasoning_content: Text | None = None  # an assistant's reasoning (templates that keep it see it)

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict:
        """The message as chat templates read it (transformers' form): tool-call arguments as objects."""
        message: dict = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            message["tool_calls"] = [{"id": call.id, "type": call.type,
                                      "function": {"name": call.function.name,
                                                   "arguments": _arguments(call.function.arguments)}}
                                     for call in self.tool_calls]
        return message


def _arguments(arguments: str | dict) -> dict | str:
    """Tool-call arguments as an object, as templates iterate them (vLLM does the same)."""
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        raise APIError(400, f"tool call arguments must be a JSON object, got {arguments[:80]!r}",
                       param="messages") from None
    if not isinstance(parsed, dict):
        raise APIError(400, "tool call arguments must be a JSON object", param="messages")
    return parsed


class FunctionDefinition(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: Text | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object (none: no arguments)
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: Text


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    # none, auto (needs --enable-auto-tool-choice), required or a named function; default: auto
    # with tools, none without.
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True  # false: at most one call
    documents: list[dict] | None = None
    chat_template_kwargs: dict | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message is continued, not closed
    add_special_tokens: bool = False  # the template writes special tokens itself
    echo: bool = False  # the response's content starts with the last message's (when it is the assistant's)
    include_reasoning: bool = True  # with a reasoning parser: false leaves reasoning_content out
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None  # reaches the chat template
    modalities: list[Literal["text"]] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise APIError(400, "continue_final_message continues the last message: set add_generation_prompt "
                                "to false", param="continue_final_message")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise APIError(400, "continue_final_message needs the last message to be the assistant's",
                           param="continue_final_message")
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in self.tool_names:
            raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools "
                                f"({', '.join(self.tool_names)})", param="tool_choice")
        if len(set(self.tool_names)) < len(self.tool_names):
            raise APIError(400, "tool names must be unique", param="tools")

    @property
    def tool_names(self) -> list[str]:
        return [tool.function.name for tool in self.tools or []]

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: auto when there are tools, none without."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def logprob_params(self) -> dict:
        return {"logprobs": self.top_logprobs or 0} if self.logprobs else {}

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.logprobs)

    def template_messages(self) -> list[dict]:
        return [message.for_template() for message in self.messages]

    def template_arguments(self) -> dict:
        """Keyword arguments for Tokenizer.apply_chat_template."""
        tools = [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None
        extra = {"reasoning_effort": self.reasoning_effort} if self.reasoning_effort else {}
        return {**(self.chat_template_kwargs or {}), **extra, "tools": tools, "documents": self.documents,
                "add_generation_prompt": self.add_generation_prompt}

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
