"""Lockstep for MoE with expert parallelism: every rank steps while any rank has work.

Each rank's MoE layers need every other rank, so a rank with nothing to do still runs a
dummy step (no tokens, but the same collectives) while others work. Steps come in
*waves*:

* A paused engine that receives a request starts the current wave and tells the
  coordinator (``StartWave``), which wakes every other rank.
* Each step every rank exchanges ``[tokens, has_work]``. When no rank has work, every rank
  sees it in that same step: the wave ends everywhere at once, each rank moves to the
  next wave number and pauses (blocking on its sockets), and rank 0 tells the
  coordinator (``WaveComplete``).
* A request stamped with an older wave just starts the engine's current wave, and one
  stamped with a newer wave is adopted, so a stale request can never leave a rank
  waiting in a collective that the others will not join.
"""

from __future__ import annotations

import time

import msgspec

from hybridlb.engine.core import EngineCore
from hybridlb.protocol import EngineStats, RequestOutput, StartWave, WaveComplete


class Lockstep:
    def __init__(self, core: EngineCore):
        self.core = core
        self.ep = core.expert_parallel
        self.wave = 0
        self.running = False
        self.dummy_steps = 0

    def request_arrived(self, wave: int) -> StartWave | None:
        """A request was queued here; returns the StartWave to send if this wakes the rank."""
        self.wave = max(self.wave, wave)
        if self.running:
            return None
        self.running = True
        return StartWave(self.wave, self.core.rank)

    def start_wave(self, wave: int) -> None:
        """The coordinator says wave ``wave`` runs."""
        if wave > self.wave or (wave == self.wave and not self.running):
            self.wave, self.running = wave, True

    def step(self) -> tuple[list[RequestOutput], WaveComplete | None]:
        """One lockstep step: real work, a dummy step, or the end of the wave."""
        chunks = self.core.schedule()
        early = self.core.take_early_outputs()  # grammars that failed to compile
        started = time.perf_counter()  # a synchronous metadata exchange is part of the step's busy time
        self.ep.begin_step(sum(c.num_tokens for c in chunks), self.core.has_work)
        if chunks:
            return early + self.core.run_chunks(chunks, started), None
        if self.ep.any_work:
            self.dummy_steps += 1
            self.core.dummy_step(started)  # no tokens, but joins every MoE layer's collectives
            return early, None
        finished = self.wave
        self.wave, self.running = finished + 1, False
        return early, WaveComplete(finished) if self.core.rank == 0 else None

    def annotate(self, stats: EngineStats) -> EngineStats:
        return msgspec.structs.replace(stats, dummy_steps=self.dummy_steps, wave=self.wave, running=self.running,
                                       collective_s=round(self.ep.collective_s, 4), meta_s=round(self.ep.meta_s, 4))
