"""Tool calling through the `openai` SDK against a SmolLM2 server: forced calls (required, a
named function) whose arguments validate against the tool's schema, whole and streamed; an
agent loop whose history (calls and results) reaches the chat template; tool_choice auto read
by the Hermes parser."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}}, "required": ["timezone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
QUESTION = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture
def client(structured_server):
    client = openai.OpenAI(base_url=f"{structured_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    yield client
    client.close()


def _check(calls, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed(client, **args):
    """The SDK's own accumulation of a stream: (message, finish_reason)."""
    with client.chat.completions.stream(model="smollm2", **args) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    return final.choices[0].message, final.choices[0].finish_reason


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
@pytest.mark.parametrize("temperature", [0, 1.0])
def test_a_forced_call_is_valid_whole_and_streamed(client, choice, temperature):
    names = {"get_weather", "get_time"} if choice == "required" else {"get_time"}
    for seed in range(2):
        args = dict(messages=QUESTION, tools=TOOLS, tool_choice=choice, max_tokens=300, temperature=temperature,
                    seed=seed)
        whole = client.chat.completions.create(model="smollm2", **args)
        _check(whole.choices[0].message.tool_calls, names)
        assert whole.choices[0].finish_reason == "tool_calls"
        message, reason = _streamed(client, **args)
        _check(message.tool_calls, names)
        assert reason == "tool_calls"
        assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == \
            [(c.function.name, json.loads(c.function.arguments)) for c in whole.choices[0].message.tool_calls]


def test_parallel_tool_calls_false_makes_at_most_one(client, structured_server):
    comma = httpx.post(f"{structured_server.url}/tokenize", json={"model": "smollm2", "prompt": "}},"}).json()
    bias = {str(token): 8 for token in comma["tokens"]}  # nudge the model to go on listing calls
    many = client.chat.completions.create(model="smollm2", messages=QUESTION, tools=TOOLS, tool_choice="required",
                                          max_tokens=200, temperature=0, logit_bias=bias)
    one = client.chat.completions.create(model="smollm2", messages=QUESTION, tools=TOOLS, tool_choice="required",
                                         max_tokens=200, temperature=0, logit_bias=bias, parallel_tool_calls=False)
    assert len(one.choices[0].message.tool_calls) == 1
    assert len(many.choices[0].message.tool_calls or []) != 1 or many.choices[0].finish_reason == "length"


def _prompt(structured_server, messages: list[dict]) -> str:
    tokens = httpx.post(f"{structured_server.url}/tokenize", timeout=30,
                        json={"model": "smollm2", "messages": messages, "tools": TOOLS}).json()["tokens"]
    return httpx.post(f"{structured_server.url}/detokenize", json={"model": "smollm2", "tokens": tokens},
                      timeout=30).json()["prompt"]


def test_an_agent_loop_keeps_its_history(client, structured_server):
    """Call a tool, answer with its result, call another, answer, then a final text answer: each
    turn's prompt (what the template rendered) holds every earlier call and result."""
    messages = list(QUESTION)
    results = {"get_weather": '{"temperature": 18, "sky": "clear"}', "get_time": '{"time": "14:05"}'}
    prompt_tokens = []
    for turn, choice in enumerate(["required", {"type": "function", "function": {"name": "get_time"}}, "none"]):
        response = client.chat.completions.create(model="smollm2", messages=messages, tools=TOOLS, tool_choice=choice,
                                                  max_tokens=60, temperature=0)
        prompt_tokens.append(response.usage.prompt_tokens)
        message = response.choices[0].message
        if choice == "none":
            assert message.content and not message.tool_calls
            break
        call = message.tool_calls[0]
        messages.append({"role": "assistant", "content": message.content, "tool_calls": [call.model_dump()]})
        messages.append({"role": "tool", "tool_call_id": call.id, "content": results[call.function.name]})
        rendered = _prompt(structured_server, messages)
        assert call.function.name in rendered and results[call.function.name] in rendered, (turn, rendered)
        assert json.loads(call.function.arguments) == _arguments_in(rendered, call.function.name)
    assert prompt_tokens == sorted(prompt_tokens) and len(set(prompt_tokens)) == 3  # the history grows


def _arguments_in(rendered: str, name: str) -> dict:
    start = rendered.rindex(f'{{"name": "{name}", "arguments": ') + len(f'{{"name": "{name}", "arguments": ')
    return json.JSONDecoder().raw_decode(rendered[start:])[0]


def test_tool_choice_auto_reads_the_calls_the_model_writes(client):
    """tool_choice auto: the Hermes parser reads the model's own <tool_call> text. SmolLM2 is too small to
    write one unprompted, so a grammar (structured_outputs, which auto leaves to the request) holds it to
    the format; the parser does the rest, whole and streamed."""
    call = {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": WEATHER},
            "required": ["name", "arguments"], "additionalProperties": False}
    grammar = 'start: "Checking.\\n<tool_call>\\n" call "\\n</tool_call>"\ncall: %json ' + json.dumps(call)
    args = dict(messages=QUESTION, tools=TOOLS, max_tokens=100, temperature=0,
                extra_body={"structured_outputs": {"grammar": grammar}})
    whole = client.chat.completions.create(model="smollm2", **args)
    message = whole.choices[0].message
    assert message.content == "Checking." and whole.choices[0].finish_reason == "tool_calls"
    _check(message.tool_calls, {"get_weather"})
    streamed, reason = _streamed(client, **args)
    assert streamed.content == "Checking.\n" and reason == "tool_calls"
    assert streamed.tool_calls[0].function.arguments == message.tool_calls[0].function.arguments
    plain = client.chat.completions.create(model="smollm2", messages=QUESTION, tools=TOOLS, max_tokens=30,
                                           temperature=0)
    assert plain.choices[0].message.content and not plain.choices[0].message.tool_calls  # prose stays prose


def test_auto_needs_the_server_flag_and_none_leaves_text(structured_server):
    body = {"model": "smollm2", "messages": QUESTION, "tools": TOOLS, "tool_choice": "none", "max_tokens": 8}
    response = httpx.post(f"{structured_server.url}/v1/chat/completions", json=body, timeout=60).json()
    assert response["choices"][0]["message"]["content"] and "tool_calls" not in response["choices"][0]["message"]
