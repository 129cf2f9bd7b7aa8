"""The HTTP server: vLLM- and OpenAI-compatible pooling endpoints over one shared engine.

Endpoints and their bodies follow vLLM's pooling server (`/pooling`, `/classify`, `/score`, `/rerank`,
`/tokenize`, ...), the OpenAI embeddings API (`/v1/embeddings`) and Cohere's embed v2 (`/v2/embed`). Errors
are `{"error": {"message", "type", "param", "code"}}` with a 4xx status for anything the client sent wrong;
the engine keeps serving the other requests.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from ... import __version__
from ...engine.engine import Engine
from ...pooling_params import PoolingParams
from ...scoring import plan_scores
from . import protocol as P
from .async_engine import AsyncEngine
from .encoding import encode_bytes, encode_json
from .metrics import ServerMetrics

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


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowed",
                413: "RequestEntityTooLarge", 500: "InternalServerError", 503: "ServiceUnavailable"}


def error_response(status: int, message: str, param: str | None = None, headers=None) -> JSONResponse:
    body = {"error": {"message": message, "type": _ERROR_TYPES.get(status, "Error"), "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
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


class ServerMiddleware:
    """Pure ASGI (so handlers still see client disconnects): API key, body limit, JSON bodies, metrics.

    - every route but /health needs `Authorization: Bearer KEY` when a key is set (401);
    - bodies over the limit get 413 before they are buffered (Content-Length or streamed size);
    - every POST body is read as JSON whatever content type the client declared (`curl -d` says form data);
    - requests are counted by route and status, and timed.
    """

    def __init__(self, app, config: ServerConfig, metrics: ServerMetrics):
        self.app, self.config, self.metrics = app, config, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        headers = dict(scope.get("headers") or [])
        status = {"code": 500}

        async def send_recording(message):
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
                await error_response(401, "missing or invalid API key (Authorization: Bearer ...)",
                                     headers={"WWW-Authenticate": "Bearer"})(scope, receive, send_recording)
                return record(scope["path"])

        limit = self.config.max_request_bytes
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            await error_response(413, f"request body is larger than the limit of {limit} bytes")(
                scope, receive, send_recording)
            return record(scope["path"])
        if scope.get("method") == "POST" and not headers.get(b"content-type", b"").startswith(b"application/json"):
            scope["headers"] = [(k, v) for k, v in scope["headers"] if k != b"content-type"] + [
                (b"content-type", b"application/json")]
        seen = 0

        async def limited_receive():
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


def build_app(engine: Engine, config: ServerConfig) -> FastAPI:
    async_engine = AsyncEngine(engine)
    metrics = ServerMetrics(lambda: async_engine.queue_depth, lambda: async_engine.num_pending)
    async_engine.on_batch = metrics.on_batch
    async_engine.on_abort = metrics.aborted.inc
    names = config.served_model_names or [engine.model_config.model]
    model_config = engine.model_config

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        yield
        async_engine.stop()

    app = FastAPI(title="polyvec", version=__version__, lifespan=lifespan,
                  description="Pooling-model server: embeddings, multi-vector, classification, scoring.")
    app.state.engine = async_engine
    app.state.metrics = metrics

    # --------------------------------------------------------------------------------- cross-cutting

    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request: Request, exc: StarletteHTTPException):
        message = {404: f"no route {request.url.path}", 405: f"method {request.method} not allowed here"}.get(
            exc.status_code, str(exc.detail))
        if exc.status_code == 400 and "parsing the body" in message:  # undecodable bytes
            message = "the request body is not valid JSON (it must be UTF-8 encoded JSON)"
        return error_response(exc.status_code, message)

    @app.exception_handler(APIError)
    async def _on_api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(Exception)
    async def _on_unexpected(request: Request, exc: Exception):
        logger.exception("unexpected error on %s", request.url.path)
        return error_response(500, f"internal error: {exc.__class__.__name__}")

    # --------------------------------------------------------------------------------- helpers

    def check_model(name: str | None) -> str:
        if name is not None and name not in names:
            raise APIError(404, f"the model '{name}' does not exist; served: {', '.join(names)}", "model")
        return names[0]

    def prompts_of(value: Any, field_name: str = "input") -> list:
        if isinstance(value, str):
            prompts = [value]
        elif value and all(isinstance(x, int) for x in value):
            prompts = [list(value)]
        else:
            prompts = list(value)
        if not prompts:
            raise APIError(400, f"'{field_name}' must not be empty", field_name)
        if len(prompts) > config.max_inputs_per_request:
            raise APIError(400, f"'{field_name}' has {len(prompts)} items; the limit is "
                                f"{config.max_inputs_per_request} per request", field_name)
        for i, p in enumerate(prompts):  # an empty string is valid (its special tokens are embedded)
            if isinstance(p, list) and not p:
                raise APIError(400, f"'{field_name}' item {i} is an empty list of token ids", field_name)
        return prompts

    async def run_pooling(raw: Request, prompts: list, params: PoolingParams, task: str, **kwargs) -> list:
        try:
            requests = await async_engine.process(prompts, params, task, **kwargs)
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc)) from None
        outputs = await _until_disconnect(raw, async_engine.run(requests))
        metrics.prompt_tokens.inc(sum(len(o.prompt_token_ids) for o in outputs))
        return outputs

    def encoded_response(req, outputs, prefix: str, obj: str, key: str, model: str, with_shape: bool):
        tokens = sum(len(o.prompt_token_ids) for o in outputs)
        tensors = [o.outputs.data for o in outputs]
        if req.encoding_format in ("bytes", "bytes_only"):
            body, items = encode_bytes(tensors, req.embed_dtype, req.endianness)
            headers = None
            if req.encoding_format == "bytes":
                meta = P.envelope(prefix, model, items, tokens)
                headers = {"metadata": json.dumps({k: meta[k] for k in ("id", "created", "model", "data", "usage")})}
            return Response(body, media_type="application/octet-stream", headers=headers)
        data = []
        for i, t in enumerate(tensors):
            item = {"index": i, "object": obj, key: encode_json(t, req.encoding_format, req.embed_dtype,
                                                                 req.endianness)}
            if with_shape:
                item["shape"] = list(t.shape)
            if outputs[i].input_type is not None:
                item["input_type"] = outputs[i].input_type
            data.append(item)
        return JSONResponse(P.envelope(prefix, model, data, tokens))

    def embed_params(req) -> PoolingParams:
        return PoolingParams(dimensions=req.dimensions, use_activation=req.use_activation, normalize=req.normalize,
                             activation=getattr(req, "activation", None), input_type=req.input_type,
                             truncate_prompt_tokens=req.truncate_prompt_tokens, long_input=req.long_input,
                             window_overlap=req.window_overlap)

    async def score_pairs(raw: Request, text_1, text_2, req) -> tuple[list[float], int]:
        try:
            plan = plan_scores(text_1, text_2, engine.supported_tasks, engine.is_cross_encoder,
                               late_interaction=engine.colbert is not None)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        for side, value in (("text_1", text_1), ("text_2", text_2)):
            prompts_of(value, side)
        params = PoolingParams(truncate_prompt_tokens=req.truncate_prompt_tokens,
                               use_activation=req.use_activation if plan.task == "classify" else None)
        outputs = await run_pooling(raw, plan.prompts, plan.params(params), plan.task)
        return plan.scores(outputs), sum(len(o.prompt_token_ids) for o in outputs)

    # --------------------------------------------------------------------------------- endpoints

    @app.post("/v1/embeddings", summary="OpenAI embeddings")
    async def create_embeddings(req: P.EmbeddingRequest, raw: Request):
        model = check_model(req.model)
        # A late-interaction model's embedding is its matrix of token vectors (with its shape and mode).
        task = "token_embed" if engine.colbert is not None else "embed"
        outputs = await run_pooling(raw, prompts_of(req.input), embed_params(req), task,
                                    add_special_tokens=req.add_special_tokens)
        return encoded_response(req, outputs, "embd", "embedding", "embedding", model,
                                with_shape=engine.colbert is not None)

    @app.post("/pooling", summary="vLLM pooling: any task")
    async def create_pooling(req: P.PoolingRequest, raw: Request):
        model = check_model(req.model)
        task = req.task
        if task is None:
            task = next((t for t in ("token_embed", "token_classify") if t in engine.supported_tasks), None)
            if task is None:
                raise APIError(400, f"'task' is required for this model; it supports: "
                                    f"{', '.join(engine.supported_tasks)}", "task")
        outputs = await run_pooling(raw, prompts_of(req.input), embed_params(req), task,
                                    add_special_tokens=req.add_special_tokens)
        return encoded_response(req, outputs, "pool", "pooling", "data", model, with_shape=True)

    @app.post("/classify", summary="vLLM classification")
    async def create_classify(req: P.ClassificationRequest, raw: Request):
        model = check_model(req.model)
        params = PoolingParams(use_activation=req.use_activation, activation=req.activation,
                               truncate_prompt_tokens=req.truncate_prompt_tokens)
        outputs = await run_pooling(raw, prompts_of(req.input), params, "classify",
                                    add_special_tokens=req.add_special_tokens)
        data = []
        for i, o in enumerate(outputs):
            probs = o.outputs.data
            data.append({"index": i, "label": model_config.id2label.get(int(probs.argmax()), str(int(probs.argmax()))),
                         "probs": probs.tolist(), "num_classes": int(probs.shape[-1])})
        return JSONResponse(P.envelope("classify", model, data, sum(len(o.prompt_token_ids) for o in outputs)))

    async def _score(req: P.ScoreRequest, raw: Request):
        model = check_model(req.model)
        try:
            text_1, text_2 = req.sides()
        except ValueError as exc:
            raise APIError(400, str(exc), "text_1") from None
        scores, tokens = await score_pairs(raw, text_1, text_2, req)
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
        return JSONResponse(P.envelope("score", model, data, tokens))

    app.post("/score", summary="vLLM score (1:1, 1:N, N:N)")(_score)
    app.post("/v1/score", summary="vLLM score (1:1, 1:N, N:N)")(_score)

    async def _rerank(req: P.RerankRequest, raw: Request):
        model = check_model(req.model)
        prompts_of(req.documents, "documents")
        scores, tokens = await score_pairs(raw, req.query, req.documents, req)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        if req.top_n:
            order = order[: req.top_n]
        results = []
        for i in order:
            item: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if req.return_documents:
                item["document"] = {"text": req.documents[i]}
            results.append(item)
        return JSONResponse({"id": P.random_id("rerank"), "model": model, "results": results,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.post(path, summary="Jina / Cohere rerank")(_rerank)

    @app.post("/v2/embed", summary="Cohere embed v2")
    async def cohere_embed(req: P.CohereEmbedRequest, raw: Request):
        check_model(req.model)
        if req.truncate == "START":
            raise APIError(400, "truncate='START' is not supported; use END or NONE", "truncate")
        params = PoolingParams(dimensions=req.output_dimension, truncate_prompt_tokens=req.max_tokens,
                               input_type=req.input_type)
        multi = engine.colbert is not None
        if multi and set(req.embedding_types or ["float"]) - {"float", "base64"}:
            raise APIError(400, "a late-interaction model returns float or base64 token matrices only",
                           "embedding_types")
        outputs = await run_pooling(raw, prompts_of(req.texts, "texts"), params, "token_embed" if multi else "embed",
                                    truncation="error" if req.truncate == "NONE" else "auto")
        if multi:
            embeddings = {kind: [encode_json(o.outputs.data, kind, "float32", "little") for o in outputs]
                          for kind in req.embedding_types or ["float"]}
            tokens = sum(len(o.prompt_token_ids) for o in outputs)
            return JSONResponse({"id": P.random_id("embd"), "embeddings": embeddings, "texts": req.texts,
                                 "shapes": [list(o.outputs.data.shape) for o in outputs],
                                 "input_type": outputs[0].input_type,
                                 "meta": {"api_version": {"version": "2"}, "billed_units": {"input_tokens": tokens}},
                                 "response_type": "embeddings_by_type"})
        vecs = np.stack([o.outputs.data.numpy() for o in outputs])
        embeddings: dict[str, Any] = {}
        for kind in req.embedding_types or ["float"]:
            if kind == "float":
                embeddings["float"] = vecs.tolist()
            elif kind == "base64":
                embeddings["base64"] = [encode_json(o.outputs.data, "base64", "float32", "little") for o in outputs]
            else:
                if vecs.shape[1] % 8:
                    raise APIError(400, f"embedding_types '{kind}' needs a dimension divisible by 8, "
                                        f"not {vecs.shape[1]}", "embedding_types")
                packed = np.packbits(vecs >= 0, axis=-1).astype(np.int16)
                embeddings[kind] = (packed - 128 if kind == "binary" else packed).tolist()
        tokens = sum(len(o.prompt_token_ids) for o in outputs)
        return JSONResponse({"id": P.random_id("embd"), "embeddings": embeddings, "texts": req.texts,
                             "meta": {"api_version": {"version": "2"}, "billed_units": {"input_tokens": tokens}},
                             "response_type": "embeddings_by_type"})

    @app.post("/tokenize", summary="Tokenize text")
    async def tokenize(req: P.TokenizeRequest):
        check_model(req.model)
        ids, strs = engine.tokenizer.tokenize(req.prompt, req.add_special_tokens)
        return {"count": len(ids), "max_model_len": model_config.max_model_len, "tokens": ids,
                "token_strs": strs if req.return_token_strs else None}

    @app.post("/detokenize", summary="Detokenize token ids")
    async def detokenize(req: P.DetokenizeRequest):
        check_model(req.model)
        vocab = engine.tokenizer.vocab_size
        bad = [t for t in req.tokens if t >= vocab]
        if bad:
            raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary (size {vocab})", "tokens")
        return {"prompt": engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    @app.get("/v1/models", summary="Served models")
    async def models():
        created = int(time.time())
        return {"object": "list", "data": [
            {"id": n, "object": "model", "created": created, "owned_by": "polyvec", "root": str(model_config.path),
             "parent": None, "max_model_len": model_config.max_model_len, "permission": []} for n in names]}

    @app.get("/health", summary="Liveness")
    async def health():
        return Response(status_code=200)

    @app.get("/version", summary="polyvec version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics", summary="Prometheus metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(ServerMiddleware, config=config, metrics=metrics)
    return app


async def _until_disconnect(raw: Request, work):
    """Await `work`, cancelling it (which aborts its queued requests) if the client disconnects first.

    Once the body has been read, the next ASGI `receive()` only returns when the client disconnects, so one
    waiting call per request watches for it without polling.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(raw))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    raise APIError(499, "client disconnected")


async def _disconnected(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass
