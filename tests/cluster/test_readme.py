"""The README's commands, and those of the guide pages it leads to (``GUIDE``), run as written, in
order, the way a newcomer pastes them: a server one page starts serves the next page's requests,
`hybridlb up` brings its own Ray cluster. How blocks are marked (skip, background, set-up) and the
link checks: tests/unit/test_readme.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hybridlb.lifecycle import descendants, die_with_parent, wait_gone
from tests.unit.test_readme import ROOT, Block, guide_blocks

BIN = str(Path(sys.executable).parent)


def _env() -> dict:
    return {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "COLUMNS": "100"}


class Background:
    """A server block: started in a session of its own, stopped with Ctrl-C as a terminal would."""

    def __init__(self, command: str, cwd: Path):
        self.command = command
        self.process = subprocess.Popen(["bash", "-c", command], cwd=cwd, env=_env(), stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                        preexec_fn=die_with_parent)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.process.stdout), daemon=True).start()

    def read(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while "is ready" not in self.read():
            assert self.process.poll() is None, f"{self.command!r} exited:\n{self.read()}"
            assert time.monotonic() < deadline, f"{self.command!r} not ready:\n{self.read()}"
            time.sleep(0.5)

    def stop(self) -> None:
        tree = descendants(self.process.pid)
        os.killpg(self.process.pid, signal.SIGINT)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            raise
        assert not wait_gone(tree, 10), f"{self.command!r} left processes behind"
        assert "Traceback" not in self.read(), self.read()


def _run(block: Block, cwd: Path) -> str:
    if block.language == "python":
        command = [sys.executable, "-c", block.text]
    else:
        command = ["bash", "-c", "set -euo pipefail\n" + block.text]
    run = subprocess.run(command, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600)
    output = run.stdout + run.stderr
    assert run.returncode == 0, f"{block.where} failed:\n{block.text}\n{output}"
    assert "Traceback" not in output, output
    # curl exits 0 on any HTTP status: an OpenAI error body in its output is the failure.
    assert not re.search(r'\{"error":\s*\{', run.stdout), f"{block.where}: {run.stdout}"
    return output


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_readme_commands_run_as_written(tmp_path):
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    server: Background | None = None
    ran = 0
    try:
        for block in guide_blocks():
            if block.language not in ("bash", "python") or (block.marker or "").startswith("skip ("):
                continue
            if block.marker in ("background",) or (block.marker or "").startswith("set-up;"):
                command = block.text.strip()
                if block.marker != "background":
                    command = command.split(" && ")[-1].removeprefix(".venv/bin/")
                if server is not None:
                    server.stop()
                server = Background(command, tmp_path)
                server.wait_ready()
            else:
                _run(block, tmp_path)
            ran += 1
    finally:
        if server is not None:
            server.stop()
    assert ran >= 7
    assert json.loads((tmp_path / "result.json").read_text())["completed"] == 64
    assert "LeaderWorkerSet" in (tmp_path / "lws.yaml").read_text()
