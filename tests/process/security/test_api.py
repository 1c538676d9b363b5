"""One API-key-protected `hybridlb serve`: which routes need the key, body and request
limits, where it listens, and that neither prompts nor keys reach its logs."""

from __future__ import annotations

import json
import re
import socket
import time

import httpx
import pytest

from hybridlb.api.app import create_app
from hybridlb.api.guard import OPEN_PATHS
from hybridlb.api.spec import ApiServerSpec
from hybridlb.config import parse_config
from hybridlb.testing.listeners import assert_loopback_only
from hybridlb.testing.servers import start_server

KEY = "sk-hybridlb-9f3e1c7a"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_CONCURRENT = 2
PROMPT = "zebra quartz marmalade 7731"


@pytest.fixture(scope="module")
def server(tiny_qwen3):
    server = start_server(tiny_qwen3, "--api-key", KEY, "--max-concurrent-requests", str(MAX_CONCURRENT))
    yield server
    server.stop()


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def _routes(model: str) -> list[tuple[str, str]]:
    """(method, path) of every route the app has: a route added later is covered too."""
    config = parse_config({"engine": {"model": model}})
    app = create_app(config, ApiServerSpec(engines=((0, "ipc:///nowhere"),)))
    found = []
    for route in app.routes:
        for method in sorted(getattr(route, "methods", None) or ()):
            if method != "HEAD":
                found.append((method, re.sub(r"\{[^}]*\}", "x", route.path)))
    return found


def test_every_route_but_the_open_ones_needs_the_key(server, tiny_qwen3):
    routes = _routes(tiny_qwen3)
    paths = {path for _, path in routes}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/ranks"} <= paths
    assert paths >= OPEN_PATHS and not any(path.startswith("/v1") for path in OPEN_PATHS)
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for method, path in routes:
            if path in OPEN_PATHS:
                assert client.request(method, path).status_code == 200, path
                continue
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                            {"Authorization": f"Bearer {KEY}x"}, {"Authorization": f"bearer {KEY}"}):
                error = _error(client.request(method, path, headers=headers), 401)
                assert error["code"] == "invalid_api_key" and KEY not in error["message"], (method, path)
        _error(client.get("/no/such/route"), 401)  # unknown paths too: guarded by default
        assert client.get("/v1/models", headers=AUTH).status_code == 200
        assert client.get("/ranks", headers=AUTH).json()["ranks"] == [0]


def test_bodies_over_the_limit_get_413(server):
    limit = 8 * 2**20  # api.max_body_bytes
    body = b'{"prompt": "' + b"x" * limit + b'"}'
    with httpx.Client(base_url=server.url, timeout=60, headers=AUTH) as client:
        declared = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert "max_body_bytes" in _error(declared, 413)["message"]

        def chunks():  # no Content-Length: the limit applies while reading
            for start in range(0, len(body), 2**20):
                yield body[start:start + 2**20]

        streamed = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert "max_body_bytes" in _error(streamed, 413)["message"]


@pytest.mark.parametrize(("change", "param"), [
    ({"prompt": ["a"] * 1025}, "prompt"),
    ({"n": 129}, "n"),  # over MAX_CHOICES
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 10**6}, "max_tokens"),
    ({"max_tokens": 2**64}, "max_tokens"),
    ({"stop": ["s"] * 65}, "stop"),
    ({"stop": "s" * 1025}, "stop"),
    ({"stop_token_ids": [1] * 1025}, "stop_token_ids"),
    ({"seed": 2**64}, "seed"),
    ({"top_k": 2**64}, "top_k"),
    ({"prompt": "lone \ud800 surrogate"}, "prompt"),
])
def test_request_limits_get_400_naming_the_field(server, change, param):
    body = {"model": server.model, "prompt": "GPU", "max_tokens": 2, **change}
    response = httpx.post(f"{server.url}/v1/completions", content=json.dumps(body).encode(),
                          headers={**AUTH, "content-type": "application/json"}, timeout=30)
    assert _error(response, 400)["param"] == param


