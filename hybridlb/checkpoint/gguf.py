"""GGUF checkpoints without torch: architecture, tokenizer and sampling defaults read from
one llama.cpp file's metadata (the weights: ``hybridlb.model.gguf_tensors``).

The header (metadata, tensor table) is read by ``gguf_header`` in one pass (the ``gguf``
package's reader takes seconds over a large vocabulary); the ``gguf`` package dequantizes
every tensor type it knows (F32, F16, BF16, Q8_0, Q4_0, Q4_1, the K-quants, ...) to float32.
What this module adds is the mapping to what a Hugging Face checkpoint says:

* metadata keys (``llama.block_count``, ...) → a ``config.json``-shaped dict;
* ``tokenizer.ggml.*`` → a ``tokenizers`` byte-level BPE, the chat template and eos ids.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from hybridlb.checkpoint.gguf_header import Unsupported, read_header
from hybridlb.checkpoint.path import CheckpointError

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# Pre-tokenizer split patterns by ``tokenizer.ggml.pre``; any other byte-level file splits
# like GPT-2 (SmolLM, StarCoder, GPT-2 itself), as transformers does.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
          "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


@dataclass(frozen=True)
class _Tensor:
    kind: object  # gguf.GGMLQuantizationType
    dtype: np.dtype  # the array the gguf package makes of its bytes (block types: uint8 rows)
    shape: tuple[int, ...]
    offset: int  # in the file


@dataclass(frozen=True)
class Parsed:
    fields: dict[str, object]  # every metadata key's value
    tensors: dict[str, _Tensor]  # in the file's order


@lru_cache(maxsize=2)
def parsed(path: Path) -> Parsed:
    """The file's metadata and tensor table, parsed once per process (``gguf_header``; a file it does not
    take, by the gguf package's reader). Tensor data is mapped from the file when read (``tensor_data``)."""
    try:
        fields, table = read_header(path)
    except Unsupported:
        return _parsed_by_gguf(path)
    return Parsed(fields, {name: _Tensor(kind, dtype, shape, offset) for name, kind, dtype, shape, offset in table})


def _parsed_by_gguf(path: Path) -> Parsed:
    """The gguf package's reader: slower (a numpy view of every token and merge, dropped at once), but it
    reads what ``gguf_header`` does not, or says what is wrong with the file."""
    import gguf

    try:
        found = gguf.GGUFReader(str(path))
    except Exception as exc:
        raise CheckpointError(f"{path} is not a readable GGUF file: {exc}") from None
    fields = {name: field.contents() for name, field in found.fields.items()}
    tensors = {t.name: _Tensor(t.tensor_type, t.data.dtype, tuple(t.data.shape), int(t.data_offset))
               for t in found.tensors}
    return Parsed(fields, tensors)


@lru_cache(maxsize=2)
def _mapped(path: Path) -> np.memmap:
    return np.memmap(path, dtype=np.uint8, mode="r")


def tensor_data(path: Path, name: str) -> np.ndarray:
    """Tensor ``name`` as the gguf package reads it, mapped read-only from the file."""
    tensor = parsed(path).tensors[name]
    size = math.prod(tensor.shape) * tensor.dtype.itemsize
    return _mapped(path)[tensor.offset : tensor.offset + size].view(tensor.dtype).reshape(tensor.shape)


def release_readers() -> None:
    """Unmap the files whose tensors were read (an engine, once loaded): the pages of a mapped file it
    touched count in its RSS. The parsed metadata stays (a tokenizer built later reads it)."""
    _mapped.cache_clear()


def _field(path: Path, key: str, default=None):
    value = parsed(path).fields.get(key)
    return default if value is None else value


def _required(path: Path, key: str):
    value = _field(path, key)
    if value is None:
        raise CheckpointError(f"{path}: GGUF metadata {key!r} is missing")
    return value


def _rope(path: Path, arch: str) -> dict:
    rope = {"rope_theta": float(_field(path, f"{arch}.rope.freq_base", 10000.0))}
    scaling = _field(path, f"{arch}.rope.scaling.type", "none")
    if scaling in ("linear", "yarn"):
        rope.update(rope_type=scaling, factor=float(_required(path, f"{arch}.rope.scaling.factor")))
        original = _field(path, f"{arch}.rope.scaling.original_context_length")
        if original:
            rope["original_max_position_embeddings"] = int(original)
    elif scaling != "none":
        raise CheckpointError(f"{path}: GGUF rope scaling {scaling!r} is not supported; supported: linear, yarn")
    if "rope_freqs.weight" in parsed(path).tensors:
        # Llama 3.1+: llama.cpp stores the llama3 per-frequency divisors as a tensor.
        rope["freq_factors"] = dequantized(path, "rope_freqs.weight").tolist()
    return rope


