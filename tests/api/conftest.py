"""A real `hybridlb serve` process tree per test module, driven over real HTTP."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: str, *flags: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = model
        command = [sys.executable, "-m", "hybridlb", "serve", "--model", model, "--port", str(self.port),
                   "--max-model-len", "512", "--kv-cache-gib", "0.05", *flags]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def wait_ready(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"hybridlb serve exited early:\n{self.process.stdout.read()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError("hybridlb serve did not become healthy")

    def children(self) -> dict[str, int]:
        """Command line (a process title for hybridlb's own) → pid of this server's children."""
        pids = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text().split()
        titles = {}
        for pid in pids:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            titles[cmdline] = int(pid)
        return titles

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                for pid in self.children().values():
                    os.kill(pid, signal.SIGKILL)
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_server(model: str, *flags: str) -> Server:
    server = Server(model, *flags)
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="module")
def server(tiny_qwen3):
    server = start_server(tiny_qwen3)
    yield server
    assert server.stop() == 0
