"""The kernels' shared library: compiled from ``csrc/`` once per machine with the system's C
compiler, cached under ``$XDG_CACHE_HOME/hybridlb`` (``~/.cache/hybridlb``), keyed by the sources,
the flags, the compiler and the CPU's features, and written atomically. Engines starting together
build it once (a file lock), the units compiled in parallel."""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from hybridlb.cpu_features import cpu_flags

SOURCE_DIR = Path(__file__).parent / "csrc"
# -fopenmp: the kernels split large calls over threads with OpenMP. The library's DT_NEEDED
# libgomp.so.1 resolves, at load, to the copy torch already loaded (the dynamic loader matches
# loaded sonames), so both share one pool: no second set of threads contending for the cores.
# -Werror=missing-prototypes: a function the library exports must be declared in abi.h first.
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-fopenmp",
         "-Werror=missing-prototypes"]
# kernels.c rounds exactly as torch does, so no fused multiply-adds there; attention.c may. Its
# row loops in 16 lanes where the CPU has AVX-512 (GCC's default is 8 on Intel; SiLU-and-mul at
# 64 rows: 65 -> 48 us on a 2-core Xeon).
UNITS = {"kernels.c": ["-ffp-contract=off", "-mprefer-vector-width=512"], "attention.c": ["-ffp-contract=fast"],
         "lora.c": ["-ffp-contract=fast"], "int8.c": ["-ffp-contract=fast"], "bf16.c": ["-ffp-contract=fast"],
         "int4.c": ["-ffp-contract=fast"], "program.c": []}


def build() -> Path:
    """The library's path, compiled first unless cached; RuntimeError where it cannot be."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler found (install gcc, or set CC)")
    key = hashlib.sha256()
    for part in [*(p.read_bytes() for p in sorted(SOURCE_DIR.iterdir())), repr((FLAGS, UNITS)).encode(),
                 _compiler_version(compiler), _cpu_features(), platform.machine().encode()]:
        key.update(part)
    target = _cache_dir() / f"kernels-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Engines starting together on a fresh machine: the first builds, the others wait for it
    # (each would otherwise spend ~30 s of CPU on the same build while the first one runs).
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists():
            _compile(compiler, target)
    return target


def _compile(compiler: str, target: Path) -> None:
    """Every unit at once (the build is as long as attention.c's), then link; renamed into place."""
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        objects = {unit: str(Path(scratch) / f"{unit}.o") for unit in UNITS}
        jobs = {unit: subprocess.Popen([compiler, *FLAGS, *flags, "-c", str(SOURCE_DIR / unit), "-o", objects[unit]],
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for unit, flags in UNITS.items()}
        errors = {unit: job.communicate()[1] for unit, job in jobs.items()}
        failed = [unit for unit, job in jobs.items() if job.returncode]
        if failed:
            raise RuntimeError(f"compiling {failed[0]} ({SOURCE_DIR}) failed: {errors[failed[0]].strip()[:500]}")
        built = Path(scratch) / target.name
        _run([compiler, "-shared", "-fopenmp", *objects.values(), "-o", str(built), "-lm"], "linking the kernels")
        os.replace(built, target)


def _run(command: list[str], what: str) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{what} ({SOURCE_DIR}) failed: {result.stderr.strip()[:500]}")


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hybridlb"


def _compiler_version(compiler: str) -> bytes:
    return subprocess.run([compiler, "--version"], capture_output=True).stdout


def _cpu_features() -> bytes:
    """The flags -march=native compiles for; a cache shared between machines must not mix them."""
    return " ".join(sorted(cpu_flags())).encode() or platform.processor().encode()
