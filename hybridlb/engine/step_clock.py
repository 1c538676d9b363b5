"""How long this engine's steps take, so a front end can tell a long step from a stuck loop.

An API server counts an engine as stuck when it sends nothing for ``api.engine_stall_s``
with requests in flight. A step is silent from start to end, and on a CPU one full token
budget of prefill can take longer than any fixed limit (a 8,192-token chunk on two cores).
So each engine publishes ``longest_step_s`` (``EngineStats``): the longest step among its
recent ones, or a full budget at the slowest per-token rate its large steps ran at,
whichever is longer; the API server waits a multiple of that before it calls the engine stuck.

It also adds up the steps by kind (``step_s``, ``step_counts``, ``step_tokens`` in
``EngineStats``; ``hybridlb:engine_step_*`` in /metrics): ``decode`` (every request computes
its one next position, drafts aside), ``prefill`` (every request computes prompt positions, or
recomputes after a preemption) and ``mixed`` (both in one step: prefill chunks joining decode
steps); a backend that cannot tell counts its steps as ``unclassified``.
"""

from __future__ import annotations

import time
from collections import deque

RECENT_STEPS = 256
REFRESH_S = 1.0  # stats are read every step: the figure is worked out at most this often
LARGE_STEP_TOKENS = 128  # a step this large is mostly per-token work: its rate scales to a full budget


def step_kind(chunks) -> str:
    """``decode``, ``prefill`` or ``mixed``: whether the scheduled chunks (before they run)
    compute their requests' one next position or more."""
    prefilling = sum(chunk.request.num_uncomputed > 1 for chunk in chunks)
    return "decode" if not prefilling else "prefill" if prefilling == len(chunks) else "mixed"


class StepClock:
    def __init__(self, token_budget: int):
        self.token_budget = token_budget
        self._steps: deque[tuple[float, int]] = deque(maxlen=RECENT_STEPS)  # (seconds, tokens)
        self._longest, self._worked_out = 0.0, float("-inf")
        self._kinds: dict[str, list] = {}  # kind: [seconds, steps, tokens] since start

    def record(self, seconds: float, tokens: int, kind: str = "unclassified") -> None:
        self._steps.append((seconds, tokens))
        totals = self._kinds.setdefault(kind, [0.0, 0, 0])
        totals[0] += seconds
        totals[1] += 1
        totals[2] += tokens
        if seconds > self._longest:  # a new longest counts at once
            self._worked_out = float("-inf")

    def by_kind(self) -> dict[str, dict]:
        """EngineStats' ``step_s``, ``step_counts`` and ``step_tokens``: each kind's totals since start."""
        return {"step_s": {kind: round(t[0], 4) for kind, t in self._kinds.items()},
                "step_counts": {kind: t[1] for kind, t in self._kinds.items()},
                "step_tokens": {kind: t[2] for kind, t in self._kinds.items()}}

    def longest_step_s(self) -> float:
        """The longest a step may take here, by the recent ones (0 before the first)."""
        if (now := time.monotonic()) - self._worked_out >= REFRESH_S:
            self._longest, self._worked_out = self._work_out(), now
        return self._longest

    def _work_out(self) -> float:
        longest = max((seconds for seconds, _ in self._steps), default=0.0)
        slowest = max((seconds / tokens for seconds, tokens in self._steps if tokens >= LARGE_STEP_TOKENS),
                      default=0.0)
        return max(longest, slowest * self.token_budget)


class LoopClock:
    """The engine loop's wall time by phase (EngineStats' ``loop_s``, ``uptime_s``): each
    ``lap(phase)`` charges the time since the previous lap to ``phase``, so the phases add up
    to the loop's wall time."""

    PHASES = ("idle", "take", "step", "publish")

    def __init__(self):
        self.started = self.mark = time.perf_counter()
        self.phases = dict.fromkeys(self.PHASES, 0.0)

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] += now - self.mark
        self.mark = now

    def stats(self) -> dict:
        return {"loop_s": {phase: round(s, 4) for phase, s in self.phases.items()},
                "uptime_s": round(self.mark - self.started, 4)}
