"""The Python side of the kernels' interface: each C function's ctypes argument and return types,
the decode program's operation kinds and step, and the layout constants, in one table each.

``csrc/abi.h`` declares the same interface in C; ``abi.check`` compares the two when the library
is loaded, so an argument added on one side only is an error naming the function, not a crash.
"""

from __future__ import annotations

import ctypes
import enum

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
SUFFIXES = ("f32", "bf16")  # kernels compiled once per element type: float32, bfloat16


def _per_type(name: str, argtypes: tuple, restype=None) -> dict[str, tuple[tuple, type | None]]:
    return {f"{name}_{suffix}": (argtypes, restype) for suffix in SUFFIXES}


# name -> (argtypes, restype); None returns nothing.
FUNCTIONS: dict[str, tuple[tuple, type | None]] = {
    **_per_type("rms_norm", (_P, _I, _P, _P, _P, _I, _I, _F, _I)),
    **_per_type("rope_store", (_P, _I, _P, _I, _P, _I, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I)),
    **_per_type("silu_mul", (_P, _P, _I, _I, _I)),
    **_per_type("paged_attention", (_P, _I, _P, _P, _P, _I, _P, _P, _P, _I, _I, _I, _I, _I, _F, _I)),
    **_per_type("lora_add", (_P, _I, _P, _I, _I, _I, _P, _P, _P, _I, _P, _P, _I, _I, _I)),
    "bf16_matmul_supported": ((), _I),
    "bf16_amx_enable": ((_I,), _I),
    "bf16_pack": ((_P, _P, _I, _I, _I), None),
    "bf16_matmul": ((_P, _I, _P, _P, _P, _I, _I, _I, _I, _I), None),
    "int8_matmul_supported": ((), _I),
    **_per_type("int8_matmul", (_P, _I, _P, _P, _P, _P, _P, _I, _I, _I, _I)),
    "int8_group_matmul": ((_P, _I, _P, _P, _P, _I, _I, _I, _I), None),
    "int4_matmul_supported": ((), _I),
    "int4_amx_min_rows": ((_I,), None),
    "int4_matmul": ((_P, _I, _P, _P, _P, _I, _I, _I, _I), None),
    "program_run": ((_P, _I, _I, _P, _I), _I),
}

PANEL = 16  # output columns per panel of a packed weight (bf16.c, int8.c, int4.c)
INT4_GROUP = 32  # int4.c's inputs per scale and low
PROGRAM_OP_WORDS = 20  # int64 words per decode program operation
# The header's #define constants Python relies on.
CONSTANTS = {"PANEL": PANEL, "INT4_GROUP": INT4_GROUP, "PROGRAM_OP_WORDS": PROGRAM_OP_WORDS}


class Op(enum.IntEnum):
    """The decode program's operation kinds (abi.h's ``enum program_op``, OP_ and these names)."""

    NORM = 1
    BF16 = 2
    INT4 = 3
    INT8 = 4
    ROPE = 5
    ATTENTION = 6
    SILU = 7


class ProgramStep(ctypes.Structure):
    """What each replayed step brings (abi.h's ``struct program_step``)."""

    _fields_ = [("positions", _P), ("slots", _P), ("block_table", _P), ("table_width", _I), ("query_start", _P),
                ("lengths", _P), ("seqs", _I)]


def bind(library: ctypes.CDLL) -> dict[str, ctypes._CFuncPtr]:
    """Every function of ``FUNCTIONS`` from the loaded library, typed."""
    functions = {}
    for name, (argtypes, restype) in FUNCTIONS.items():
        function = getattr(library, name)
        function.argtypes, function.restype = list(argtypes), restype
        functions[name] = function
    return functions
