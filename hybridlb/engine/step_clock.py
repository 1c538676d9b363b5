"""How long this engine's steps take, so a front end can tell a long step from a stuck loop.

An API server counts an engine as stuck when it sends nothing for ``api.engine_stall_s``
with requests in flight. A step is silent from start to end, and on a CPU one full token
budget of prefill can take longer than any fixed limit (a 8,192-token chunk on two cores).
So each engine publishes ``longest_step_s`` (``EngineStats``): the longest step among its
recent ones, or a full budget at the slowest per-token rate its large steps ran at,
whichever is longer; the API server waits a multiple of that before it calls the engine stuck.
"""

from __future__ import annotations

import time
from collections import deque

RECENT_STEPS = 256
REFRESH_S = 1.0  # stats are read every step: the figure is worked out at most this often
LARGE_STEP_TOKENS = 128  # a step this large is mostly per-token work: its rate scales to a full budget


class StepClock:
    def __init__(self, token_budget: int):
        self.token_budget = token_budget
        self._steps: deque[tuple[float, int]] = deque(maxlen=RECENT_STEPS)  # (seconds, tokens)
        self._longest, self._worked_out = 0.0, float("-inf")

    def record(self, seconds: float, tokens: int) -> None:
        self._steps.append((seconds, tokens))
        if seconds > self._longest:  # a new longest counts at once
            self._worked_out = float("-inf")

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
