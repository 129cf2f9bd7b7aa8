"""Error bodies: every failure answers `{"error": {"message", "type", "param", "code"}}` with its HTTP status.

`APIError` is what route code raises for a request it refuses; app.py's exception handlers turn it, FastAPI's
validation errors and Starlette's 404/405 into these bodies.
"""

from __future__ import annotations

from collections.abc import Mapping

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    413: "RequestEntityTooLarge",
    500: "InternalServerError",
    503: "ServiceUnavailable",
}


def error_response(
    status: int, message: str, param: str | None = None, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    body = {"error": {"message": message, "type": _ERROR_TYPES.get(status, "Error"), "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The message and offending field of a body that failed validation (the first error only)."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON ({first.get('ctx', {}).get('error', 'parse error')})", None
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    # Union members add their type names to the location; keep the field path only.
    path = ".".join(x for x in loc if not x.startswith(("str", "list[", "function-", "constrained-")))
    if first.get("type") == "extra_forbidden":
        return f"unknown field '{path}'", path
    if first.get("type") == "missing":
        return f"field '{path}' is required", path
    msg = first.get("msg", "invalid value")
    return f"invalid value for field '{path or 'body'}': {msg}", path or None
