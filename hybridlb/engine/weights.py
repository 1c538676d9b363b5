"""In what form an engine holds its weights: ``engine.quantization``, with its default resolved.

Unset, a ``.gguf`` file keeps its quantized blocks (the ``gguf`` method), as vLLM serves GGUF
files, wherever the weight-only kernels run: on CPU, in float32 or bfloat16 (``auto`` included).
On CUDA or in float16 it is dequantized to the dtype instead (the start-up lines say why); only an
explicit ``gguf`` there is an error (``EngineConfig``'s checks). ``none`` dequantizes everywhere.
Other checkpoints stay in their dtype unless ``int8`` or ``int4`` asks otherwise.

Torch-free, so the CLI can say what an engine will hold before any engine starts.
"""

from __future__ import annotations

from hybridlb.config import EngineConfig


def is_gguf(config: EngineConfig) -> bool:
    """Whether ``engine.model`` names a .gguf file (CheckpointError where it names nothing loadable)."""
    from hybridlb.checkpoint.path import resolve

    return resolve(config.model, config.revision).is_gguf


def engine_quantization(config: EngineConfig, gguf_file: bool) -> str | None:
    """The method the engine keeps its weights in (int8, int4, gguf), or None: in its dtype."""
    if config.quantization == "none":
        return None
    if config.quantization is not None:
        return config.quantization
    return "gguf" if gguf_file and _kernels_take(config) else None


def weights_summary(config: EngineConfig, gguf_file: bool) -> str:
    """How the weights are held, for start-up lines; where a .gguf file is dequantized, why ("" for a
    checkpoint served in its dtype)."""
    method = engine_quantization(config, gguf_file)
    if method is not None:
        default = " (the default for a .gguf file)" if config.quantization is None else ""
        return f"weights kept quantized, {method}{default}"
    if not gguf_file:
        return ""
    if config.quantization == "none":
        return "weights dequantized from the .gguf file (quantization none)"
    where = "on CPU" if config.device != "cpu" else "in bfloat16 or float32"
    return f"weights dequantized from the .gguf file (kept quantized only {where})"


def _kernels_take(config: EngineConfig) -> bool:
    return config.device == "cpu" and config.dtype != "float16"
