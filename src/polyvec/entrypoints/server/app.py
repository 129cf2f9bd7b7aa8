"""The HTTP server: vLLM- and OpenAI-compatible pooling endpoints over one shared engine.

Endpoints and their bodies follow vLLM's pooling server (`/pooling`, `/classify`, `/score`, `/rerank`,
`/tokenize`, ...), the OpenAI embeddings API (`/v1/embeddings`) and Cohere's embed v2 (`/v2/embed`). Errors
are `{"error": {"message", "type", "param", "code"}}` with a 4xx status for anything the client sent wrong
(and 500, logged, for a fault of the server's own); the engine keeps serving the other requests, and the
connection stays usable. This module assembles the app (settings, lifespan, middleware, error handlers, the
OpenAPI document); the endpoints live in `routes/`, what they share in `serving.py`.
"""

from __future__ import annotations

import asyncio
import copy
import gc
import hashlib
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Collection, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ... import __version__
from ...engine.engine import Engine
from . import protocol as P
from .errors import APIError, error_response, json_type, validation_message
from .metrics import TE_COUNTED, TE_ERR, ServerMetrics
from .routes import ROUTERS, tei
from .serving import ServerState

logger = logging.getLogger(__name__)


OPEN_PATHS = frozenset({"/health", "/ping", "/metrics"})  # answered without the API key


@dataclass
class ServerConfig:
    """HTTP-level settings (the engine's live in EngineConfig)."""

    served_model_names: list[str] = field(default_factory=list)
    api_key: str | list[str] | None = None
    """Keys any of which a request may send as `Authorization: Bearer KEY` (vLLM's `--api-key` takes several)."""
    max_request_bytes: int = 32 * 1024 * 1024
    """Bodies larger than this get 413."""
    max_inputs_per_request: int = 4096
    """Inputs (texts, token lists, documents) in one request; more get 400."""
    max_tokens_per_request: int = 1024 * 1024
    """Tokens of all a request's inputs after tokenization and truncation; more get 413 (0: no limit)."""
    max_windows_per_input: int = 64
    """Windows of max_model_len tokens one `long_input="window"` input may be split into; more get 413
    (0: no limit)."""
    request_body_timeout: float = 30.0
    """Seconds a request's whole body may take to arrive; a slower one gets 408 and its connection closed
    (0: no limit)."""
    max_concurrent_requests: int = 512
    """POST requests in progress at once; more get 429 with Retry-After instead of queueing without bound
    (0: no limit)."""
    chat_template: str | None = None
    """--chat-template: a file or the template itself, for chat-style requests (default: the model's own)."""
    trust_request_chat_template: bool = False
    """Let a request carry its own chat_template (vLLM's --trust-request-chat-template)."""
    chat_template_content_format: str = "auto"
    """How a message's content reaches the template (vLLM's --chat-template-content-format): "string" (its text
    parts joined), "openai" (a list of typed parts), or "auto" (what the template loops over)."""
    request_id_headers: bool = False
    """Send X-Request-Id with every response: the client's own, else a new id (vLLM's
    --enable-request-id-headers)."""
    default_prompt_name: str | None = None
    """TEI's --default-prompt-name: the model's prompt (config_sentence_transformers.json) before text inputs that
    name none, in place of the model's own default."""
    default_prompt: str | None = None
    """TEI's --default-prompt: this text before text inputs that name no prompt."""
    warmup: bool = True
    """Compile the kernels of every batch size while idle after start (vLLM's CUDA-graph capture, which
    `--enforce-eager` turns off, plays the same role)."""


_CLOSE = {"Connection": "close"}
"""When a body stalls, the rest of it may still come: the connection cannot carry another request."""

_BODY_SIZE = "polyvec.body_size"
"""Scope key: the size of the body the middleware read (tells an empty body from a JSON null)."""


