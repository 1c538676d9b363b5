"""A SIMULATED engine, for measuring the control plane at scale — never the model's speed.

``SimulatedRunner`` stands in for the model (``make_core`` builds a ``SimulatedCore`` on it): the
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

from hybridlb.checkpoint.spec import load_spec
from hybridlb.config import EngineConfig
from hybridlb.engine import kv_cache
from hybridlb.engine.request import Request
from hybridlb.engine.scheduler import ScheduledChunk


class SimulatedRunner:
    """Stands where ``ModelRunner`` does: same attributes, ``run`` only waits and echoes."""

    device = "cpu"
    ep = None  # never expert parallel: there are no experts to shard
    scores_logprobs = False  # there is no model to ask

    def __init__(self, config: EngineConfig):
        if config.simulate is None:
            raise ValueError("SimulatedRunner needs engine.simulate (step_ms)")
        self.simulate = config.simulate
        self.spec = load_spec(config.model)
        self.max_model_len = self.spec.model_len(config.max_model_len)
        self.num_blocks = kv_cache.num_blocks(config, self.spec, self.max_model_len)

    def generator(self, seed: int) -> None:
        return None  # echoing needs no randomness, and a seed must not pull in torch

    def label(self) -> str:
        """For logs: make it impossible to mistake this engine for the real model."""
        return (f"SIMULATED engine (no model; {self.simulate.step_ms:g} ms per step + "
                f"{self.simulate.per_token_ms:g} ms per token)")

    def run(self, chunks: list[ScheduledChunk]) -> list[int]:
        """One token per chunk that completes its request's known tokens, after the step time."""
        step_s = self.simulate.step_ms / 1000
        per_token_s = self.simulate.per_token_ms / 1000
        deadline = time.perf_counter() + step_s + per_token_s * sum(c.num_tokens for c in chunks)
        tokens = [echo_token(chunk.request) for chunk in chunks if chunk.samples]
        remaining = deadline - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        return tokens


def echo_token(request: Request) -> int:
    """The simulated next token: the prompt again, one token per step."""
    return request.token_ids[request.num_output_tokens % request.num_prompt_tokens]
