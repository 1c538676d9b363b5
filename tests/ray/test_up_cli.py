"""The README's main command: `hybridlb up configs/local.yaml`, start to Ctrl-C."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import yaml

from hybridlb.lifecycle import die_with_parent
from tests.servers import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_up_local_config_serves_and_stops_on_ctrl_c(tmp_path):
    config = yaml.safe_load((ROOT / "configs/local.yaml").read_text())
    config["engine"]["model"] = str(tmp_path / "models/tiny-qwen3")  # made on first use
    config["api"]["port"] = port = free_port()
    config["ray"]["name"] = "readme"
    path = tmp_path / "local.yaml"
    path.write_text(yaml.safe_dump(config))
    process = subprocess.Popen([sys.executable, "-m", "hybridlb", "up", str(path)], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, preexec_fn=die_with_parent)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True).start()
    try:
        deadline = time.monotonic() + 240
        while not any("is ready" in line for line in lines):
            assert process.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "".join(lines)
            time.sleep(0.5)
        output = "".join(lines)
        assert re.search(rf"http://127\.0\.0\.1:{port}/v1", output), output
        body = {"model": config["engine"]["model"], "prompt": "The weather", "max_tokens": 5}
        response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 5
        ranks = httpx.get(f"http://127.0.0.1:{port}/ranks").json()
        assert ranks["ranks"] == [0, 1]
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    assert process.returncode == 0, "".join(lines)
    with contextlib.suppress(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
        raise AssertionError("the API server still answers after Ctrl-C")