def gguf_config(path: Path) -> dict:
    """The file's architecture as a Hugging Face ``config.json`` dict (parse_spec reads it)."""
    arch = _required(path, "general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not supported; "
                              f"supported: {', '.join(ARCHITECTURES)}")
    if _field(path, f"{arch}.expert_count"):
        raise CheckpointError(f"{path}: MoE GGUF files ({arch}.expert_count={_field(path, f'{arch}.expert_count')}) "
                              "are not supported; serve the model's Hugging Face directory")
    heads = int(_required(path, f"{arch}.attention.head_count"))
    kv_heads = _field(path, f"{arch}.attention.head_count_kv", heads)
    if not isinstance(kv_heads, int):
        raise CheckpointError(f"{path}: per-layer {arch}.attention.head_count_kv is not supported")
    hidden = int(_required(path, f"{arch}.embedding_length"))
    names = parsed(path).tensors
    eos = _field(path, "tokenizer.ggml.eos_token_id")
    return {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(_field(path, f"{arch}.vocab_size") or len(_required(path, "tokenizer.ggml.tokens"))),
        "hidden_size": hidden,
        "num_hidden_layers": int(_required(path, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(_field(path, f"{arch}.attention.key_length", hidden // heads)),
        "intermediate_size": int(_required(path, f"{arch}.feed_forward_length")),
        "rms_norm_eps": float(_field(path, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(_field(path, f"{arch}.context_length", 2048)),
        "rope_parameters": _rope(path, arch),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "hidden_act": "silu",
        "eos_token_id": eos,
    }


def dequantized(path: Path, name: str) -> np.ndarray:
    from gguf.quants import dequantize

    kind = parsed(path).tensors[name].kind
    try:
        return dequantize(tensor_data(path, name), kind)
    except NotImplementedError:
        raise CheckpointError(f"{path}: tensor {name} has type {kind.name}, "
                              "which the gguf package cannot dequantize") from None


# The 4-bit types whose blocks hold their affine grid in a header: value = scale * code + low, codes 0..15,
# one block per 32 consecutive values of a row. Q4_0: {f16 d, 16 code bytes}, value d * (code - 8);
# Q4_1: {f16 d, f16 m, 16 code bytes}, value d * code + m (ggml's block_q4_0 / block_q4_1).
GRID_TYPES = {"Q4_0": 18, "Q4_1": 20}
FOUR_BIT_TYPES = {"Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "IQ4_NL", "IQ4_XS"}


def tensor_type(path: Path, name: str) -> str:
    """The GGUF type of a tensor (F32, BF16, Q8_0, Q4_1, Q4_K, ...)."""
    return parsed(path).tensors[name].kind.name


def block_grids(path: Path, name: str) -> tuple[np.ndarray, np.ndarray] | None:
    """For a Q4_0 / Q4_1 tensor [rows, cols]: each 32-value block's (scale, low) as float32 arrays
    [rows, cols / 32], read from the block headers (so codes can be recovered exactly); else None."""
    kind = parsed(path).tensors[name].kind.name
    size = GRID_TYPES.get(kind)
    if size is None:
        return None
    data = tensor_data(path, name)
    blocks = np.asarray(data).reshape(data.shape[0], -1, size)
    scale = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q4_0":
        return scale, -8 * scale
    low = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
    return scale, low


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte, in which byte-level vocabularies are written."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            spelling[byte] = chr(byte)
        else:
            spelling[byte] = chr(256 + extra)
            extra += 1
    return spelling


def gguf_tokenizer(path: Path):
    """(tokenizers.Tokenizer, special-token config) built from the file's ``tokenizer.ggml.*``."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = _field(path, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(
            f"{path}: GGUF tokenizer {kind!r} is not supported (only byte-level BPE, 'gpt2', as in Llama 3, "
            "Qwen and SmolLM files); serve the model's Hugging Face directory instead"
        )
    tokens = list(_required(path, "tokenizer.ggml.tokens"))
    types = list(_field(path, "tokenizer.ggml.token_type", []))
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    vocab = {(t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode())): i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in _required(path, "tokenizer.ggml.merges")]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    split = SPLITS.get(_field(path, "tokenizer.ggml.pre"))
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tokenizer.decoder = decoders.ByteLevel()
    # A control token spelled outside the byte alphabet is a converter mislabel: skip it.
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(tokens, types, strict=False)
                                  if kind == TOKEN_TYPE_CONTROL and set(t) <= spelled])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, kind in zip(tokens, types, strict=False) if kind == TOKEN_TYPE_USER_DEFINED])

    def token(key: str) -> str | None:
        index = _field(path, f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    bos = token("bos_token_id")
    if _field(path, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])])
    config = {
        "bos_token": bos,
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "chat_template": _field(path, "tokenizer.chat_template"),
    }
    return tokenizer, config


def gguf_eos_token_ids(path: Path) -> list[int]:
    """End-of-sequence ids: eos plus end-of-turn / end-of-message where the file names them."""
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    return sorted({v for k in keys if (v := _field(path, f"tokenizer.ggml.{k}")) is not None})


GGUF_SAMPLING = {"temp": "temperature", "top_p": "top_p", "top_k": "top_k", "penalty_repeat": "repetition_penalty"}


def gguf_sampling_defaults(path: Path) -> dict[str, float | int]:
    """The ``general.sampling.*`` defaults a converter may record, as SamplingParams fields."""
    found = {field: _field(path, f"general.sampling.{key}") for key, field in GGUF_SAMPLING.items()}
    return {field: value for field, value in found.items() if value is not None}