class ServerMiddleware:
    """Pure ASGI (so handlers still see client disconnects): API key, overload, the body, errors, metrics.

    - every route but /health, /ping and /metrics (and CORS preflights) needs `Authorization: Bearer KEY`
      when a key is set (401);
    - beyond `max_concurrent_requests` POST requests in progress, another gets 429 with Retry-After;
    - the body is read here, before routing: over the limit it gets 413 (declared Content-Length or streamed
      size), not all there within `request_body_timeout` 408 (and the connection closed); the handler then
      sees it as one message;
    - every POST body is read as JSON whatever content type the client declared (`curl -d` says form data);
    - an unexpected exception becomes a logged 500 error body and is not re-raised, so the connection stays
      usable (Starlette's ServerErrorMiddleware would re-raise it, and uvicorn then drops the connection);
    - requests are counted by route and status, and timed.
    """

    def __init__(self, app: ASGIApp, config: ServerConfig, metrics: ServerMetrics, paths: Collection[str] = ()):
        self.app, self.config, self.metrics = app, config, metrics
        self.paths = frozenset(paths)
        keys = [config.api_key] if isinstance(config.api_key, str) else config.api_key or []
        self.key_digests = [hashlib.sha256(k.encode("utf-8")).digest() for k in keys if k]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        response = {"status": 499, "started": False}  # 499 (client closed request) until a response starts
        client_id = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"x-request-id"), None)
        P.REQUEST_ID.set(client_id)  # response ids carry it (each request runs in its own context)
        echo = (client_id or uuid.uuid4().hex).encode("latin-1") if self.config.request_id_headers else None

        async def send_recording(message: Message) -> None:
            if message["type"] == "http.response.start":
                response["status"], response["started"] = message["status"], True
                if echo is not None:
                    message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", echo)]}
            await send(message)

        counted = False
        out: Send = send_recording
        try:
            self._check_access(scope)
            if scope["method"] == "HEAD":  # a GET route's headers (FastAPI routes GET alone; RFC 9110 wants HEAD)
                scope, out = {**scope, "method": "GET"}, _headers_only(send_recording)
            if scope["method"] not in ("POST", "PUT", "PATCH"):  # no body to read or to limit
                return await self.app(scope, receive, out)
            counted = scope["method"] == "POST"
            if counted:
                self.metrics.in_progress += 1
            body = await self._read_body(receive)
            if body is None:  # the client left mid-body: nobody to answer
                return
            scope[_BODY_SIZE] = len(body)
            if len(body) >= _COUNT_ITEMS_FROM:
                await self._check_items(body)
            await self.app(scope, _replay(body, receive), out)
        except APIError as exc:
            if response["started"]:
                raise
            await error_response(exc.status, exc.message, exc.param, exc.headers)(scope, receive, out)
        except Exception as exc:
            logger.exception("unexpected error on %s %s", scope["method"], scope["path"])
            if response["started"]:  # half a response cannot be replaced; the connection has to go
                raise
            await error_response(500, f"internal error: {exc.__class__.__name__}")(scope, receive, out)
        finally:
            if counted:
                self.metrics.in_progress -= 1
            route = getattr(scope.get("route"), "path", None)
            endpoint = route or (scope["path"] if scope["path"] in self.paths else "unmatched")
            self.metrics.requests.labels(endpoint, str(response["status"])).inc()
            status = response["status"]
            # TEI counts the failures of requests it counted, and its refusals for lack of capacity
            # (a TEI route's refusal before it counted the request, e.g. an empty `texts`, names its cause: counted)
            counted_failure = scope.get(TE_COUNTED) or scope.get(TE_ERR)
            if status == 429 and not counted_failure and scope["method"] == "POST" and endpoint in _POOLING_PATHS:
                # TEI counts a request before it asks for a permit: refused for overload, it is in both counts
                # (its body unread here: "batch")
                self.metrics.te_count.labels("batch").inc()
                counted_failure = "batch"
            if status >= 400 and counted_failure:
                self.metrics.on_failure(status, scope.get(TE_ERR))
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)

    def _check_access(self, scope: Scope) -> None:
        """Refuse a request before its body is read: no API key, a declared size over the limit, overload."""
        headers = dict(scope.get("headers") or [])
        # open with a key: health checks, Prometheus' scrape (as vLLM leaves it) and CORS preflights
        if self.key_digests and scope["path"] not in OPEN_PATHS and scope["method"] != "OPTIONS":
            auth = headers.get(b"authorization", b"")
            token = auth[7:] if auth[:7].lower() == b"bearer " else b""
            digest = hashlib.sha256(token).digest()  # the header's bytes: a key is their UTF-8, as clients send it
            if not any([hmac.compare_digest(digest, known) for known in self.key_digests]):
                raise APIError(
                    401,
                    "missing or invalid API key (Authorization: Bearer ...)",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        limit = self.config.max_request_bytes
        declared = headers.get(b"content-length", b"")
        body = scope["method"] in ("POST", "PUT", "PATCH")
        if body and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"request body is larger than the limit of {limit} bytes")
        most = self.config.max_concurrent_requests
        if scope["method"] == "POST" and 0 < most <= self.metrics.in_progress:
            raise APIError(
                429,
                f"the server is at its limit of {most} requests in progress; retry later",
                headers={"Retry-After": "1"},
            )
        media = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if scope["method"] == "POST" and media != b"application/json" and not media.endswith(b"+json"):
            scope["headers"] = [(k, v) for k, v in scope["headers"] if k != b"content-type"] + [
                (b"content-type", b"application/json")
            ]

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body, within the size and time limits; None if the client disconnected.

        A body over the limit is read on to its end and dropped, so that the 413 reaches a client still
        sending (closing on unread data would reset the connection under the response).
        """
        limit, timeout = self.config.max_request_bytes, self.config.request_body_timeout
        too_large = APIError(413, f"request body is larger than the limit of {limit} bytes")
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(timeout if timeout > 0 else None):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size <= limit:
                        chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            if size > limit:
                too_large.headers = _CLOSE
                raise too_large from None
            raise APIError(408, f"the request body did not arrive within {timeout:g} seconds", headers=_CLOSE) from None
        if size > limit:
            raise too_large
        return b"".join(chunks)

    async def _check_items(self, body: bytes) -> None:
        """A large body's item lists against --max-inputs-per-request, in a thread, before FastAPI parses and
        validates it on the event loop (millions of one-token items held /health for seconds)."""
        limit, most_ids = self.config.max_inputs_per_request, self.config.max_tokens_per_request
        found = await asyncio.get_running_loop().run_in_executor(None, _too_many_items, body, limit, most_ids)
        if found is not None:
            name, n, ids = found
            if ids:  # parsed, millions of ids would be validated on the event loop, then cut to length
                message = (
                    f"'{name}' carries {n} token ids; the limit is {most_ids} per request (--max-tokens-per-request, "
                    "counted before truncation for token ids)"
                )
                raise APIError(413, message, name)
            raise APIError(400, f"'{name}' has {n} items; the limit is {limit} per request", name)


_COUNT_ITEMS_FROM = 256 * 1024
"""Bodies of this size or more have their item lists counted first (smaller ones validate in milliseconds)."""

_ITEM_FIELDS = ("input", "inputs", "texts", "documents", "text_1", "text_2", "data_1", "data_2", "queries", "items",
                "images", "ids")  # fmt: skip


_POOLING_PATHS = frozenset(
    ("/", "/classify", "/embeddings", "/pooling", "/v1/embeddings", "/v1/embed", "/v2/embed", "/invocations",
     "/rerank", "/score", "/v1/rerank", "/v1/score", "/v2/rerank", "/embed", "/embed_all", "/embed_sparse",
     "/predict", "/similarity")
)  # fmt: skip
"""POST routes of pooling requests (not /tokenize, /detokenize, /decode): TEI's request counts are theirs."""


