"""`/openapi.json` describes what the server really accepts: its routes, and the request
fields of completions and chat (the same pydantic models that validate each request)."""

from __future__ import annotations

import httpx

ROUTES = {"/v1/completions": "post", "/v1/chat/completions": "post", "/tokenize": "post", "/detokenize": "post",
          "/tokenizer_info": "get", "/v1/models": "get", "/health": "get", "/ping": "get", "/metrics": "get",
          "/load": "get", "/ranks": "get", "/version": "get"}
COMPLETION_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "best_of",
                     "seed", "stop", "stop_token_ids", "stream", "stream_options", "logprobs", "echo",
                     "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "ignore_eos"}
CHAT_FIELDS = {"model", "messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs", "n", "tools",
               "tool_choice", "chat_template_kwargs", "stream", "temperature", "seed"}


def _schema(spec: dict, path: str) -> dict:
    ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    return spec["components"]["schemas"][ref.rsplit("/", 1)[1]]


def test_openapi_lists_every_route_and_request_field(server):
    spec = httpx.get(f"{server.url}/openapi.json").json()
    for path, method in ROUTES.items():
        assert method in spec["paths"].get(path, {}), path
    completion = _schema(spec, "/v1/completions")
    assert set(completion["properties"]) >= COMPLETION_FIELDS, COMPLETION_FIELDS - set(completion["properties"])
    assert set(completion["required"]) == {"prompt"}  # model: the only one served, as vLLM
    chat = _schema(spec, "/v1/chat/completions")
    assert set(chat["properties"]) >= CHAT_FIELDS, CHAT_FIELDS - set(chat["properties"])
    assert set(chat["required"]) == {"messages"}


def test_every_documented_completion_field_is_accepted(server):
    """A request may set each field the schema lists (at a harmless value) and succeed."""
    values = {"max_tokens": 2, "temperature": 0, "top_p": 1, "top_k": 5, "min_p": 0.0, "n": 1, "best_of": 1,
              "seed": 3, "stop": ["zzz"], "stop_token_ids": [], "stream": False, "logprobs": 1, "echo": False,
              "presence_penalty": 0.1, "frequency_penalty": 0.1, "repetition_penalty": 1.1, "logit_bias": {"5": 0.5},
              "ignore_eos": True}
    spec = httpx.get(f"{server.url}/openapi.json").json()
    listed = set(_schema(spec, "/v1/completions")["properties"])
    for field, value in values.items():
        assert field in listed
        body = {"model": server.model, "prompt": "Hello", field: value}
        if field != "max_tokens":
            body["max_tokens"] = 2
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, (field, response.text)
