"""Write small random-weight Hugging Face checkpoints that run fully offline.

The output is exactly the format the loader (and ``transformers``) read: config.json,
safetensors (optionally sharded with an index), tokenizer.json trained here as a
byte-level BPE on the corpus shipped with the package, tokenizer_config.json with a
ChatML chat template, and generation_config.json.

Random weights easily give degenerate models whose greedy output repeats the last
prompt token whatever the context, which would make correctness tests vacuous. Untied
embeddings and a larger init scale give continuations that vary with the prompt.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from hybridlb.checkpoint.spec import parse_spec
from hybridlb.model.loader import checkpoint_layout

ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "mixtral": ("MixtralForCausalLM", "mixtral"),
}
SIZES = {
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, intermediate_size=256, moe_intermediate_size=64, num_experts=8,
                 num_experts_per_tok=2, vocab_size=1024, max_position_embeddings=2048),
    "small": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                  head_dim=64, intermediate_size=1536, moe_intermediate_size=384, num_experts=8,
                  num_experts_per_tok=2, vocab_size=4096, max_position_embeddings=4096),
}
# Init scale per family: a Llama without qk-norm needs more to stop repeating itself.
INIT_STD = {"llama": 0.2, "qwen2": 0.2, "qwen3": 0.1, "qwen3_moe": 0.1, "mixtral": 0.2}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE trained on the shipped corpus (deterministic, offline)."""
    corpus = resources.files("hybridlb.model").joinpath("corpus.txt").read_text(encoding="utf-8")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus.splitlines(keepends=True), trainer)
    return tokenizer


def model_config(arch: str, size: str, vocab_size: int, eos_ids: list[int], dims: dict | None = None) -> dict:
    """config.json in the Hugging Face hub's field names; ``dims`` overrides the size's fields."""
    architecture, model_type = ARCHITECTURES[arch]
    dims = {**SIZES[size], **(dims or {})}
    moe = {k: dims.pop(k) for k in ("moe_intermediate_size", "num_experts", "num_experts_per_tok")}
    cfg = {
        "architectures": [architecture],
        "model_type": model_type,
        **dims,
        "vocab_size": vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": eos_ids[0],
        "eos_token_id": eos_ids,
        "torch_dtype": "float32",
    }
    if arch == "llama":
        cfg["attention_bias"] = False
    if arch == "qwen3_moe":
        cfg.update(num_experts=moe["num_experts"], num_experts_per_tok=moe["num_experts_per_tok"],
                   moe_intermediate_size=moe["moe_intermediate_size"], norm_topk_prob=True,
                   decoder_sparse_step=1, mlp_only_layers=[])
    if arch == "mixtral":
        cfg.update(num_local_experts=moe["num_experts"], num_experts_per_tok=moe["num_experts_per_tok"],
                   intermediate_size=moe["moe_intermediate_size"])
    return cfg


def random_weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor the loader expects, filled with seeded random values."""
    spec = parse_spec(cfg, Path("config.json"))
    std = INIT_STD[cfg["model_type"]]
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for source in checkpoint_layout(spec).values():
        for name, shape in zip(source.names, source.shapes, strict=True):
            if name.endswith("norm.weight"):
                tensors[name] = torch.ones(shape)
            else:
                tensors[name] = torch.randn(shape, generator=generator) * std
    return tensors


def _save_weights(tensors: dict[str, torch.Tensor], out: Path, max_shard_mb: float | None) -> None:
    if not max_shard_mb:
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_mb * 2**20:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def make_model(arch: str, size: str, out: str | Path, seed: int = 0, max_shard_mb: float | None = None,
               dims: dict | None = None) -> Path:
    """Write a random-weight checkpoint of ``arch`` at ``size`` into ``out`` (``dims``: config.json
    fields to change, e.g. ``{"hidden_size": 256}``)."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(SIZES[size]["vocab_size"])
    eos_ids = [tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")]
    cfg = model_config(arch, size, tokenizer.get_vocab_size(), eos_ids, dims)
    _save_weights(random_weights(cfg, seed), out, max_shard_mb)
    tokenizer.save(str(out / "tokenizer.json"))
    files = {
        "config.json": cfg,
        "generation_config.json": {"eos_token_id": eos_ids, "bos_token_id": eos_ids[0], "do_sample": False},
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "bos_token": None,
            "chat_template": CHAT_TEMPLATE,
            "model_max_length": cfg["max_position_embeddings"],
            "clean_up_tokenization_spaces": False,
        },
    }
    for name, content in files.items():
        (out / name).write_text(json.dumps(content, indent=2) + "\n")
    return out


def make_adapter(model: str, out: str | Path, targets: list[str], rank: int = 8, alpha: float = 16.0,
                 seed: int = 0, scale: float = 0.5, layers: list[int] | None = None, **config) -> Path:
    """A random LoRA adapter of ``model`` in PEFT's format (as ``save_pretrained`` writes it), on the
    PEFT modules ``targets`` of every layer (or of ``layers``); ``config``: more adapter_config keys.
    Tests and benchmarks use these; B is non-zero, so each adapter changes the output."""
    from hybridlb.checkpoint.lora import ATTENTION_MODULES, CONFIG_FILE, WEIGHTS_FILE, module_shape
    from hybridlb.checkpoint.spec import load_spec

    spec = load_spec(model)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(spec.num_layers) if layers is None else layers:
        for module in targets:
            part = "self_attn" if module in ATTENTION_MODULES else "mlp"
            in_features, out_features = module_shape(spec, module)
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * scale
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / WEIGHTS_FILE)
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": targets, "bias": "none",
                "base_model_name_or_path": model, **config}
    (out / CONFIG_FILE).write_text(json.dumps(settings))
    return out
