"""SageMaker's contract, as vLLM serves it: `POST /invocations` (any pooling request, routed by its shape) and
`GET|POST /ping` (the health check)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from .. import protocol as P
from ..errors import POST_ERRORS, APIError, ErrorResponse, error_responses, shorten
from ..protocol_tei import TEIErrorResponse
from ..serving import State, json_body
from . import embeddings, score, tei, utility

router = APIRouter()

ADAPTER_HEADER = "X-Amzn-SageMaker-Adapter-Identifier"


def _handlers(state: Any) -> list[tuple[type[BaseModel], Any]]:
    """The request shapes this model answers, in vLLM's order: embeddings (a model whose task is embed),
    classification (classify), rerank, score, pooling (so a ColBERT model's `{"input"}` is a pooling request)."""
    engine = state.engine
    out: list[tuple[type[BaseModel], Any]] = []
    if engine.pooling_task == "embed":
        out.append((P.EmbeddingRequest, embeddings.create_embeddings))
    if engine.pooling_task == "classify":
        out.append((P.ClassificationRequest, embeddings.create_classify))
    out += [
        (P.RerankRequest, score._rerank),
        (P.ScoreRequest, score._score),
        (P.PoolingRequest, embeddings.create_pooling),
    ]
    return out


@router.post(
    "/invocations",
    summary="SageMaker: any pooling request, routed by its fields",
    response_class=Response,
    responses={
        200: {"description": "The response of the endpoint whose request shape the body has"},
        **POST_ERRORS,
        400: {"model": ErrorResponse | TEIErrorResponse, "description": "Invalid request (TEI's body for TEI's)"},
        **tei.tei_error_responses(422, 424),
    },
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"type": "object"}}},
            "description": "A /v1/embeddings, /classify, /rerank, /score or /pooling body, or TEI's body of "
            "the model's own route (POST /)",
        }
    },
)
async def invocations(raw: Request, state: State) -> Response:
    body = await json_body(raw)
    adapter = raw.headers.get(ADAPTER_HEADER)
    if adapter is not None:  # vLLM's: the adapter is the body's model (no adapters load at run time here)
        if adapter not in state.names:
            message = f"the adapter '{shorten(adapter)}' is not served; served: {', '.join(state.names)}"
            raise APIError(404, message, ADAPTER_HEADER)
        if isinstance(body, dict):
            body = {**body, "model": adapter}
    if isinstance(body, dict) and "input" not in body and ("inputs" in body or {"query", "texts"} <= body.keys()):
        return await tei.invoke_model_route(raw, state)  # TEI's body (`inputs`; query + texts): TEI's model route
    handlers = _handlers(state)
    closest: ValidationError | None = None
    for model, handler in handlers:
        try:
            req = model.model_validate(body)
        except ValidationError as exc:
            # the shape whose defining field the body has: its own error names the field and item (a field only
            # one shape has, as /pooling's task, over the `input` several share)
            defining = _defining_field(model)
            if isinstance(body, dict) and defining in body and (closest is None or defining != "input"):
                closest = exc
            continue
        return await handler(req, raw, state)
    if closest is not None:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in closest.errors()]) from None
    names = ", ".join(m.__name__ for m, _ in handlers)
    raise APIError(400, f"Cannot find suitable handler for request. Expected one of: [{names}]")


def _defining_field(model: type[BaseModel]) -> str:
    """The body field that says which request shape a body means."""
    return {P.RerankRequest: "query", P.ScoreRequest: "text_1", P.PoolingRequest: "task"}.get(model, "input")


router.add_api_route(
    "/ping",
    utility.liveness,
    methods=["GET", "POST"],
    summary="Liveness (SageMaker)",
    response_class=Response,
    response_description="The server is up; the body is empty (no API key needed)",
    # a POST body still passes the server's body checks (size, arrival time, requests in progress)
    responses={**error_responses(408, 413, 429), 503: utility.ENGINE_DEAD},
)