_NUMBERS = (int, float)  # what JSON numbers parse to


def _too_many_items(body: bytes, limit: int, most_ids: int = 0) -> tuple[str, int, bool] | None:
    """(field, count, whether of token ids) of a top-level list of prompts longer than `limit`, or one whose token
    ids (a flat list of ints is one prompt of them) number more than `most_ids` (0: no limit). None for anything
    else, invalid JSON included (FastAPI says what is wrong with it)."""
    # The parse holds the GIL throughout (the event loop waits on it), and the collector, run every few hundred of
    # its small lists, made it several times longer: paused, its objects freed before collection resumes.
    with _collector_paused():
        try:
            value = orjson.loads(body)
        except orjson.JSONDecodeError:
            try:  # what orjson refuses and FastAPI's json.loads reads (a BOM, NaN, 1e400, a lone surrogate's escape)
                value = json.loads(body)
            except Exception:  # invalid JSON, nesting too deep: FastAPI says so
                return None
        try:
            return _count_items(value, limit, most_ids)
        finally:
            del value


_paused_lock = threading.Lock()
_paused = {"depth": 0, "was_enabled": False}


@contextmanager
def _collector_paused() -> Iterator[None]:
    """gc disabled while any caller is inside (tokenizer threads may overlap); restored by the last one out."""
    with _paused_lock:
        if _paused["depth"] == 0:
            _paused["was_enabled"] = gc.isenabled()
            gc.disable()
        _paused["depth"] += 1
    try:
        yield
    finally:
        with _paused_lock:
            _paused["depth"] -= 1
            if _paused["depth"] == 0 and _paused["was_enabled"]:
                gc.enable()


def _count_items(value: Any, limit: int, most_ids: int) -> tuple[str, int, bool] | None:
    if not isinstance(value, dict):
        return None
    for name in _ITEM_FIELDS:
        items = value.get(name)
        if not isinstance(items, list):
            continue
        # a flat list of numbers is one prompt of token ids (an id beyond 64 bits, or 1.0, is refused later by name)
        flat = all(type(x) in _NUMBERS for x in items)
        if len(items) > limit and not flat:
            return name, len(items), False
        ids = (
            len(items)
            if flat
            else sum(len(x) for x in items if type(x) is list and all(type(t) in _NUMBERS for t in x))
        )
        if most_ids and ids > most_ids:
            return name, ids, True
    return None


