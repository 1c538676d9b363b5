"""Ctrl-C at any moment of start-up: `hybridlb up` and `hybridlb serve` (the default config, the
real model on two ranks) stop what started so far within seconds, leaving no process, port or
runtime directory behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import yaml

from hybridlb.lifecycle import descendants, die_with_parent, wait_gone
from hybridlb.testing.ports import free_port, port_is_free

ROOT = Path(__file__).resolve().parents[2]


class Watched:
    """A launcher in a session of its own (Ctrl-C reaches its whole group, as in a terminal),
    with every process it ever had below it recorded until it exits."""

    def __init__(self, command: list[str], env: dict):
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True, preexec_fn=die_with_parent, env=env)
        self.lines: list[str] = []
        self.tree: set[int] = set()
        threading.Thread(target=lambda: self.lines.extend(self.process.stdout), daemon=True).start()
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while self.process.poll() is None:
            self.tree.update(descendants(self.process.pid))
            time.sleep(0.1)

    @property
    def output(self) -> str:
        return "".join(self.lines)


@pytest.mark.slow
@pytest.mark.parametrize("after_s", [5, 15])
@pytest.mark.parametrize("launcher", ["serve", "up"])
def test_ctrl_c_while_starting_stops_everything(tmp_path, launcher, after_s):
    config = yaml.safe_load((ROOT / "configs/local.yaml").read_text())
    config["api"]["port"] = port = free_port()
    config["ray"]["name"] = name = f"interrupted-{launcher}-{after_s}"
    path = tmp_path / "local.yaml"
    path.write_text(yaml.safe_dump(config))
    # A short TMPDIR (pytest's, under xdist, leaves too little of a socket path's 107 bytes).
    runtime = Path(tempfile.mkdtemp(prefix="ctrlc-", dir="/tmp"))
    # serve's runtime directory goes under TMPDIR; up's is the actors' own (hybridlb-ray-<name>).
    env = {**os.environ, "TMPDIR": str(runtime)} if launcher == "serve" else dict(os.environ)
    command = ["serve", "--config", str(path)] if launcher == "serve" else ["up", str(path)]
    watched = Watched([sys.executable, "-m", "hybridlb", *command], env)
    time.sleep(after_s)
    os.killpg(watched.process.pid, signal.SIGINT)
    started = time.monotonic()
    try:
        code = watched.process.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(watched.process.pid, signal.SIGKILL)
        raise AssertionError(f"still running 20 s after Ctrl-C:\n{watched.output}") from None
    stopped_s = time.monotonic() - started
    time.sleep(0.5)
    output = watched.output
    assert code in (0, 1, 130), output  # stopped after ready, stopped while starting, or killed by a second signal
    assert "Traceback" not in output, output
    assert "stopping" in output, output
    assert not wait_gone(sorted(watched.tree), 5), f"processes left: {wait_gone(sorted(watched.tree), 0)}"
    assert port_is_free(port)
    assert not list(runtime.glob("hybridlb-*")), list(runtime.iterdir())
    assert not Path(tempfile.gettempdir(), f"hybridlb-ray-{name}").exists()
    runtime.rmdir()
    print(f"{launcher}: Ctrl-C {after_s} s in, exit {code} after {stopped_s:.1f} s")
