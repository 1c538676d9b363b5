"""How much one API server process takes on: ``api.max_concurrent_requests``, counted in
sequences (prompts × n), the unit engines work in.

A request holds one slot from its first byte (so a flood of slow uploads is refused
before anyone parses them), and its remaining sequences' slots once its body is parsed,
until its response ends. ``RequestGuard`` gives all of them back: it records them in the
ASGI scope under ``SCOPE_KEY``.
"""

from __future__ import annotations

from hybridlb.api.errors import APIError

RETRY_AFTER_S = 1
SCOPE_KEY = "hybridlb.slots"  # scope[SCOPE_KEY]: slots this HTTP request holds


class Slots:
    def __init__(self, limit: int):
        self.limit = limit  # 0: no limit
        self.in_use = 0

    def check_size(self, count: int) -> None:
        """400 if one request of ``count`` sequences could never fit."""
        if self.limit and count > self.limit:
            raise APIError(400, f"this request has {count} sequences (prompts x n), more than this server "
                                f"works on at once ({self.limit}, api.max_concurrent_requests); split it", param="n")

    def take(self, count: int) -> None:
        """Take ``count`` more slots, or raise 429."""
        if self.limit and self.in_use + count > self.limit:
            raise APIError(429, f"this server is already working on {self.in_use} sequences "
                                f"(api.max_concurrent_requests={self.limit}); retry shortly",
                           code="too_many_requests", retry_after_s=RETRY_AFTER_S)
        self.in_use += count

    def give_back(self, count: int) -> None:
        self.in_use -= count
