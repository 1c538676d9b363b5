"""A dense rank that dies costs no request: kill -9 of one engine of a DP=2 node on the real
SmolLM2 while 16 streams run (8 greedy, 8 seeded and sampled, some with a JSON schema). Every
stream completes, and its text is exactly the text of the same request without the fault:
the API server moved it to the other engine with the tokens it had, and that engine went on
where the dead one stopped."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import httpx
import pytest

from hybridlb.testing.ports import free_port_range
from hybridlb.testing.servers import Server, start_servers
from tests.cluster.dp.test_clusters import _dp_flags
from tests.conftest import SMOLLM2
from tests.process.faults.streams import run_streams

pytestmark = pytest.mark.slow
STREAMS = 16
MAX_TOKENS = 96
SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 200},
                                           "lines": {"type": "array", "items": {"type": "string"}}},
          "required": ["title", "lines"]}


def _body(i: int) -> dict:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": f"Write story number {i} about a cat."}],
            "max_tokens": MAX_TOKENS, "stream": True, "ignore_eos": True,
            "temperature": 0.0 if i % 2 == 0 else 1.0, "seed": i}
    if i % 4 == 1:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "story", "schema": SCHEMA}}
        body.pop("ignore_eos")
    return body


def _run(url: str, kill=None) -> list[tuple[str, str | None]]:
    return run_streams(url, "/v1/chat/completions", [_body(i) for i in range(STREAMS)], kill)


def _migrated(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(float(v) for v in re.findall(r"^hybridlb:migrated_requests_total\{[^}]*\} (\S+)$", text, re.M))


def _health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=10).json()


@pytest.mark.parametrize("fault", ["killed", "frozen"])
def test_a_lost_engines_streams_finish_on_its_sibling_with_the_same_text(fault):
    """killed: kill -9. frozen: SIGSTOP (threads and all), found by the API server's silence
    and heartbeat watch; after SIGCONT the engine registers again and serves."""
    # float32 and the file dequantized: a migrated stream's recomputed prefill then gives its decode steps'
    # tokens (kept 4-bit, each projection rounds its inputs to bfloat16 and the texts part)
    (server,) = start_servers(Server(SMOLLM2, *_dp_flags(2, 2, 0, free_port_range(8)), "--served-model-name",
                                     "smollm2", "--dtype", "float32", "--quantization", "none", "--max-model-len",
                                     "512", "--kv-cache-gib", "0.3", "--restart-policy", "none"))
    engine = server.children()["hybridlb:engine:0"]
    try:
        clean = _run(server.url)
        signum = signal.SIGKILL if fault == "killed" else signal.SIGSTOP
        faulty = _run(server.url, lambda: os.kill(engine, signum))
        assert [reason for _, reason in faulty] == [reason for _, reason in clean]
        for i, ((text, _), (expected, _)) in enumerate(zip(faulty, clean, strict=True)):
            assert text == expected, (i, text, expected)
        for i in range(1, STREAMS, 4):  # the constrained ones that finished are still valid JSON
            if faulty[i][1] == "stop":
                json.loads(faulty[i][0])
        assert _migrated(server.url) >= 1
        assert _health(server.url)["down_ranks"] == [0]
        if fault == "frozen":
            os.kill(engine, signal.SIGCONT)
            deadline = time.monotonic() + 30
            while _health(server.url).get("down_ranks") and time.monotonic() < deadline:
                time.sleep(0.5)
            assert not _health(server.url).get("down_ranks")
            assert [text for text, _ in _run(server.url)] == [text for text, _ in clean]
    finally:
        if fault == "frozen":
            os.kill(engine, signal.SIGCONT)
        server.stop()
