"""A SIMULATED engine, for measuring the control plane at scale — never the model's speed.

``SimulatedCore`` is ``EngineCore`` with ``SimulatedRunner`` in place of the model: the
real scheduler (continuous batching up to ``max_num_seqs``, chunked prefill), KV block
accounting, stop handling, aborts and stats, but no weights and no torch. Each step
sleeps ``engine.simulate.step_ms`` (plus ``per_token_ms`` per token computed) and every
request it finishes a chunk of gets its next token, which echoes the prompt: output
token ``i`` is prompt token ``i mod len(prompt)``, so results are deterministic and
plainly not a model's.

It is chosen only by ``engine.simulate`` (``hybridlb serve --simulate-step-ms``); the
checkpoint at ``engine.model`` still supplies config.json (vocabulary, max length) and
the tokenizer the API server uses. Engines say "SIMULATED" in their logs, their
``EngineReady`` carries ``simulated=True``, and ``/v1/models`` shows it too.
"""

from __future__ import annotations

import time

from hybridlb.config import EngineConfig
from hybridlb.engine.core import EngineCore
from hybridlb.engine.dp_context import DPContext
from hybridlb.engine.dtypes import DTYPE_BYTES, engine_dtype
from hybridlb.engine.request import Request
from hybridlb.engine.scheduler import ScheduledChunk
from hybridlb.model.spec import ModelSpec, load_spec


class SimulatedRunner:
    """Stands where ``ModelRunner`` does: same attributes, ``run`` only waits and echoes."""

    device = "cpu"
    ep = None  # never expert parallel: there are no experts to shard

    def __init__(self, config: EngineConfig):
        if config.simulate is None:
            raise ValueError("SimulatedRunner needs engine.simulate (step_ms)")
        self.step_s = config.simulate.step_ms / 1000
        self.per_token_s = config.simulate.per_token_ms / 1000
        self.spec = load_spec(config.model)
        self.max_model_len = self.spec.model_len(config.max_model_len)
        self.num_blocks = config.num_kv_blocks or _blocks_for(config, self.spec)
        if self.num_blocks * config.block_size < self.max_model_len:
            raise ValueError(
                f"the simulated KV cache ({self.num_blocks} blocks of {config.block_size}) cannot hold one "
                f"sequence of max_model_len={self.max_model_len}; raise kv_cache_gib / num_kv_blocks"
            )

    scores_logprobs = False  # there is no model to ask

    def run(self, chunks: list[ScheduledChunk]) -> list[int]:
        """One token per chunk that completes its request's known tokens, after the step time."""
        deadline = time.perf_counter() + self.step_s + self.per_token_s * sum(c.num_tokens for c in chunks)
        tokens = [echo_token(chunk.request) for chunk in chunks if chunk.samples]
        remaining = deadline - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        return tokens


def echo_token(request: Request) -> int:
    """The simulated next token: the prompt again, one token per step."""
    return request.token_ids[request.num_output_tokens % request.num_prompt_tokens]


def _blocks_for(config: EngineConfig, spec: ModelSpec) -> int:
    """As many blocks as the real engine would fit in ``kv_cache_gib`` (so KV usage reads alike)."""
    dtype_bytes = DTYPE_BYTES[engine_dtype(config)]
    per_block = 2 * spec.num_kv_heads * spec.head_dim * dtype_bytes * config.block_size * spec.num_layers
    return max(1, int(config.kv_cache_gib * 2**30) // per_block)


class SimulatedCore(EngineCore):
    """An ``EngineCore`` whose model is ``SimulatedRunner`` (see the module docstring)."""

    def __init__(self, config: EngineConfig, dp: DPContext | None = None):
        super().__init__(config, dp, runner=SimulatedRunner(config))

    def _generator(self, seed: int) -> None:
        return None  # echoing needs no randomness, and a seed must not pull in torch

    def describe(self) -> str:
        """For logs: make it impossible to mistake this engine for the real model."""
        sim = self.config.simulate
        return f"SIMULATED engine (no model; {sim.step_ms:g} ms per step + {sim.per_token_ms:g} ms per token)"


def make_core(config: EngineConfig, dp: DPContext | None = None) -> EngineCore:
    """The engine core ``config`` asks for: simulated when ``engine.simulate`` is set, else the model."""
    return SimulatedCore(config, dp) if config.simulate is not None else EngineCore(config, dp)
