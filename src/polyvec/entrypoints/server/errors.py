"""Error bodies: every failure answers `{"error": {"message", "type", "param", "code"}}` with its HTTP status.

`APIError` is what route code raises for a request it refuses; app.py's exception handlers turn it, FastAPI's
validation errors and Starlette's 404/405 into these bodies. `ErrorResponse` is the body's schema in the OpenAPI
document, and `error_responses` the statuses a route documents.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers
        self.too_long: tuple[int, int, str] | None = None
        """An over-long input's (tokens, most allowed, which item), for routes that word it their own way (TEI's)."""


_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    408: "RequestTimeout",
    413: "RequestEntityTooLarge",
    429: "TooManyRequests",
    500: "InternalServerError",
    503: "ServiceUnavailable",
}


class ErrorDetail(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True)

    message: str
    """What was wrong, naming the field (and the item index) where one is at fault."""
    type: str
    """The error class, e.g. BadRequestError, RequestEntityTooLarge, TooManyRequests."""
    param: str | None
    """The request field at fault, when there is one (else null)."""
    code: int
    """The HTTP status again."""


class ErrorResponse(BaseModel):
    """The body of every error response."""

    error: ErrorDetail


_DESCRIPTIONS = {
    400: "Invalid request: malformed or empty JSON body, an invalid or unknown field, input the model cannot take",
    401: "Missing or invalid API key (only when the server runs with --api-key)",
    404: "The body names a model this server does not serve",
    408: "The request body did not arrive within --request-body-timeout",
    413: (
        "The request body is larger than --max-request-bytes, or its tokenized inputs exceed "
        "--max-tokens-per-request or --max-windows-per-input"
    ),
    429: "More requests in progress than --max-concurrent-requests; retry after the Retry-After header's seconds",
    500: "Internal error; the request was not processed",
    503: "The engine stopped on an internal error (the health checks answer 503 too): the server needs a restart",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for these error statuses, each with the `ErrorResponse` schema."""
    return {s: {"model": ErrorResponse, "description": _DESCRIPTIONS[s]} for s in statuses}


# What every POST route can answer; the body-level ones (401, 408, 413, 429) come from app.py's middleware.
POST_ERRORS = error_responses(400, 401, 404, 408, 413, 429, 500, 503)


class _ErrorJSON(JSONResponse):
    """ASCII-escaped, so that a message quoting a client's lone surrogate still encodes."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(
    status: int, message: str, param: str | None = None, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    body = {"error": {"message": message, "type": _ERROR_TYPES.get(status, "Error"), "param": param, "code": status}}
    return _ErrorJSON(body, status_code=status, headers=headers)


INPUT_ERROR = "polyvec_input"
"""The pydantic error type protocol.py's validators raise: its ctx carries the whole message and the field."""


def shorten(text: str, limit: int = 80) -> str:
    """A client's string quoted in a message, cut so that a huge one does not come back whole."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe_loc(loc: list[Any]) -> str:
    """('tokens', 3) → "'tokens' item 3"; ('mm_processor_kwargs', 'a') → "'mm_processor_kwargs.a'"."""
    names, items = [], []
    for part in loc:
        if isinstance(part, int):
            items.append(f" item {part}")
        elif items:  # a field inside a list item
            items.append(f".{shorten(str(part))}")
        else:
            names.append(shorten(str(part)))
    return f"'{'.'.join(names)}'" + "".join(items)


_TAGS = frozenset({"text", "image_url"})
"""The tags of the discriminated unions of the bodies (a Cohere content part's `type`)."""
_SHAPES = frozenset({"conversation", "conversations"})
"""The tags of `messages`' two shapes (one conversation, a list of them), dropped wherever they are."""

_JSON_TYPES = {"dict_type": "an object", "model_attributes_type": "an object", "model_type": "an object"}


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The message and offending field of a body that failed validation (the first error only)."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    kind = first.get("type")
    ctx = first.get("ctx") or {}
    if kind == INPUT_ERROR:
        return ctx["message"], ctx["param"]
    if kind == "json_invalid":
        return f"the request body is not valid JSON ({ctx.get('error', 'parse error')})", None
    # Union members add their type names to the location, a discriminated union its tag after the item's index
    # ("content", 0, "text", "text"); keep the field path only.
    raw = list(first.get("loc", ()))
    loc = [
        x
        for k, x in enumerate(raw)
        if x != "body"
        and not (isinstance(x, str) and x.startswith(("str", "list[", "literal[", "function-", "constrained-")))
        and not (x in _TAGS and k > 0 and isinstance(raw[k - 1], int) and k + 1 < len(raw))
        and x not in _SHAPES
    ]
    if kind == "string_unicode":  # a lone surrogate where pydantic needs text: an object key, a literal's value
        where = f"field {_describe_loc(loc)}" if loc else "the request body"
        what = "has a key that is" if not loc or first.get("input") in raw[-1:] else "is"  # a key: the loc's end
        return f"{where} {what} not valid UTF-8 text (lone surrogate)", str(loc[0]) if loc else None
    if not loc:
        if kind == "missing":
            return "the request body is empty; send a JSON object", None
        return f"the request body must be a JSON object, not {json_type(first.get('input'))}", None
    param = shorten(str(loc[0]))
    where = _describe_loc(loc)
    if kind == "extra_forbidden":
        return f"unknown field {where}", param
    if kind == "missing":
        return f"field {where} is required", param
    if kind in _JSON_TYPES:
        return f"invalid value for field {where}: it must be {_JSON_TYPES[kind]}", param
    given = first.get("input")
    if kind in ("literal_error", "enum") and isinstance(given, (str, int, float)) and not isinstance(given, bool):
        # the value the client sent, as vLLM's messages repeat it (a typo is then visible in the log line)
        return f"invalid value {json.dumps(given)[:100]} for field {where}: {first.get('msg', 'invalid value')}", param
    return f"invalid value for field {where}: {first.get('msg', 'invalid value')}", param


def json_type(value: Any) -> str:
    """How a decoded JSON value is called in messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"
