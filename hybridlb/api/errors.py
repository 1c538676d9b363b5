"""OpenAI-style errors: every failure leaves the server as
``{"error": {"message", "type", "param", "code"}}`` with the right HTTP status."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s = retry_after_s  # sent as Retry-After (429, 503)

    def body(self) -> dict:
        kind = _TYPES.get(self.status, "internal_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class _ErrorJSON(JSONResponse):
    """ASCII-escaped JSON: a message may quote client input, lone surrogates included."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()


def error_response(error: APIError) -> JSONResponse:
    headers = {"Retry-After": str(error.retry_after_s)} if error.retry_after_s is not None else None
    return _ErrorJSON(error.body(), status_code=error.status, headers=headers)


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _field_path(loc: tuple) -> list[str]:
    """The field part of a pydantic error location, without the union member it tried
    (``stop.list[str].0`` → ``stop``)."""
    path = []
    for part in loc:
        if part == "body":
            continue
        if not isinstance(part, int) and (not part.isidentifier() or part in _UNION_TAGS):
            break
        path.append(str(part))
    return path


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    # A union tries every member; the error that got furthest into the input says the most.
    first = max(exc.errors(), key=lambda error: len(error.get("loc", ())))
    location = _field_path(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}", None
    if not location and first.get("type") in ("model_attributes_type", "dict_type"):
        return "the request body must be a JSON object (send Content-Type: application/json)", None
    param = ".".join(location) or None
    return (f"{param}: {first['msg']}" if param else first["msg"]), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(APIError(400, message, param=param))

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception):
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        message = f"no route {request.method} {request.url.path}" if exc.status_code == 404 else str(exc.detail)
        return error_response(APIError(exc.status_code, message))
