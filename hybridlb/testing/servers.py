"""Real server process trees — ``hybridlb serve`` or a peer's command — started, waited for
until ready, and stopped by the pid this process started (never by name)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from hybridlb.lifecycle import die_with_parent
from hybridlb.testing.ports import free_port
from hybridlb.testing.procs import child_titles, process_tree

# What a test's server gets unless its flags say otherwise: small enough that many run side by side,
# float32 because token-for-token comparisons are exact only there, and a GGUF file dequantized (its
# greedy tokens are transformers'; tests of the quantized default say --quantization themselves).
TEST_DEFAULTS = {"--max-model-len": "512", "--kv-cache-gib": "0.05", "--dtype": "float32", "--quantization": "none"}
READY_LINE = "hybridlb is ready"


class Server:
    """One server process tree (one node): ``hybridlb serve MODEL FLAGS`` unless ``command`` is given.

    ``own_group``: a process group of its own, so a test can Ctrl-C it as a terminal would (a
    benchmark's servers always get one). ``host``: where its API listens; ``launcher``: wraps the
    command line (e.g. to run it on a host of a network namespace); ``command``: run this instead
    (its API at ``host:port``, ready when ``/health`` answers 200), with ``env`` added. ``log``: a
    file for its output instead of memory; ``defaults``: flags added unless ``flags`` give them."""

    def __init__(self, model: str, *flags: str, port: int | None = None, own_group: bool = False,
                 host: str = "127.0.0.1", launcher=None, command: list[str] | None = None, env=None,
                 log: Path | None = None, defaults: dict[str, str] = TEST_DEFAULTS, name: str = "hybridlb"):
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        self.model, self.name = model, name
        self.ready_line = command is None
        if command is None:
            added = [part for flag, value in defaults.items() if flag not in flags for part in (flag, value)]
            command = [sys.executable, "-m", "hybridlb", "serve", "--model", model, "--port", str(self.port),
                       *added, *flags]
            if host != "127.0.0.1":
                command += ["--host", host]
        if launcher is not None:
            command = launcher(command)
        self.lines: list[str] = []
        self.log = open(log, "w") if log is not None else None  # noqa: SIM115 - closed in stop()
        self.started = time.monotonic()
        # If this process dies, the server gets SIGTERM instead of living on.
        self.process = subprocess.Popen(
            command, stdout=self.log or subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            preexec_fn=die_with_parent, start_new_session=own_group or log is not None,
            env={**os.environ, **env} if env else None)
        if self.log is None:
            threading.Thread(target=self._read, daemon=True).start()

    @classmethod
    def vllm(cls, name: str, executable: str, model: str, *flags: str, env: dict | None = None,
             log_dir: Path = Path("/tmp")) -> Server:
        """vLLM's ``vllm serve`` (float32 unless ``flags`` say; vLLM casts to bfloat16 on CPU otherwise)."""
        port = free_port()
        dtype = [] if "--dtype" in flags else ["--dtype", "float32"]
        command = [executable, "serve", model, "--port", str(port), "--max-model-len", "1024", *dtype, *flags]
        return cls(model, port=port, command=command, env=env, log=log_dir / f"bench_{name}_{port}.log", name=name)

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        if self.log is not None:
            return Path(self.log.name).read_text(errors="replace")
        return "".join(self.lines)

    def _ready(self) -> bool:
        if self.ready_line and self.log is None:
            return any(READY_LINE in line for line in self.lines)
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout_s: float = 180) -> float:
        """Seconds from the start until it was ready; raises with its output if it exits or times out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._ready():
                return time.monotonic() - self.started
            if self.process.poll() is not None:
                time.sleep(0.2)
                raise RuntimeError(f"{self.name} exited early:\n{self.output[-20000:]}")
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} did not become ready in {timeout_s:.0f} s:\n{self.output[-20000:]}")

    def children(self) -> dict[str, int]:
        """Command line (a process title for hybridlb's own) → pid of this server's children."""
        return child_titles(self.process.pid)

    def stop(self, timeout_s: float = 20) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                for pid in process_tree(self.process.pid)[1:]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                self.process.kill()
                self.process.wait()
        if self.log is not None:
            self.log.close()
        return self.process.returncode


def start_servers(*servers: Server, timeout_s: float = 180) -> list[Server]:
    """Wait for every server (they start in parallel); stop them all if one fails."""
    try:
        for server in servers:
            server.wait_ready(timeout_s)
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


def up_until_ready(config_path: Path, timeout_s: float) -> tuple[subprocess.Popen, list[str]]:
    """``hybridlb up CONFIG`` in the foreground, as the README runs it, until it says it is ready:
    the process and its output lines so far (still growing). It fails with the output if the
    command exits or is not ready in ``timeout_s`` (and is killed then)."""
    process = subprocess.Popen([sys.executable, "-m", "hybridlb", "up", str(config_path)], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, preexec_fn=die_with_parent)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not any("is ready" in line for line in lines):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            process.wait()
            raise AssertionError("hybridlb up did not become ready:\n" + "".join(lines))
        time.sleep(0.5)
    return process, lines


def interrupt(process: subprocess.Popen, lines: list[str], timeout_s: float = 60) -> None:
    """Ctrl-C a foreground ``hybridlb up`` (``up_until_ready``) as a terminal would; it must exit 0 in
    ``timeout_s`` (else it is killed and this fails), its output in the failure."""
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    assert process.returncode == 0, "".join(lines)
