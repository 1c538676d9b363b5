"""What one API server takes on: sequences, not HTTP requests, and an engine queue that
refuses with 429 and Retry-After once full."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from hybridlb.testing.servers import start_server


def _busy_stream(url: str, model: str, prompts: int, started: threading.Event, done: threading.Event) -> None:
    """One streamed request of ``prompts`` long prompts; ``started`` once tokens flow."""
    body = {"model": model, "prompt": ["A long story"] * prompts, "max_tokens": 400, "ignore_eos": True,
            "temperature": 0, "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    started.set()
    finally:
        started.set()
        done.set()


def _post(server, prompts: int, **extra) -> httpx.Response:
    body = {"model": server.model, "prompt": ["GPU"] * prompts if prompts > 1 else "GPU", "max_tokens": 2, **extra}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)


@pytest.fixture(scope="module")
def limited(tiny_qwen3):
    server = start_server(tiny_qwen3, "--max-concurrent-requests", "4")
    yield server
    assert server.stop() == 0


def test_one_request_of_more_sequences_than_the_limit_gets_400(limited):
    response = _post(limited, 5)
    assert response.status_code == 400, response.text
    assert "api.max_concurrent_requests" in response.json()["error"]["message"]
    assert _post(limited, 2, n=2).status_code == 200  # 4 sequences fit


def test_the_limit_counts_sequences_in_flight(limited):
    started, done = threading.Event(), threading.Event()
    threading.Thread(target=_busy_stream, args=(limited.url, limited.model, 3, started, done), daemon=True).start()
    assert started.wait(60)
    refused = _post(limited, 2)  # 3 + 2 > 4
    assert refused.status_code == 429, refused.text
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert _post(limited, 1).status_code == 200  # 3 + 1 fits
    assert done.wait(120)
    for _ in range(50):
        if (response := _post(limited, 2)).status_code == 200:
            break
        time.sleep(0.1)
    assert response.status_code == 200, response.text


def test_a_full_engine_queue_answers_429(tiny_qwen3):
    # Simulated steps (10 ms): the streams must still run when the probe arrives, on any machine.
    server = start_server(tiny_qwen3, "--max-num-seqs", "1", "--max-queued-requests", "1", "--simulate-step-ms", "10")
    try:
        events = [(threading.Event(), threading.Event()) for _ in range(2)]
        for started, done in events:  # one runs, one waits in the queue
            threading.Thread(target=_busy_stream, args=(server.url, server.model, 1, started, done),
                             daemon=True).start()
            time.sleep(0.3)
        assert events[0][0].wait(60)
        refused = _post(server, 1)
        assert refused.status_code == 429, refused.text
        assert refused.headers["retry-after"] == "1"
        assert "max_queued_requests" in refused.json()["error"]["message"]
        streamed = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": server.model, "prompt": "GPU", "max_tokens": 2, "stream": True})
        assert streamed.status_code == 429 and streamed.headers["retry-after"] == "1", streamed.text  # not 200 + event
        for _, done in events:
            assert done.wait(120)
        assert _post(server, 1).status_code == 200  # room again
    finally:
        assert server.stop() == 0
