"""vLLM's engine core as a rank's engine (``engine.backend: vllm``, ``--engine-backend vllm``).

``VllmCore`` has the surface ``EngineShell`` drives (``hybridlb.engine.core.EngineCore``'s):
requests in with hybridlb's ``SamplingParams``, one ``step()`` out as ``RequestOutput``s, load
stats as ``EngineStats``. Inside it is vLLM's own in-process ``EngineCore`` (no vLLM API server,
no vLLM engine-core process, no vLLM DP coordinator): its scheduler, KV cache, model runner,
sampler and grammar masks. Tokenizing, chat templates, detokenizing, stop strings, tool parsing
and routing stay in hybridlb's API server, so every hybridlb topology works unchanged.

Everything that touches vLLM's internals is in this package (``install``: which vLLM; ``args``:
its engine arguments; ``core``: ``VllmCore``; ``convert``: requests and outputs; ``events``: its
KV-cache events); nothing outside it imports vLLM (``tests/unit/test_layout.py``); ``tests/vllm/test_contract.py`` pins
what it uses, so a vLLM upgrade that moves any of it fails there, loudly.
"""

from hybridlb.engine.vllm_backend.args import engine_args, thread_binding
from hybridlb.engine.vllm_backend.core import VllmCore
from hybridlb.engine.vllm_backend.install import INSTALL, VLLM_VERSION, VllmUnavailable, check_installed, require_vllm

__all__ = ["INSTALL", "VLLM_VERSION", "VllmCore", "VllmUnavailable", "check_installed", "engine_args", "require_vllm",
           "thread_binding"]
