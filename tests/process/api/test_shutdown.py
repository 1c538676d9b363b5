"""A stop with ``--shutdown-timeout`` (vLLM's flag): the node refuses new connections at once
and lets the streams in flight finish, whether the signal is a pod's SIGTERM to the launcher
or a terminal's Ctrl-C to the whole process group; a stream longer than the timeout ends with
an error event when it runs out."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from hybridlb.testing.servers import Server, start_servers

STEP_MS = 20


def _stream(url: str, model: str, max_tokens: int, events: list[str], started: threading.Event) -> None:
    body = {"model": model, "prompt": "drain me", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        for line in filter(None, response.iter_lines()):
            events.append(line)
            if len(events) == 5:
                started.set()


def _start_streams(server: Server, count: int, max_tokens: int) -> tuple[list[threading.Thread], list[list[str]]]:
    events: list[list[str]] = [[] for _ in range(count)]
    threads = []
    for received in events:
        started = threading.Event()
        threads.append(threading.Thread(target=_stream, args=(server.url, server.model, max_tokens, received, started)))
        threads[-1].start()
        assert started.wait(30), "a stream never started"
    return threads, events


def _refuses_connections(url: str, timeout_s: float = 3) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{url}/health", timeout=1)
        except httpx.ConnectError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("how", ["sigterm-to-the-launcher", "ctrl-c-to-the-group"])
def test_streams_in_flight_finish_and_new_connections_are_refused(tiny_qwen3, how):
    (server,) = start_servers(Server(tiny_qwen3, "--simulate-step-ms", str(STEP_MS), "--data-parallel-size", "2",
                                     "--shutdown-timeout", "30", own_group=True))
    max_tokens = 80  # ~1.6 s of steps: most of each stream is still to come at the signal
    threads, events = _start_streams(server, 4, max_tokens)
    signalled = time.monotonic()
    if how == "sigterm-to-the-launcher":  # as Kubernetes stops a pod: PID 1 only
        server.process.send_signal(signal.SIGTERM)
    else:
        os.killpg(server.process.pid, signal.SIGINT)
    assert _refuses_connections(server.url)
    assert any(thread.is_alive() for thread in threads), "the streams ended before the refusal was seen"
    for thread in threads:
        thread.join(30)
    for received in events:
        assert received[-1] == "data: [DONE]", received[-3:]
        chunks = [json.loads(line.removeprefix("data: ")) for line in received[:-1]]
        assert not [c for c in chunks if "error" in c], received[-3:]
        assert chunks[-1]["usage"]["completion_tokens"] == max_tokens
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert server.process.wait(30) == 0
    assert time.monotonic() - signalled < 15, "the node waited for the whole timeout instead of its last stream"
    assert "Traceback" not in server.output, server.output[-3000:]


def test_a_stream_longer_than_the_timeout_ends_with_an_error_event_when_it_runs_out(tiny_qwen3):
    (server,) = start_servers(Server(tiny_qwen3, "--simulate-step-ms", str(STEP_MS), "--shutdown-timeout", "1"))
    threads, events = _start_streams(server, 1, 400)  # 8 s of steps
    signalled = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    threads[0].join(30)
    ended = time.monotonic() - signalled
    errors = [e for e in events[0] if e.startswith('data: {"error"')]
    assert len(errors) == 1 and "shutting down" in errors[0], events[0][-3:]
    assert events[0][-1] == "data: [DONE]"
    assert 0.8 < ended < 8, ended
    assert server.process.wait(30) == 0
