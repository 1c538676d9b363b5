"""The unit tier runs in-process: a test here that starts a process (a server, an engine, Ray, a
CLI run) fails at once, naming the tier it belongs to. The one process allowed is the compiler
of the C kernels' one-time build (hybridlb/kernels), which any kernel call may trigger."""

from __future__ import annotations

import multiprocessing.process
import subprocess
import sys

import pytest

_KERNELS = "/hybridlb/kernels/"


def _from_the_kernel_build() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if _KERNELS in frame.f_code.co_filename.replace("\\", "/"):
            return True
        frame = frame.f_back
    return False


def _refuse(what: str):
    raise AssertionError(f"a unit test started {what}: tests/unit runs in-process; a test that starts a "
                         "process belongs in tests/process (one engine or serve tree) or tests/cluster")


@pytest.fixture(autouse=True)
def _in_process_only(monkeypatch):
    popen_init = subprocess.Popen.__init__

    def popen(self, args, *rest, **kwargs):
        if not _from_the_kernel_build():
            _refuse(f"a process ({args if isinstance(args, str) else ' '.join(map(str, args))[:200]})")
        popen_init(self, args, *rest, **kwargs)

    def start(self):
        _refuse(f"a multiprocessing process ({self.name})")

    monkeypatch.setattr(subprocess.Popen, "__init__", popen)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", start)
