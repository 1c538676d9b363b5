"""What an operator reads after kill -9 of a dense engine whose every stream moved on: no
request counted lost, each moved one counted once as migrated, a log that says so in order
and names the signal, and no zombie engine left behind (process tier: tiny model, DP=2)."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import httpx

from hybridlb.testing.ports import free_port_range
from hybridlb.testing.servers import Server, start_servers
from tests.cluster.dp.test_clusters import _dp_flags
from tests.process.faults.streams import Streams

STREAMS = 8


def _total(url: str, family: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{family}_total\{{[^}}]*\}} (\S+)$", text, re.M))


def _state(pid: int) -> str | None:
    """The process's state letter (Z: a zombie nobody reaped), or None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def test_a_killed_engines_moved_streams_count_as_migrated_not_lost(tiny_qwen3):
    (server,) = start_servers(Server(tiny_qwen3, *_dp_flags(2, 2, 0, free_port_range(8)),
                                     "--restart-policy", "none"))
    try:
        engine = server.children()["hybridlb:engine:0"]
        streams = Streams([server.url], server.model, STREAMS)
        streams.wait_streaming()
        os.kill(engine, signal.SIGKILL)
        outcomes = streams.join(120)
        assert [o.kind for o in outcomes] == ["complete"] * STREAMS, [o.detail for o in outcomes]

        output = server.output
        taken = re.search(r"engine 0 disconnected: moving its (\d+) in-flight requests to other engines", output)
        assert taken, output[-3000:]
        moved = int(taken.group(1))
        assert moved >= 1
        summary = f"engine 0: of its {moved} in-flight requests, {moved} moved, 0 lost"
        assert summary in output and output.index(taken.group(0)) < output.index(summary), output[-3000:]
        assert _total(server.url, "hybridlb:migrated_requests") == moved
        assert _total(server.url, "hybridlb:lost_requests") == 0

        assert "engine 0 was killed by SIGKILL" in output, output[-3000:]
        deadline = time.monotonic() + 5
        while _state(engine) == "Z" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _state(engine) is None, f"engine 0 (pid {engine}) is {_state(engine)}: not reaped"
        assert server.process.poll() is None
    finally:
        server.stop()
