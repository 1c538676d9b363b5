"""Structured outputs through the real `openai` SDK against a SmolLM2 server: twenty JSON
schemas of different shapes, greedy and sampled, streamed and not, always valid; the SDK's
``.parse()``; regex and choice; the same requests without a constraint mostly invalid (the
constraint does the work); bad constraints answered with 400s while the server serves on."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

S = {"type": "string", "maxLength": 24}
N = {"type": "integer", "minimum": 0, "maximum": 1000}
SCHEMAS = [
    {"type": "object", "properties": {"name": S, "age": N}, "required": ["name", "age"]},
    {"type": "object", "properties": {"name": S, "address": {"type": "object", "properties": {
        "city": S, "street": S}, "required": ["city", "street"]}}, "required": ["name", "address"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"people": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"name": S, "age": N}, "required": ["name", "age"]}}}, "required": ["people"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"score": {"type": "integer", "minimum": 1, "maximum": 5}}, "required": ["score"]},
    {"type": "object", "properties": {"price": {"type": "number", "minimum": 0, "maximum": 100}},
     "required": ["price"]},
    {"type": "object", "properties": {"done": {"type": "boolean"}, "title": S}, "required": ["done", "title"]},
    {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"]},
    {"type": "object", "properties": {"id": {"anyOf": [S, N]}}, "required": ["id"]},
    {"type": "object", "properties": {"name": S, "nickname": S, "age": N}, "required": ["name"]},
    {"type": "object", "properties": {"a": N, "b": N}, "required": ["a", "b"], "additionalProperties": False},
    {"type": "object", "properties": {"day": {"type": "string", "format": "date"}}, "required": ["day"]},
    {"type": "object", "properties": {"kind": {"const": "event"}, "title": S}, "required": ["kind", "title"]},
    {"type": "object", "properties": {"grid": {"type": "array", "maxItems": 3, "items": {
        "type": "array", "maxItems": 3, "items": N}}}, "required": ["grid"]},
    {"type": "object", "properties": {"shape": {"anyOf": [
        {"type": "object", "properties": {"radius": N}, "required": ["radius"], "additionalProperties": False},
        {"type": "object", "properties": {"side": N}, "required": ["side"], "additionalProperties": False}]}},
     "required": ["shape"]},
    {"type": "object", "properties": {"code": {"type": "string", "minLength": 3, "maxLength": 6}},
     "required": ["code"]},
    {"$defs": {"point": {"type": "object", "properties": {"x": N, "y": N}, "required": ["x", "y"]}},
     "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
     "required": ["start", "end"]},
    {"type": "object", "properties": {"note": {"type": ["string", "null"], "maxLength": 24}}, "required": ["note"]},
    {"type": "object", "properties": {"name": S, "age": N, "email": S, "active": {"type": "boolean"},
                                      "roles": {"type": "array", "items": {"enum": ["admin", "user"]}, "maxItems": 2}},
     "required": ["name", "age", "email", "active", "roles"], "additionalProperties": False},
]
PROMPT = "Reply with a JSON object for this schema, nothing else: {}"


def _messages(schema: dict) -> list[dict]:
    return [{"role": "user", "content": PROMPT.format(json.dumps(schema))}]


async def _ask(client, schema: dict, sampled: bool, stream: bool, constrained: bool, seed: int) -> tuple[str, str]:
    extra = {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}} \
        if constrained else {}
    args = dict(model="smollm2", messages=_messages(schema), max_tokens=200, temperature=0.8 if sampled else 0,
                seed=seed, **extra)
    if not stream:
        response = await client.chat.completions.create(**args)
        return response.choices[0].message.content, response.choices[0].finish_reason
    text, reason = [], None
    async for chunk in await client.chat.completions.create(**args, stream=True):
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            reason = choice.finish_reason or reason
    return "".join(text), reason


def _valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


async def _all(url: str, jobs: list[tuple]) -> list[tuple[str, str]]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    limit = asyncio.Semaphore(16)

    async def one(job):
        async with limit:
            return await _ask(client, *job)

    try:
        return await asyncio.gather(*(one(job) for job in jobs))
    finally:
        await client.close()


def test_every_schema_every_way_is_valid_and_the_constraint_does_the_work(structured_server):
    jobs = [(schema, sampled, stream, True, index) for index, schema in enumerate(SCHEMAS)
            for sampled in (False, True) for stream in (False, True)]
    free = [(schema, False, False, False, index) for index, schema in enumerate(SCHEMAS)]
    answers = asyncio.run(_all(structured_server.url, jobs + free))
    invalid = [(job[0], job[1:3], text, reason) for job, (text, reason) in zip(jobs, answers[: len(jobs)], strict=True)
               if reason != "stop" or not _valid(text, job[0])]
    assert not invalid, invalid
    by_schema: dict[int, set[str]] = {}
    for job, (text, _) in zip(jobs, answers, strict=False):
        if not job[1]:  # greedy: streamed and whole are the same text
            by_schema.setdefault(job[4], set()).add(text)
    assert all(len(texts) == 1 for texts in by_schema.values()), by_schema
    unconstrained_valid = sum(_valid(text, job[0]) for job, (text, _) in zip(free, answers[len(jobs):], strict=True))
    assert unconstrained_valid <= len(SCHEMAS) // 4, f"{unconstrained_valid} of {len(SCHEMAS)} valid without it"


class Person(BaseModel):
    name: str = Field(max_length=30)
    age: int
    hobbies: list[str] = Field(max_length=3)  # SmolLM2 lists the same hobby until max_tokens otherwise


def test_the_sdk_parse_returns_a_parsed_object(structured_server):
    client = openai.OpenAI(base_url=f"{structured_server.url}/v1", api_key="unused", max_retries=0)
    completion = client.chat.completions.parse(model="smollm2", response_format=Person, max_tokens=200, temperature=0,
                                               messages=[{"role": "user", "content": "Invent a person."}])
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Person) and parsed.name


def test_regex_choice_grammar_and_json_mode(structured_server):
    client = openai.OpenAI(base_url=f"{structured_server.url}/v1", api_key="unused", max_retries=0)

    def text(extra: dict, prompt: str = "My phone number is", max_tokens: int = 40, **args) -> str:
        return client.completions.create(model="smollm2", prompt=prompt, max_tokens=max_tokens, extra_body=extra,
                                         **args).choices[0].text

    for seed in range(3):
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", text({"structured_outputs": {"regex": r"\d{3}-\d{4}"}},
                                                        temperature=1.0, seed=seed))
        assert text({"guided_choice": ["positive", "negative"]}, "The review 'great!' is", temperature=1.0,
                    seed=seed) in {"positive", "negative"}
        assert re.fullmatch(r"(yes|no)!", text({"guided_grammar": 'start: ("yes" | "no") "!"'}, temperature=1.0,
                                               seed=seed))
    json_mode = text({"response_format": {"type": "json_object"}}, "A JSON object:", max_tokens=200, temperature=0)
    assert isinstance(json.loads(json_mode), dict)


@pytest.mark.parametrize(("extra", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "objectt"}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex"),
    ({"guided_json": {"type": "integer", "minimum": 5, "maximum": 1}}, "guided_json"),
    ({"guided_grammar": "start: missing_rule"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectt"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
])
def test_a_bad_constraint_or_tool_is_a_400_naming_it_and_the_server_serves_on(structured_server, extra, param):
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    response = httpx.post(f"{structured_server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code in (400, 422), response.text
    error = response.json()["error"]
    assert param in (error["param"] or "") or param in error["message"], error
    ok = httpx.post(f"{structured_server.url}/v1/chat/completions", timeout=60,
                    json={"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert ok.status_code == 200
