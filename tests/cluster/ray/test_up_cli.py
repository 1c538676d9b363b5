"""The README's main command: `hybridlb up configs/local.yaml`, start to Ctrl-C."""

from __future__ import annotations

import contextlib
import re
import tempfile
from pathlib import Path

import httpx
import yaml

from hybridlb.lifecycle import descendants, wait_gone
from hybridlb.testing.ports import free_port
from hybridlb.testing.servers import interrupt, up_until_ready

ROOT = Path(__file__).resolve().parents[3]


def test_up_local_config_serves_and_stops_on_ctrl_c(tmp_path):
    config = yaml.safe_load((ROOT / "configs/local.yaml").read_text())  # the real model, SmolLM2
    config["api"]["port"] = port = free_port()
    config["ray"]["name"] = "readme"
    path = tmp_path / "local.yaml"
    path.write_text(yaml.safe_dump(config))
    process, lines = up_until_ready(path, 240)
    try:
        output = "".join(lines)
        assert re.search(rf"http://127\.0\.0\.1:{port}/v1", output), output
        assert re.search(r"Ray dashboard: http://127\.0\.0\.1:\d+", output), output  # where the actors show
        body = {"model": "SmolLM2-135M-Instruct", "temperature": 0, "max_tokens": 32,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]}
        response = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        assert "Paris" in response.json()["choices"][0]["message"]["content"]
        ranks = httpx.get(f"http://127.0.0.1:{port}/ranks").json()
        assert ranks["ranks"] == [0, 1]
        # A one-machine cluster keeps to loopback, as the README promises.
        assert ranks["coordinator"].startswith("tcp://127.0.0.1:"), ranks["coordinator"]
        assert Path(tempfile.gettempdir(), "hybridlb-ray-readme").stat().st_mode & 0o777 == 0o700
    finally:
        ray_processes = descendants(process.pid)
        interrupt(process, lines)
    assert ray_processes and not wait_gone(ray_processes, 0), "up returned before its Ray cluster was gone"
    assert not Path(tempfile.gettempdir(), "hybridlb-ray-readme").exists()
    with contextlib.suppress(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
        raise AssertionError("the API server still answers after Ctrl-C")
