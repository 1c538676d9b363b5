"""API key, a killed engine, and stopping the server: each with its own server."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from hybridlb.lifecycle import wait_gone
from hybridlb.testing.servers import Server, start_server, start_servers


def test_api_key_guards_every_v1_route(tiny_qwen3):
    server = start_server(tiny_qwen3, "--api-key", "s3cret")
    try:
        body = {"model": server.model, "prompt": "GPU", "max_tokens": 2}
        for response in (httpx.post(f"{server.url}/v1/completions", json=body),
                         httpx.get(f"{server.url}/v1/models"),
                         httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer wrong"})):
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{server.url}/health").status_code == 200
        ok = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
    finally:
        assert server.stop() == 0


def test_killed_engine_fails_requests_fast_and_health_reports_it(tiny_qwen3):
    server = start_server(tiny_qwen3)
    try:
        engine_pid = server.children()["hybridlb:engine:0"]

        async def stream_until_killed() -> list[str]:
            body = {"model": server.model, "prompt": "Long story", "max_tokens": 480, "stream": True,
                    "ignore_eos": True, "temperature": 0}
            lines = []
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client, \
                    client.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if not line:
                        continue
                    if len(lines) == 2:
                        os.kill(engine_pid, signal.SIGKILL)
                    lines.append(line)
            return lines

        started = time.monotonic()
        lines = asyncio.run(stream_until_killed())
        assert time.monotonic() - started < 10
        assert any('"error"' in line and "engine 0" in line for line in lines)
        assert lines[-1] == "data: [DONE]"
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503 and "0" in health.json()["error"]["message"]
        body = {"model": server.model, "prompt": "GPU", "max_tokens": 2}
        response = httpx.post(f"{server.url}/v1/completions", json=body)
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "service_unavailable_error"
        assert httpx.get(f"{server.url}/version").status_code == 200
    finally:
        server.stop()


def test_sigterm_stops_the_whole_tree(tiny_qwen3):
    server = start_server(tiny_qwen3)
    try:
        children = server.children()
        ours = {title for title in children if title.startswith("hybridlb:")}
        # The engine is the child of the fork server that imported torch for it (engine/preload.py).
        assert ours == {"hybridlb:engine:0", "hybridlb:api:0", "hybridlb:engine-forks"}
        # The only other child is multiprocessing's resource tracker (spawn starts it).
        assert all("resource_tracker" in title for title in set(children) - ours)
        assert Path(f"/proc/{server.process.pid}/cmdline").read_bytes().startswith(b"hybridlb:serve")
    finally:
        assert server.stop() == 0
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(_running(pid) for pid in children.values()):
        time.sleep(0.2)
    assert not any(_running(pid) for pid in children.values())


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting for init to reap it."""
    return bool(wait_gone([pid], 0))


def test_ctrl_c_is_an_orderly_stop(tiny_qwen3):
    """Ctrl-C reaches every process of the group: exit 0, INFO lines only, no traceback, and
    the node's private socket directory is gone."""
    (server,) = start_servers(Server(tiny_qwen3, "--data-parallel-size", "2", "--api-servers-per-node", "2",
                                     own_group=True))
    runtime_dir = Path(re.search(r"ipc://(/\S+)/engine-0", server.output).group(1))
    assert runtime_dir.is_dir() and runtime_dir.stat().st_mode & 0o777 == 0o700
    os.killpg(server.process.pid, signal.SIGINT)
    assert server.process.wait(30) == 0
    time.sleep(0.5)  # the reader thread drains the last lines
    assert "Traceback" not in server.output and " ERROR " not in server.output, server.output
    assert "stopping" in server.output
    assert not runtime_dir.exists()


@pytest.mark.parametrize("dp", [1, 2])
def test_a_stop_ends_streams_in_flight_with_an_error_event(tiny_qwen3, dp):
    """SIGTERM stops the engines too, so a stream cannot finish: its client gets an error event,
    not a connection cut when the grace period ends (nor a move to another engine that is
    stopping as well)."""
    (server,) = start_servers(Server(tiny_qwen3, "--simulate-step-ms", "20", "--data-parallel-size", str(dp)))
    body = {"model": server.model, "prompt": "stop me", "max_tokens": 400, "ignore_eos": True, "stream": True}
    events = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
        for line in filter(None, response.iter_lines()):
            events.append(line)
            if len(events) == 10:
                server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(30) == 0
    errors = [e for e in events if e.startswith('data: {"error"')]
    assert len(errors) == 1 and "shutting down" in errors[0], events[-3:]
    assert events[-1] == "data: [DONE]"
