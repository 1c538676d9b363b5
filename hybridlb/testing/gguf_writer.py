"""Write a llama-architecture GGUF file from a make-model checkpoint, as llama.cpp's converter
lays it out (metadata keys, tensor names, q/k rows permuted, byte-level BPE tokenizer), with
the 2-D weights in one GGML type. Test data only: the gguf package quantizes what it can
(F32, F16, BF16, Q8_0, Q4_0, Q4_1); for K-quants, which it only dequantizes, the blocks are
random bytes with sane scales, so the file is still a valid model of that type.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# Byte offset and value of the float16 super-block scales in each K-quant block, chosen so that
# the weights come out zero-mean with a std of about 0.2 (Q4_K: d, dmin; Q6_K: d).
_K_SCALES = {"Q4_K": ((0, 0.001), (2, 0.0075)), "Q6_K": ((-2, 0.00015),)}


def _gguf_name(name: str) -> str:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = name.split(".", 3)
    return f"blk.{layer}.{LAYER_NAMES[rest]}"


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: each head's rotate-half pairs interleaved."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def _random_k_blocks(shape: tuple[int, int], qtype, rng: np.random.Generator) -> np.ndarray:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (shape[0], shape[1] // block, size), dtype=np.uint8)
    for offset, value in _K_SCALES[qtype.name]:
        start = offset % size
        blocks[..., start : start + 2] = np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)
    return blocks.reshape(shape[0], -1)


def write_gguf(model_dir: str | Path, out: str | Path, qtype_name: str, seed: int = 0, arch: str = "llama",
               tokenizer_model: str = "gpt2", sampling: dict | None = None) -> Path:
    """``model_dir`` (a llama make-model checkpoint) as one GGUF file at ``out``; ``arch`` and
    ``tokenizer_model`` only change what the metadata says (to make broken files); ``sampling``
    writes ``general.sampling.*`` defaults (keys temp, top_k, top_p, penalty_repeat)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[qtype_name]
    model_dir, out = Path(model_dir), Path(out)
    cfg = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    writer = gguf.GGUFWriter(out, arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_rope_dimension_count(cfg["head_dim"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_vocab_size(cfg["vocab_size"])
    for key, value in (sampling or {}).items():
        getattr(writer, f"add_sampling_{key}")(value)
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    merges = tok["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(vocab["<|im_start|>"])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_chat_template(json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"])
    rng = np.random.default_rng(seed)
    for name, array in load_file(model_dir / "model.safetensors").items():
        array = array.astype(np.float32)
        if name.endswith("q_proj.weight"):
            array = _permute(array, cfg["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            array = _permute(array, cfg["num_key_value_heads"])
        if array.ndim == 1:
            writer.add_tensor(_gguf_name(name), array)
        elif qtype.name in _K_SCALES:
            writer.add_tensor(_gguf_name(name), _random_k_blocks(array.shape, qtype, rng), raw_dtype=qtype)
        else:
            writer.add_tensor(_gguf_name(name), gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
