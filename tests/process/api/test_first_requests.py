"""Requests as clients send them by default: no model named, `response_format` text."""

from __future__ import annotations

import httpx


def test_a_request_without_a_model_is_served_by_the_only_model(server):
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "GPU", "max_tokens": 3}, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == server.model
    chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert chat.status_code == 200, chat.text
    assert chat.json()["model"] == server.model


def test_response_format_text_is_the_no_op_it_is(server):
    body = {"model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "temperature": 0}
    plain = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
    text = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "response_format": {"type": "text"}},
                      timeout=60)
    assert text.status_code == 200, text.text
    assert text.json()["choices"][0]["message"] == plain["choices"][0]["message"]
    json_mode = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                           json={**body, "response_format": {"type": "json_object"}})
    assert json_mode.status_code == 200
    assert json_mode.json()["choices"][0]["message"]["content"].lstrip().startswith("{")
