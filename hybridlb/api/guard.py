"""What every HTTP request passes before any route sees it: the API key, the body size
limit, and the first slot of the concurrency limit (``hybridlb.api.dispatch.admission``)."""

from __future__ import annotations

import asyncio
import hmac

from starlette.exceptions import HTTPException as StarletteHTTPException

from hybridlb.api.dispatch.admission import BodyBudget, Slots
from hybridlb.api.errors import APIError, error_response

# Probes, scrapers and upstream balancers: no API key, and never refused for load.
OPEN_PATHS = frozenset({"/health", "/ping", "/load", "/metrics", "/version"})


class RequestGuard:
    """ASGI middleware: the API key on every path but ``OPEN_PATHS`` (so a new route is
    guarded by default), the request body size limit, and the first slot of the concurrency
    limit (``Slots``: a request takes the rest once its body says how many sequences it has)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, slots: Slots, body_timeout_s: float = 30.0,
                 budget: BodyBudget | None = None):
        self.app, self.api_key, self.max_body_bytes, self.slots = app, api_key, max_body_bytes, slots
        self.body_timeout_s = body_timeout_s
        self.budget = budget or BodyBudget(0)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self._unauthorized(headers.get(b"authorization", b"")):
            error = APIError(401, "missing or wrong API key; send 'Authorization: Bearer <key>'",
                             code="invalid_api_key")
            return await error_response(error)(scope, receive, send)
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return await self._too_large(scope, receive, send)
        try:
            self.slots.admit(scope)
        except APIError as busy:
            return await error_response(busy)(scope, receive, send)
        try:
            self.budget.take(scope, int(declared) if declared is not None and declared.isdigit() else 0)
        except APIError as busy:
            self.slots.release(scope)
            return await error_response(busy)(scope, receive, send)
        received, whole = 0, False
        deadline = asyncio.get_running_loop().time() + self.body_timeout_s

        async def counted():
            nonlocal received, whole
            if whole:  # the body is in: what comes now is the client going away, whenever it does
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise StarletteHTTPException(408, f"the request body did not arrive within {self.body_timeout_s:g} s "
                                                  "(api.body_timeout_s)") from None
            whole = message.get("type") != "http.request" or not message.get("more_body", False)
            received += len(message.get("body", b""))
            if received > self.max_body_bytes:  # no Content-Length (chunked): stop reading here
                raise StarletteHTTPException(413, self._too_large_message())
            if received > (held := self.budget.held(scope)):  # chunked (no Content-Length): held as it arrives
                self.budget.take(scope, received - held)  # past the budget: APIError 429, with Retry-After
            return message

        try:
            return await self.app(scope, counted, send)
        finally:
            self.slots.release(scope)
            self.budget.release(scope)

    def _unauthorized(self, authorization: bytes) -> bool:
        if not self.api_key:
            return False
        return not hmac.compare_digest(authorization, f"Bearer {self.api_key}".encode())

    def _too_large_message(self) -> str:
        return f"request body larger than {self.max_body_bytes} bytes (api.max_body_bytes)"

    async def _too_large(self, scope, receive, send):
        return await error_response(APIError(413, self._too_large_message()))(scope, receive, send)
