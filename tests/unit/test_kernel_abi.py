"""The C kernels' interface: csrc/abi.h (what the C side exports) against bindings.py (what ctypes
passes). A difference on one side only must be an error naming what differs, never a crash in C.
No compiler runs here: the check reads the header as text."""

from __future__ import annotations

import ctypes
import enum

import pytest

from hybridlb import kernels
from hybridlb.kernels import abi, bindings
from hybridlb.kernels.abi import ABIError

HEADER = abi.HEADER.read_text()


def header_with(old: str, new: str) -> abi.Header:
    """The real header parsed with one piece of text replaced."""
    assert HEADER.count(old) == 1, old
    return abi.parse(HEADER.replace(old, new))


def functions_with(name: str, argtypes: tuple | None = None, restype=...) -> dict:
    """bindings.FUNCTIONS with one entry changed."""
    table = dict(bindings.FUNCTIONS)
    old_args, old_restype = table[name]
    table[name] = (old_args if argtypes is None else argtypes, old_restype if restype is ... else restype)
    return table


def test_the_header_and_the_bindings_agree():
    abi.check()
    header = abi.read()
    assert len(header.functions["rope_store_bf16"].args) == 18
    assert header.enums["program_op"] == {f"OP_{op.name}": op.value for op in bindings.Op}


def test_every_exported_function_is_bound():
    assert abi.read().functions.keys() == bindings.FUNCTIONS.keys()


def test_an_argument_removed_from_the_header_only_names_the_function():
    header = header_with("int64_t kv_heads, int64_t dim, int64_t block_size, int64_t threads);\n"
                         "void silu_mul_f32", "int64_t kv_heads, int64_t dim, int64_t threads);\nvoid silu_mul_f32")
    with pytest.raises(ABIError, match=r"rope_store_bf16: 17 arguments in abi.h \(.*\), 18 in bindings.py"):
        abi.check(header)


def test_an_argument_added_to_the_bindings_only_names_the_function():
    argtypes = (*bindings.FUNCTIONS["silu_mul_f32"][0], ctypes.c_int64)
    with pytest.raises(ABIError, match=r"silu_mul_f32: 5 arguments in abi.h .*, 6 in bindings.py"):
        abi.check(functions=functions_with("silu_mul_f32", argtypes))


def test_an_argument_of_another_type_names_the_argument():
    header = header_with("int64_t rows,\n                  int64_t hidden, float eps,",
                         "int64_t rows,\n                  int64_t hidden, int64_t eps,")
    with pytest.raises(ABIError, match=r"rms_norm_f32: argument 7 \(eps\) is int64_t in abi.h, float in bindings.py"):
        abi.check(header)


def test_a_return_type_that_differs_is_an_error():
    with pytest.raises(ABIError, match=r"program_run: returns int64_t in abi.h, void in bindings.py"):
        abi.check(functions=functions_with("program_run", restype=None))
    header = header_with("int64_t bf16_matmul_supported(void);", "void bf16_matmul_supported(void);")
    with pytest.raises(ABIError, match=r"bf16_matmul_supported: returns void in abi.h, int64_t in bindings.py"):
        abi.check(header)


def test_a_function_on_one_side_only_is_an_error():
    header = header_with("void int4_amx_min_rows(int64_t rows);",
                         "void int4_amx_min_rows(int64_t rows);\nvoid int4_pack(const uint8_t *codes, int64_t n);")
    with pytest.raises(ABIError, match=r"int4_pack: declared in abi.h, missing from bindings.py"):
        abi.check(header)
    table = dict(bindings.FUNCTIONS, int4_unpack=((ctypes.c_void_p,), None))
    with pytest.raises(ABIError, match=r"int4_unpack: bound in bindings.py, not declared in abi.h"):
        abi.check(functions=table)


def test_an_operation_code_that_differs_is_an_error():
    with pytest.raises(ABIError, match=r"operation OP_ROPE: 9 in abi.h \(enum program_op\), 5 in bindings.py"):
        abi.check(header_with("OP_ROPE = 5,", "OP_ROPE = 9,"))
    shifted = enum.IntEnum("Op", {op.name: op.value + (op.name == "SILU") for op in bindings.Op})
    with pytest.raises(ABIError, match=r"operation OP_SILU: 7 in abi.h \(enum program_op\), 8 in bindings.py"):
        abi.check(ops=shifted)


def test_the_program_step_and_the_constants_are_checked():
    with pytest.raises(ABIError, match=r"struct program_step: .* in abi.h"):
        abi.check(header_with("    int64_t seqs;\n", ""))
    with pytest.raises(ABIError, match=r"#define PANEL: 32 in abi.h, 16 in bindings.py"):
        abi.check(header_with("#define PANEL 16 ", "#define PANEL 32 "))


@pytest.mark.parametrize(("old", "new", "message"), [
    ("void silu_mul_f32(const float *x,", "void silu_mul_f32(const int *x, int y,",
     r"silu_mul_f32's argument 1: type 'int'"),
    ("float eps, int64_t threads);\nvoid rms_norm_bf16", "float, int64_t threads);\nvoid rms_norm_bf16",
     r"rms_norm_f32's argument 7: 'float' is not 'type name'"),
    ("OP_NORM = 1,", "OP_NORM,", r"enum program_op: 'OP_NORM' is not 'NAME = <integer>'"),
    ("#define INT4_GROUP 32", "#define INT4_GROUP (16 * 2)", r"only #define NAME <integer>"),
    ("int64_t int4_matmul_supported(void);", "int64_t int4_matmul_supported(void);\n"
                                             "int64_t int4_matmul_supported(void);", r"declared twice"),
])
def test_c_outside_the_parsers_grammar_is_refused(old, new, message):
    with pytest.raises(ABIError, match=message):
        header_with(old, new)


def test_a_mismatch_stops_the_load_before_anything_is_compiled(monkeypatch):
    monkeypatch.delenv("HYBRIDLB_CPU_KERNELS", raising=False)
    monkeypatch.setitem(bindings.FUNCTIONS, "silu_mul_bf16", ((ctypes.c_void_p,), None))
    monkeypatch.setattr(kernels, "build", lambda: pytest.fail("built the library despite the mismatch"))
    with pytest.raises(ABIError, match="silu_mul_bf16"):
        kernels.load.__wrapped__()
