"""How much one API server process takes on: ``api.max_concurrent_requests``, counted in
sequences (prompts × n), the unit engines work in, and ``api.max_body_bytes_in_flight``, the
request bodies it holds at once (``BodyBudget``). The one place both are counted.

A request holds one slot from its first byte (``admit``: so a flood of slow uploads is
refused before anyone parses them), and its remaining sequences' slots once its body is
parsed (``hold``), until its response ends (``release``). What an HTTP request holds is
kept in its ASGI scope, so every exit path gives back exactly that.
"""

from __future__ import annotations

from hybridlb.api.errors import APIError

RETRY_AFTER_S = 1
_HELD = "hybridlb.slots"  # scope[_HELD]: slots this HTTP request holds
_BYTES = "hybridlb.body_bytes"  # scope[_BYTES]: body bytes this HTTP request holds


class Slots:
    def __init__(self, limit: int):
        self.limit = limit  # 0: no limit
        self.in_use = 0

    def admit(self, scope: dict) -> None:
        """A request's first slot, taken by the middleware before its body is read (or 429)."""
        self._take(1)
        scope[_HELD] = 1

    def hold(self, scope: dict, count: int) -> None:
        """The request's body says it has ``count`` sequences: 400 if it could never fit, else
        take the slots it does not hold yet (or 429)."""
        if self.limit and count > self.limit:
            raise APIError(400, f"this request has {count} sequences (prompts x n), more than this server "
                                f"works on at once ({self.limit}, api.max_concurrent_requests); split it", param="n")
        held = scope.get(_HELD)
        if held is not None and count > held:  # None: not admitted by the middleware (an in-process call)
            self._take(count - held)
            scope[_HELD] = count

    def release(self, scope: dict) -> None:
        """The response ended: give back everything the request holds."""
        self.in_use -= scope.pop(_HELD, 0)

    def _take(self, count: int) -> None:
        if self.limit and self.in_use + count > self.limit:
            raise APIError(429, f"this server is already working on {self.in_use} sequences "
                                f"(api.max_concurrent_requests={self.limit}); retry shortly",
                           code="too_many_requests", retry_after_s=RETRY_AFTER_S)
        self.in_use += count


class BodyBudget:
    """Bytes of request bodies one API server holds at once: a body is held (read, parsed, its
    prompts and params kept) until its response ends, so without a budget the bound would be
    ``max_body_bytes`` times ``max_concurrent_requests``. Past the budget a request gets 429."""

    def __init__(self, limit: int):
        self.limit = limit  # 0: no limit
        self.in_use = 0

    def take(self, scope: dict, count: int) -> None:
        """``count`` more bytes of this request's body (its Content-Length at once, or as chunks arrive)."""
        if self.limit and self.in_use + count > self.limit:
            raise APIError(429, f"this server already holds {self.in_use} bytes of request bodies "
                                f"(api.max_body_bytes_in_flight={self.limit}); retry shortly",
                           code="too_many_requests", retry_after_s=RETRY_AFTER_S)
        self.in_use += count
        scope[_BYTES] = scope.get(_BYTES, 0) + count

    @staticmethod
    def held(scope: dict) -> int:
        return scope.get(_BYTES, 0)

    def release(self, scope: dict) -> None:
        self.in_use -= scope.pop(_BYTES, 0)
