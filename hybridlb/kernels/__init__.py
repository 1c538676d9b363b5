"""The engine's C kernels, behind one declared interface.

A CPU decoder layer in eager torch is ~60 small ops whose fixed cost (~5-10 µs each) dominates a
decode step; these kernels fuse the small work between the matmuls into four calls per layer, and
run the matmuls themselves where the CPU has the instructions for it (AVX-512 BF16 / VNNI, AMX).

* ``csrc/``: the C sources, and ``csrc/abi.h``, the one declaration of what they export (every
  function's prototype, the decode program's operations and step, the layout constants).
* ``build``: compiles ``csrc/`` once per machine into a cached shared library.
* ``bindings``: the same interface for ctypes (argument and return types), and ``abi`` checks it
  against the header whenever the library is loaded: a mismatch is an ``ABIError``, not a crash.
* ``CPUKernels`` (cpu_kernels.py): the ops on torch tensors; ``layouts``: the packed weight layouts.

Without a compiler the engine runs the same model on torch ops alone (``load()`` returns None and
logs why). Set ``HYBRIDLB_CPU_KERNELS=0`` to force the torch path when debugging.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import subprocess

from hybridlb.kernels import abi
from hybridlb.kernels.abi import ABIError
from hybridlb.kernels.bindings import INT4_GROUP, PANEL, PROGRAM_OP_WORDS, Op, ProgramStep
from hybridlb.kernels.build import build
from hybridlb.kernels.cpu_kernels import AMX_MIN_ROWS, INT4_AMX_MIN_ROWS, CPUKernels
from hybridlb.kernels.layouts import DTYPES, bf16_fits, fit, int8_fits

__all__ = ["AMX_MIN_ROWS", "DTYPES", "INT4_AMX_MIN_ROWS", "INT4_GROUP", "PANEL", "PROGRAM_OP_WORDS", "ABIError",
           "CPUKernels", "Op", "ProgramStep", "bf16_fits", "build", "fit", "int8_fits", "load"]

log = logging.getLogger(__name__)


@functools.cache
def load() -> CPUKernels | None:
    """The kernels, built if needed; None (logged once) where they cannot be. Raises ABIError where
    the bindings disagree with csrc/abi.h (a bug, never a reason to fall back)."""
    if os.environ.get("HYBRIDLB_CPU_KERNELS", "1") == "0":
        return None
    abi.check()
    try:
        return CPUKernels(ctypes.CDLL(str(build())))
    except (OSError, subprocess.CalledProcessError, RuntimeError) as error:
        log.warning("CPU kernels unavailable (%s); the model runs on torch ops alone, slower", error)
        return None
