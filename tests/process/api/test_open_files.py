"""An API server lifts its own open-files limit, so ~1,000 clients do not hit the usual 1024."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest

LISTEN_AND_REPORT = (
    "import resource\n"
    "from hybridlb.api.http_server import listen\n"
    "sock = listen('127.0.0.1', 0, False)\n"
    "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
)


def test_listening_lifts_the_soft_open_files_limit_up_to_the_hard_one():
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip(f"the hard open-files limit ({hard}) leaves nothing to lift")
    run = subprocess.run([sys.executable, "-c", LISTEN_AND_REPORT], capture_output=True, text=True, timeout=120,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)))
    assert run.returncode == 0, run.stderr
    assert int(run.stdout) == (65536 if hard == resource.RLIM_INFINITY else min(65536, hard))
