"""LoRA adapter directories for tests and benchmarks, in the layout peft's save_pretrained writes (the real-model
tests make theirs with peft itself, tests/real/test_lora.py)."""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import save_file

from hybridlb.checkpoint.spec import load_spec
from hybridlb.model.make_model import make_adapter


def write_adapter(directory: Path, model: str, targets: list[str], rank: int = 4, alpha: float = 8.0,
                  seed: int = 0, **options) -> Path:
    """A random adapter of ``model`` on ``targets`` (``hybridlb.model.make_model.make_adapter``)."""
    return make_adapter(model, directory, targets, rank, alpha, seed, **options)


def merge_adapter(model: str, adapter: Path, out: Path) -> Path:
    """``model`` with ``adapter`` folded into its weights (W + scaling * B @ A): what the base
    model plus the adapter must compute."""
    from safetensors.torch import load_file

    from hybridlb.checkpoint.lora import read_adapter

    spec = load_spec(model)
    info = read_adapter(adapter, spec, 64)
    weights = load_file(Path(model) / "model.safetensors")
    lora = load_file(adapter / "adapter_model.safetensors")
    for module in info.modules:
        name = f"base_model.model.{module.prefix}"
        delta = module.scaling * lora[f"{name}.lora_B.weight"] @ lora[f"{name}.lora_A.weight"]
        key = f"{module.prefix}.weight"
        weights[key] = (weights[key].float() + delta).to(weights[key].dtype)
    out.mkdir(parents=True, exist_ok=True)
    for file in Path(model).iterdir():
        if file.name != "model.safetensors":
            (out / file.name).write_bytes(file.read_bytes())
    save_file(weights, out / "model.safetensors")
    return out