def _headers_only(send: Send) -> Send:
    """A response's start, and an empty body (HEAD)."""

    async def send_head(message: Message) -> None:
        if message["type"] == "http.response.body":
            if message.get("more_body", False):
                return
            message = {"type": "http.response.body", "body": b""}
        await send(message)

    return send_head


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body as one message; later calls go to the server's receive (so a disconnect is still seen)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


async def _on_validation(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    message, param = validation_message(exc)
    if message.startswith("the request body is empty") and request.scope.get(_BODY_SIZE):
        message = f"the request body must be a JSON object, not {json_type(exc.body)}"
    return error_response(400, message, param)


async def _on_http(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    message = {404: f"no route {request.url.path}", 405: f"method {request.method} not allowed here"}.get(
        exc.status_code, str(exc.detail)
    )
    if exc.status_code == 400 and "parsing the body" in message:  # FastAPI's wrap of a json.loads failure
        cause = exc.__cause__
        if isinstance(cause, RecursionError):
            message = "the request body is nested too deeply (JSON arrays or objects inside each other)"
        elif isinstance(cause, ValueError) and "integer string conversion" in str(cause):
            message = "the request body has a number with too many digits"
        else:  # undecodable bytes
            message = "the request body is not valid JSON (it must be UTF-8 encoded JSON)"
    headers = exc.headers
    if exc.status_code == 405:  # Allow names every route's methods at the path (the router gives the first's)
        methods = set((headers or {}).get("Allow", "").replace(" ", "").split(",")) - {""}
        methods |= {m.upper() for m in request.app.openapi()["paths"].get(request.url.path, {})}
        headers = {**(headers or {}), "Allow": ", ".join(sorted(methods | ({"HEAD"} if "GET" in methods else set())))}
    return error_response(exc.status_code, message, headers=headers)


async def _on_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    if exc.too_long is not None:  # TEI counts an input over the limit as its tokenizer's refusal
        request.scope[TE_ERR] = "tokenization"
    return error_response(exc.status, exc.message, exc.param, exc.headers)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    state = app.state.server
    engine, config = state.async_engine, state.config
    # the server's default prompt, for as long as it serves (the engine may serve on after it, offline)
    before = tei.set_default_prompt(state.model_config, config.default_prompt_name, config.default_prompt)
    engine.start()
    # The model, modules and caches live as long as the server: out of the collector's reach, a large body's
    # objects are collected without scanning them (the collector was most of such a body's parse)
    gc.freeze()
    try:
        yield
    finally:
        engine.stop()
        gc.unfreeze()  # a process that stops its server (a notebook, tests) gets the model's memory back
        state.model_config.default_prompt_name, state.model_config.default_prompt = before


class _App(FastAPI):
    def openapi(self) -> dict[str, Any]:
        """FastAPI's document less its own 422 responses: validation failures here are 400 (the error schema); the
        422 the TEI routes declare (TEI's error body) stays."""
        schema = super().openapi()
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                responses = operation.get("responses", {})
                if "HTTPValidationError" in str(responses.get("422")):
                    responses.pop("422")
        schemas = schema.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        return schema


def build_app(engine: Engine, config: ServerConfig) -> FastAPI:
    """The app over `engine` (ValueError for a default prompt the model does not have: the config's is set on the
    model while the app serves)."""
    if config.default_prompt_name is not None or config.default_prompt is not None:  # checked on a copy
        tei.set_default_prompt(copy.copy(engine.model_config), config.default_prompt_name, config.default_prompt)
    state = ServerState.create(engine, config)
    app = _App(
        title="polyvec",
        version=__version__,
        lifespan=lifespan,
        description="Pooling-model server: embeddings, multi-vector, classification, scoring.",
    )
    app.state.server = state
    handlers: dict[type[Exception], Callable[[Request, Exception], Any]] = {
        RequestValidationError: _on_validation,
        StarletteHTTPException: _on_http,
        APIError: _on_api_error,
    }
    for exc_class, handler in handlers.items():
        app.add_exception_handler(exc_class, handler)
    for router in (*ROUTERS, tei.router):
        app.include_router(router)
    # FastAPI 0.165 lists an included router as one entry without a path: the routers' own routes count
    paths = [getattr(r, "path", "") for r in app.routes] + [
        getattr(r, "path", "") for x in (*ROUTERS, tei.router) for r in x.routes
    ]
    app.add_middleware(ServerMiddleware, config=config, metrics=state.metrics, paths=paths)
    return app
