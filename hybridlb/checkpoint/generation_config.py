"""Sampling defaults a checkpoint ships in ``generation_config.json``.

As vLLM does by default (``--generation-config auto``), a request that leaves a sampling
field unset gets the model's own value (SmolLM2, Qwen and Llama instruct models tune
their temperature / top_p this way); ``vllm`` ignores the file, and a directory path
reads ``generation_config.json`` from there instead. A GGUF file carries the same
defaults as ``general.sampling.*`` metadata (when its converter wrote them).
"""

from __future__ import annotations

from pathlib import Path

from hybridlb.checkpoint.path import CheckpointError, resolve
from hybridlb.checkpoint.tokenizer import read_json

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")  # also SamplingParams fields


def sampling_defaults(model: str | Path, setting: str = "auto") -> dict[str, float | int]:
    """SamplingParams fields to apply to requests that do not set them."""
    if setting == "vllm":
        return {}
    if setting == "auto":
        checkpoint = resolve(model)
        if checkpoint.is_gguf:
            from hybridlb.checkpoint.gguf import gguf_sampling_defaults

            return gguf_sampling_defaults(checkpoint.path)
        path = checkpoint.path / "generation_config.json"
    else:
        path = Path(setting) / "generation_config.json"
        if not path.is_file():
            raise CheckpointError(f"--generation-config {setting}: {path} does not exist; pass auto, vllm "
                                  "or a directory holding generation_config.json")
    config = read_json(path)
    defaults = {key: config[key] for key in SAMPLING_KEYS if config.get(key) is not None}
    if defaults.get("top_k") is not None and defaults["top_k"] < 0:
        defaults["top_k"] = 0  # some configs say -1 for "off"
    return defaults
