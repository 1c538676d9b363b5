"""Every bad input gets its status and an OpenAI error body; the server keeps serving."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

BAD_COMPLETIONS = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),  # -1 and 0 are "off", as vLLM reads them
    ({"n": 0}, "n"),
    ({"max_tokens": 500, "prompt": "word " * 100}, "max_tokens"),
    ({"prompt": [99999]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"logprobs": 21}, "logprobs"),  # more alternatives than MAX_LOGPROBS
    ({"presence_penalty": 2.5}, "presence_penalty"),  # OpenAI's range is [-2, 2]
    ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {"GPU": 5}}, "logit_bias"),  # keys are token ids
    ({"logit_bias": {"99999": 5}}, "logit_bias"),  # beyond the vocabulary
    ({"use_beam_search": True}, "use_beam_search"),  # not implemented: said, not ignored
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex"),  # the library's complaint
]


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    return error


def _good(server) -> None:
    body = {"model": server.model, "prompt": "GPU", "max_tokens": 3}
    assert httpx.post(f"{server.url}/v1/completions", json=body).status_code == 200


@pytest.mark.parametrize(("change", "param"), BAD_COMPLETIONS)
def test_invalid_completion_parameters_get_400(server, change, param):
    body = {"model": server.model, "prompt": "GPU", "max_tokens": 4, **change}
    error = _error(httpx.post(f"{server.url}/v1/completions", json=body), 400)
    assert error["param"] == param or param in error["message"]
    _good(server)


def _api_server_rss_kib(server) -> int:
    (pid,) = [pid for title, pid in server.children().items() if title.startswith("hybridlb:api")]
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1))


def test_token_ids_beyond_any_integer_leave_nothing_behind(server):
    """A logit_bias key of 2**64 (msgpack cannot even carry it) is a 400 before the request is
    registered anywhere: after 1,000, nothing is in flight, the API server's memory did not
    grow with them, and it serves on."""
    body = {"model": server.model, "prompt": "GPU", "max_tokens": 2, "logit_bias": {str(2**64): 5}}
    with httpx.Client(timeout=30) as client:
        for count in range(1000):
            if count == 200:  # allocator pools and caches have warmed up
                rss_before = _api_server_rss_kib(server)
            assert client.post(f"{server.url}/v1/completions", json=body).status_code == 400
        grown = _api_server_rss_kib(server) - rss_before
        assert grown < 1024, f"the API server grew {grown} KiB over 800 refused requests"
        for field in ({"allowed_token_ids": [2**64]}, {"stop_token_ids": [2**64]}, {"prompt": [2**64]}):
            response = client.post(f"{server.url}/v1/completions", json={**body, "logit_bias": {}, **field})
            assert response.status_code == 400, (field, response.text)
        ranks = client.get(f"{server.url}/ranks").json()["engines"]
    assert [engine["in_flight_here"] for engine in ranks] == [0] * len(ranks)
    _good(server)


def test_chat_errors(server):
    url = f"{server.url}/v1/chat/completions"
    error = _error(httpx.post(url, json={"model": server.model, "messages": []}), 400)
    assert "messages" in error["message"]
    _error(httpx.post(url, json={"model": server.model, "messages": [{"role": "wizard", "content": "x"}]}), 400)
    _good(server)


def test_malformed_json_and_non_object_bodies(server):
    url = f"{server.url}/v1/completions"
    error = _error(httpx.post(url, content=b'{"model": ', headers={"content-type": "application/json"}), 400)
    assert "not valid JSON" in error["message"]
    _error(httpx.post(url, content=b"[1, 2]", headers={"content-type": "application/json"}), 400)
    _good(server)


def test_unknown_model_and_route_get_404(server):
    error = _error(httpx.post(f"{server.url}/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404)
    assert error["code"] == "model_not_found" and server.model in error["message"]
    _error(httpx.get(f"{server.url}/v1/nothing"), 404)
    _error(httpx.get(f"{server.url}/v1/completions"), 405)
    _good(server)


def test_oversized_body_gets_413(server):
    body = b'{"model": "x", "prompt": "' + b"a" * (9 * 2**20) + b'"}'
    _error(httpx.post(f"{server.url}/v1/completions", content=body,
                      headers={"content-type": "application/json"}), 413)
    _good(server)


def test_pinned_rank_must_be_local(server):
    body = {"model": server.model, "prompt": "GPU", "max_tokens": 2}
    error = _error(httpx.post(f"{server.url}/v1/completions", json=body, headers={"X-data-parallel-rank": "3"}), 400)
    assert "ranks 0" in error["message"]
    _error(httpx.post(f"{server.url}/v1/completions", json=body, headers={"X-data-parallel-rank": "x"}), 400)
    ok = httpx.post(f"{server.url}/v1/completions", json=body, headers={"X-data-parallel-rank": "0"})
    assert ok.status_code == 200
