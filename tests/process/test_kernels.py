"""The C kernels against the torch code they replace, in both dtypes they serve.

bfloat16 norms, RoPE and SiLU must round exactly where torch rounds (the kernels'
promise); attention is compared in float32 within accumulation-order tolerance.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridlb import kernels
from hybridlb.model import memory
from tests.unit.test_kernels import K, pytestmark, seed  # noqa: F401 - fixtures: seed


def test_a_failing_compiler_is_reported_not_raised(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"compiling kernels\.c .* failed"):
        kernels.build()
    kernels.load.cache_clear()
    try:
        assert kernels.load() is None
    finally:
        monkeypatch.undo()
        kernels.load.cache_clear()
        assert kernels.load() is not None


def test_engines_starting_together_build_the_kernels_once(tmp_path):
    """Two processes that find no cached library at the same moment: one compiles, the other waits
    for it and loads the same file (each used to compile the lot, ~30 s of CPU apiece)."""
    calls = tmp_path / "calls"
    compiler = tmp_path / "cc"
    real = shutil.which("cc") or shutil.which("gcc")
    # The real compiler at -O0: the lock is under test, not the code (-O3 takes ~2 min of a core).
    compiler.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n'
                        'for a in "$@"; do shift; [ "$a" = -O3 ] && a=-O0; set -- "$@" "$a"; done\n'
                        f'exec {real} "$@"\n')
    compiler.chmod(0o755)
    env = {**os.environ, "CC": str(compiler), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    build = "from hybridlb import kernels; print(kernels.build()); assert kernels.load() is not None"
    runs = [subprocess.Popen([sys.executable, "-c", build], env=env, stdout=subprocess.PIPE, text=True)
            for _ in range(2)]
    paths = {run.communicate(timeout=300)[0].strip() for run in runs}
    assert [run.returncode for run in runs] == [0, 0]
    assert len(paths) == 1 and Path(paths.pop()).exists()
    compiled = [line for line in calls.read_text().splitlines() if " -c " in line and "attention.c" in line]
    assert len(compiled) == 1, compiled


if K is not None:
    K.use_tiles(kernels.AMX_MIN_ROWS, kernels.INT4_AMX_MIN_ROWS)


def _huge_page_kib(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            low, high = (int(part, 16) for part in head.split("-"))
            inside = low <= address < high
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_kv_cache_buffers_are_zeroed_independent_and_on_huge_pages():

    shapes = [(300, 3, 64, 16), (300, 3, 16, 64), (7, 5)]
    tensors = memory.zeros(shapes, torch.bfloat16)
    assert [tuple(t.shape) for t in tensors] == shapes
    assert all(t.dtype == torch.bfloat16 and t.is_contiguous() and not t.any() for t in tensors)
    assert all(t.data_ptr() % 64 == 0 for t in tensors)
    for i, t in enumerate(tensors):
        t.fill_(i + 1)
    assert [t.unique().tolist() for t in tensors] == [[1.0], [2.0], [3.0]]
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("transparent huge pages are off on this machine")
    # In a fresh process, as an engine allocates its cache: here, after other tests, the allocator may
    # hand back memory already touched on small pages, which madvise does not convert.
    probe = ("import torch; from hybridlb.model import memory; from tests.process.test_kernels import _huge_page_kib; "
             f"t = memory.zeros({shapes!r}, torch.bfloat16)[0]; t.fill_(1); print(_huge_page_kib(t.data_ptr()))")
    ran = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert int(ran.stdout.split()[-1]) >= 2048, ran.stdout
