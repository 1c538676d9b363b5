"""The package map docs/architecture.md draws: packages are processes, and imports only
run down the layers (the CLI on top; the shared config, protocol and helpers at the bottom)."""

from __future__ import annotations

import subprocess
import sys


def test_the_api_server_never_loads_torch():
    code = ("import sys, hybridlb.api, hybridlb.api.app, hybridlb.api.http_server, hybridlb.launch.node; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
