"""The HTTP server: vLLM- and OpenAI-compatible pooling endpoints over one shared engine.

Endpoints and their bodies follow vLLM's pooling server (`/pooling`, `/classify`, `/score`, `/rerank`,
`/tokenize`, ...), the OpenAI embeddings API (`/v1/embeddings`) and Cohere's embed v2 (`/v2/embed`). Errors
are `{"error": {"message", "type", "param", "code"}}` with a 4xx status for anything the client sent wrong;
the engine keeps serving the other requests. This module assembles the app (settings, lifespan, middleware,
error handlers); the endpoints live in `routes/`, what they share in `serving.py`.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ... import __version__
from ...engine.engine import Engine
from .errors import APIError, error_response, validation_message
from .metrics import ServerMetrics
from .routes import ROUTERS
from .serving import ServerState

logger = logging.getLogger(__name__)


@dataclass
class ServerConfig:
    """HTTP-level settings (the engine's live in EngineConfig)."""

    served_model_names: list[str] = field(default_factory=list)
    api_key: str | None = None
    max_request_bytes: int = 32 * 1024 * 1024
    """Bodies larger than this get 413."""
    max_inputs_per_request: int = 4096
    """Inputs (texts, token lists, documents) in one request; more get 400."""


class ServerMiddleware:
    """Pure ASGI (so handlers still see client disconnects): API key, body limit, JSON bodies, metrics.

    - every route but /health needs `Authorization: Bearer KEY` when a key is set (401);
    - bodies over the limit get 413 before they are buffered (Content-Length or streamed size);
    - every POST body is read as JSON whatever content type the client declared (`curl -d` says form data);
    - requests are counted by route and status, and timed.
    """

    def __init__(self, app: ASGIApp, config: ServerConfig, metrics: ServerMetrics):
        self.app, self.config, self.metrics = app, config, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        headers = dict(scope.get("headers") or [])
        status = {"code": 500}

        async def send_recording(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        def record(endpoint: str) -> None:
            self.metrics.requests.labels(endpoint, str(status["code"])).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)

        key = self.config.api_key
        if key and scope["path"] != "/health":
            auth = headers.get(b"authorization", b"").decode("latin-1")
            token = auth[7:] if auth.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), key.encode()):
                await error_response(
                    401,
                    "missing or invalid API key (Authorization: Bearer ...)",
                    headers={"WWW-Authenticate": "Bearer"},
                )(scope, receive, send_recording)
                return record(scope["path"])

        limit = self.config.max_request_bytes
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            await error_response(413, f"request body is larger than the limit of {limit} bytes")(
                scope, receive, send_recording
            )
            return record(scope["path"])
        if scope.get("method") == "POST" and not headers.get(b"content-type", b"").startswith(b"application/json"):
            scope["headers"] = [(k, v) for k, v in scope["headers"] if k != b"content-type"] + [
                (b"content-type", b"application/json")
            ]
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise APIError(413, f"request body is larger than the limit of {limit} bytes")
            return message

        try:
            await self.app(scope, limited_receive, send_recording)
        finally:
            route = scope.get("route")
            record(getattr(route, "path", "unmatched"))


async def _on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    message, param = validation_message(exc)
    return error_response(400, message, param)


async def _on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    message = {404: f"no route {request.url.path}", 405: f"method {request.method} not allowed here"}.get(
        exc.status_code, str(exc.detail)
    )
    if exc.status_code == 400 and "parsing the body" in message:  # undecodable bytes
        message = "the request body is not valid JSON (it must be UTF-8 encoded JSON)"
    return error_response(exc.status_code, message)


async def _on_api_error(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.param)


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unexpected error on %s", request.url.path)
    return error_response(500, f"internal error: {exc.__class__.__name__}")


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    engine = app.state.server.async_engine
    engine.start()
    yield
    engine.stop()


def build_app(engine: Engine, config: ServerConfig) -> FastAPI:
    state = ServerState.create(engine, config)
    app = FastAPI(
        title="polyvec",
        version=__version__,
        lifespan=lifespan,
        description="Pooling-model server: embeddings, multi-vector, classification, scoring.",
    )
    app.state.server = state
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(StarletteHTTPException, _on_http)
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(Exception, _on_unexpected)
    for router in ROUTERS:
        app.include_router(router)
    app.add_middleware(ServerMiddleware, config=config, metrics=state.metrics)
    return app