def _fill_slots(server) -> list[socket.socket]:
    """MAX_CONCURRENT requests whose bodies never finish arriving: each holds its slot."""
    held = []
    for _ in range(MAX_CONCURRENT):
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{".encode())
        held.append(sock)
    time.sleep(0.5)  # until the server has read their headers
    return held


def test_concurrent_requests_over_the_limit_get_429(server):
    body = {"model": server.model, "prompt": "GPU", "max_tokens": 2}
    with httpx.Client(base_url=server.url, timeout=30, headers=AUTH) as client:
        assert client.post("/v1/completions", json=body).status_code == 200
        for _ in range(5):  # a request still finishing on the server can take a slot first: again
            held = _fill_slots(server)
            refused = client.post("/v1/completions", json=body)
            if refused.status_code == 429:
                break
            for sock in held:
                sock.close()
        try:
            error = _error(refused, 429)
            assert refused.headers["retry-after"] == "1" and "max_concurrent_requests" in error["message"]
            assert error["type"] == "rate_limit_error"
            for path in sorted(OPEN_PATHS):  # probes are never refused
                assert client.get(path).status_code == 200, path
        finally:
            for sock in held:
                sock.close()
        for _ in range(50):  # the slots free up once the server sees the clients go
            response = client.post("/v1/completions", json=body)
            if response.status_code != 429:
                break
            time.sleep(0.1)
        assert response.status_code == 200, response.text


def test_listens_on_loopback_only(server):
    assert_loopback_only(server, {server.port})


def test_no_prompts_or_keys_in_the_logs(server):
    """Last in this module: it stops the server to read everything it wrote."""
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 3}
    with httpx.Client(base_url=server.url, timeout=30) as client:
        assert client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {PROMPT}"}) \
            .status_code == 401
        assert client.post("/v1/completions", json=body, headers=AUTH).status_code == 200
        assert client.post("/v1/completions", json={**body, "stream": True}, headers=AUTH).status_code == 200
        assert client.post("/v1/completions", json={**body, "n": 129}, headers=AUTH).status_code == 400
        chat = {"model": server.model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2}
        assert client.post("/v1/chat/completions", json=chat, headers=AUTH).status_code == 200
    server.stop()
    assert "hybridlb is ready" in server.output and "Traceback" not in server.output
    for secret in (PROMPT, "zebra", KEY, KEY[3:]):
        assert secret not in server.output, f"{secret!r} in the logs:\n{server.output}"


def test_vllm_api_key_guards_the_server_and_each_served_name_answers(tiny_qwen3, monkeypatch):
    """A migrating user's `VLLM_API_KEY` keeps the server closed; `--served-model-name a b` (vLLM's
    several names after one flag) makes both names work, the first naming the metrics."""
    monkeypatch.setenv("VLLM_API_KEY", "vllm-secret")
    server = start_server(tiny_qwen3, "--served-model-name", "alpha", "beta")
    try:
        assert httpx.get(f"{server.url}/v1/models").status_code == 401
        headers = {"Authorization": "Bearer vllm-secret"}
        models = httpx.get(f"{server.url}/v1/models", headers=headers).json()
        assert [card["id"] for card in models["data"]] == ["alpha", "beta"]
        for name in ("alpha", "beta"):
            body = {"model": name, "prompt": "GPU", "max_tokens": 2}
            response = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60)
            assert response.status_code == 200 and response.json()["model"] == name
        wrong = httpx.post(f"{server.url}/v1/completions", json={"model": "gamma", "prompt": "x"}, headers=headers)
        assert wrong.status_code == 404 and "`alpha`, `beta`" in wrong.json()["error"]["message"]
        assert 'model_name="alpha"' in httpx.get(f"{server.url}/metrics").text
    finally:
        server.stop()


def test_a_stalled_upload_gets_408_and_gives_back_its_slot(tiny_qwen3, tmp_path):
    """Bodies that stop arriving hold their slots for api.body_timeout_s at most: then 408, and
    the server takes requests again."""
    config = tmp_path / "slow.yaml"
    config.write_text(f"engine: {{model: {tiny_qwen3}}}\n"
                      f"api: {{body_timeout_s: 2, max_concurrent_requests: {MAX_CONCURRENT}}}\n")
    server = start_server(tiny_qwen3, "--config", str(config), "--api-key", KEY)
    try:
        body = {"model": server.model, "prompt": "GPU", "max_tokens": 2}
        held = _fill_slots(server)
        assert httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH).status_code == 429
        for sock in held:
            answer = ""
            while "api.body_timeout_s" not in answer and (chunk := sock.recv(4096)):  # well before the socket's 30 s
                answer += chunk.decode()
            assert answer.startswith("HTTP/1.1 408") and "api.body_timeout_s" in answer, answer
            sock.close()
        assert httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH).status_code == 200
    finally:
        server.stop()
