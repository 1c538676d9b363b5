"""The torch model: layers, paged attention (on the C kernels of ``hybridlb.kernels`` where they
build), the loader (safetensors and GGUF weights) and make-model. Only engines (and the offline
``LLM``) import it; what a checkpoint says without torch is ``hybridlb.checkpoint``."""
