"""hybridlb's one-pass GGUF header reader gives what the gguf package's reader gives: every metadata
field's value and each tensor's type, array dtype, shape and data offset, for the real SmolLM2 file and
for files of each tensor type; a file it does not take still gets GGUFReader's clear error."""

from __future__ import annotations

import pytest

from hybridlb.checkpoint.gguf_header import Unsupported, read_header
from hybridlb.checkpoint.path import resolve
from hybridlb.testing.gguf_writer import write_gguf
from tests.conftest import SMOLLM2


def _by_gguf(path):
    import gguf

    reader = gguf.GGUFReader(str(path))
    fields = {name: field.contents() for name, field in reader.fields.items()}
    tensors = [(t.name, t.tensor_type, t.data.dtype, tuple(t.data.shape), int(t.data_offset)) for t in reader.tensors]
    return fields, tensors


def _same(path):
    ours, theirs = read_header(path), _by_gguf(path)
    assert ours[0].keys() == theirs[0].keys()
    for key, value in theirs[0].items():
        assert ours[0][key] == value and type(ours[0][key]) is type(value), key
    assert ours[1] == theirs[1]


def test_the_bundled_smollm2_file_reads_the_same():
    _same(resolve(SMOLLM2).path)


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_1", "Q4_K", "Q6_K"])
def test_each_tensor_type_reads_the_same(tmp_path, llama256_dir, qtype):
    _same(write_gguf(llama256_dir, tmp_path / f"model.{qtype}.gguf", qtype, sampling={"temp": 0.5, "top_k": 40}))


def test_what_it_does_not_take_is_named(tmp_path, llama256_dir):
    path = write_gguf(llama256_dir, tmp_path / "model.gguf", "F16")
    data = bytearray(path.read_bytes())
    data[4] = 7  # version 7
    path.write_bytes(bytes(data))
    with pytest.raises(Unsupported, match="version 7"):
        read_header(path)
    (tmp_path / "other.gguf").write_bytes(b"GGML" + bytes(60))
    with pytest.raises(Unsupported, match="magic"):
        read_header(tmp_path / "other.gguf")
