"""The torch model: layers, paged attention, the CPU kernels, the loader (safetensors and
GGUF weights) and make-model. Only engines (and the offline ``LLM``) import it; what a
checkpoint says without torch is ``hybridlb.checkpoint``."""
