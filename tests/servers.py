"""Real `hybridlb serve` process trees for tests: start, wait until ready, stop by pid."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from hybridlb.lifecycle import die_with_parent
from hybridlb.netaddr import quiet_port_band


def free_port() -> int:
    """A free port for a server a test starts: one of ``free_port_range``'s blocks of one."""
    return free_port_range(1)


_handed_out: set[int] = set()


def free_port_range(count: int) -> int:
    """A base port with ``count`` consecutive free ports after it (a coordinator's block, a server's port).

    Drawn below the kernel's ephemeral range (Linux: 32768-60999, where every outgoing connection and
    every bind to port 0 get their ports) and above Ray's worker ports (10002-19999): a port handed
    out cannot be taken by a connection some process (a Ray worker, another server) opens before
    the server binds it, and is never handed out twice in one run."""
    band = quiet_port_band()
    low, high = band.start, band.stop
    for _ in range(200):
        base = random.randrange(low, high - count)
        block = set(range(base, base + count))
        if not block & _handed_out and all(port_is_free(port) for port in block):
            _handed_out.update(block)  # not handed out twice in one run, bound or not yet
            return base
    raise RuntimeError(f"no {count} consecutive free ports in {low}..{high}")


def port_is_free(port: int) -> bool:
    """Whether nothing listens on (or holds) 127.0.0.1:port."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class Server:
    """One `hybridlb serve` process tree (one node)."""

    def __init__(self, model: str, *flags: str, port: int | None = None, own_group: bool = False,
                 host: str = "127.0.0.1", launcher=None, command: list[str] | None = None, env=None):
        """``own_group``: a process group of its own, so a test can Ctrl-C it as a terminal would.
        ``host``: where its API listens (``--host``); ``launcher``: wraps the command line (e.g. to
        run it on a host of ``tests/netns``); ``command``: run this instead of the usual
        ``hybridlb serve`` line (its API at ``host:port``), with ``env`` added."""
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        self.model = model
        if command is None:
            # float32 unless a test asks otherwise: token-for-token comparisons are exact only there.
            dtype = [] if "--dtype" in flags else ["--dtype", "float32"]
            command = [sys.executable, "-m", "hybridlb", "serve", "--model", model, "--port", str(self.port),
                       "--max-model-len", "512", "--kv-cache-gib", "0.05", *dtype, *flags]
            if host != "127.0.0.1":
                command += ["--host", host]
        if launcher is not None:
            command = launcher(command)
        # If this test process dies, the server gets SIGTERM instead of living on.
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        preexec_fn=die_with_parent, start_new_session=own_group,
                                        env={**os.environ, **env} if env else None)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any("hybridlb is ready" in line for line in self.lines):
                return
            if self.process.poll() is not None:
                time.sleep(0.2)
                raise RuntimeError(f"hybridlb serve exited early:\n{self.output}")
            time.sleep(0.2)
        raise TimeoutError(f"hybridlb serve did not become ready:\n{self.output}")

    def children(self) -> dict[str, int]:
        """Command line (a process title for hybridlb's own) → pid of this server's children."""
        pids = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text().split()
        titles = {}
        for pid in pids:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            except FileNotFoundError:
                continue
            titles[cmdline] = int(pid)
        return titles

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                for pid in self.children().values():
                    os.kill(pid, signal.SIGKILL)
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_servers(*servers: Server) -> list[Server]:
    """Wait for every server (they start in parallel); stop them all if one fails."""
    try:
        for server in servers:
            server.wait_ready()
    except BaseException as exc:
        for server in servers:
            server.stop()
        others = [f"--- {s.url}:\n{s.output[-3000:]}" for s in servers if len(servers) > 1]
        if others and isinstance(exc, (RuntimeError, TimeoutError)):
            raise type(exc)(f"{exc}\n" + "\n".join(others)) from None  # every node's side of it
        raise
    return list(servers)


def start_server(model: str, *flags: str) -> Server:
    return start_servers(Server(model, *flags))[0]


def completion(url: str, model: str, prompt: str = "GPU", max_tokens: int = 4, **extra) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()
