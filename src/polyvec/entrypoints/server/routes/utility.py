"""Tokenizer, model listing and operations: `/tokenize`, `/detokenize`, `/v1/models`, `/health`, `/version`,
`/metrics` (Prometheus).

Tokenizing and detokenizing run in the engine's tokenizer thread pool, and their (possibly huge) JSON bodies
are rendered there too, so that a maximum-size prompt never stalls the event loop (and /health with it).
"""

from __future__ import annotations

import json
import time
from typing import Any, cast

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from .... import __version__
from ....tokenizer import PolyTokenizer
from .. import protocol as P
from .. import protocol_tei as T
from ..errors import POST_ERRORS, APIError, error_responses
from ..metrics import export
from ..serving import (
    ServerState,
    State,
    chat_special_tokens,
    check_model,
    check_processor_kwargs,
    process_prompts,
    render_messages,
    request_prompts,
)
from . import tei

router = APIRouter()

_SLICE = 16384
"""List items rendered per json.dumps call: each call holds the GIL, the loop between them lets it go."""


def render_json(content: dict[str, Any]) -> bytes:
    """A flat dict as JSON, its long lists a slice at a time (one json.dumps of millions of items would hold
    the GIL, and so block the event loop, until it is done)."""
    parts = []
    for key, value in content.items():
        if isinstance(value, list) and len(value) > _SLICE:
            items = ",".join(
                json.dumps(value[i : i + _SLICE], ensure_ascii=False)[1:-1] for i in range(0, len(value), _SLICE)
            )
            parts.append(f"{json.dumps(key)}:[{items}]")
        else:
            parts.append(f"{json.dumps(key)}:{json.dumps(value, ensure_ascii=False)}")
    return ("{" + ",".join(parts) + "}").encode("utf-8")


def _tokenize(
    tokenizer: PolyTokenizer, req: P.TokenizeRequest, text: str, add_special: bool, max_model_len: int, most: int
) -> bytes:
    # Through the batch encoder: `tokenizers` releases the GIL in encode_batch, not in encode (tokenize()).
    (enc,) = tokenizer.encode_prompts([text], 1 << 62, truncate=False, add_special_tokens=add_special)
    return _ids_json(tokenizer, req, enc.input_ids, max_model_len, most)


def _ids_json(tokenizer: PolyTokenizer, req: P.TokenizeRequest, ids: list[int], max_model_len: int, most: int) -> bytes:
    if 0 < most < len(ids):  # the limit of every request's tokens, as its documented 413 says
        message = f"the prompt has {len(ids)} tokens; the limit is {most} tokens per request (--max-tokens-per-request)"
        raise APIError(413, message, "messages" if req.messages is not None else "prompt")
    return render_json(
        {
            "count": len(ids),
            "max_model_len": max_model_len,
            "tokens": ids,
            "token_strs": [tokenizer.id_to_token(i) for i in ids] if req.return_token_strs else None,
        }
    )


def _detokenize(tokenizer: PolyTokenizer, tokens: list[int]) -> bytes:
    vocab = tokenizer.vocab_size
    bad = next(((j, t) for j, t in enumerate(tokens) if t >= vocab), None)
    if bad is not None:
        raise APIError(400, f"'tokens' item {bad[0]} is {bad[1]}, outside the vocabulary (size {vocab})", "tokens")
    # `tokenizers` releases the GIL in decode_batch, not in decode (which PolyTokenizer.decode calls).
    (text,) = tokenizer._base.decode_batch([tokens], skip_special_tokens=False)
    return render_json({"prompt": tokenizer.clean_up(text)})  # vLLM's is transformers' decode


_TOKENIZE_RESPONSES: dict[int | str, dict[str, Any]] = {200: {"model": P.TokenizeResponse}, **POST_ERRORS}
_DETOKENIZE_RESPONSES: dict[int | str, dict[str, Any]] = {200: {"model": P.DetokenizeResponse}, **POST_ERRORS}


async def tokenize(req: T.TokenizeBody, state: State) -> Response:
    """`{"count", "max_model_len", "tokens", "token_strs"}`: the prompt's token ids (and their strings when
    `return_token_strs`). TEI's body (`inputs`, no `prompt`) gets TEI's tokens instead (routes/tei.py)."""
    if isinstance(req, T.TEITokenizeRequest):
        return await tei.tokenize(req, state)
    check_model(state, req.model)
    check_processor_kwargs(state, req)
    if req.messages is not None and state.model_config.colqwen2 is not None:  # the ids the engine encodes
        images, add_special, locate = await request_prompts(state, req)
        (request,) = await process_prompts(
            state, images, None, "token_embed", locate=locate, add_special_tokens=add_special
        )
        ids = list(request.prompt_token_ids)
        body = _ids_json(
            state.engine.tokenizer, req, ids, state.model_config.max_model_len, state.config.max_tokens_per_request
        )
        return Response(body, media_type="application/json")
    if req.messages is not None:
        text, add_special = await state.async_engine.call(render_messages, state, req), chat_special_tokens(req)
    else:
        text, add_special = cast(str, req.prompt), req.add_special_tokens
    body = await state.async_engine.call(
        _tokenize,
        state.engine.tokenizer,
        req,
        text,
        add_special,
        state.model_config.max_model_len,
        state.config.max_tokens_per_request,
    )
    return Response(body, media_type="application/json")


router.add_api_route(
    "/tokenize",
    tokenize,
    methods=["POST"],
    summary="Tokenize text (vLLM's or TEI's body)",
    response_class=Response,
    responses=tei.shared_responses(_TOKENIZE_RESPONSES, T.TEITokenizeResponse, backend=False),
    route_class_override=tei.SharedRoute,
)


@router.post("/detokenize", summary="Detokenize token ids", response_class=Response, responses=_DETOKENIZE_RESPONSES)
async def detokenize(req: P.DetokenizeRequest, state: State) -> Response:
    """`{"prompt"}`: the text of the token ids (special tokens kept)."""
    check_model(state, req.model)
    body = await state.async_engine.call(_detokenize, state.engine.tokenizer, req.tokens)
    return Response(body, media_type="application/json")


_GET_ERRORS = error_responses(401, 500)


@router.get(
    "/v1/models", summary="Served models", response_model=None, responses={200: {"model": P.ModelList}, **_GET_ERRORS}
)
async def models(state: State) -> dict[str, Any]:
    return {"object": "list", "data": [_card(state, n) for n in state.names]}


@router.get(
    "/v1/models/{model:path}",
    summary="One served model (OpenAI's retrieve)",
    response_model=None,
    responses={200: {"model": P.ModelCard}, **_GET_ERRORS, **error_responses(404)},
)
async def model(model: str, state: State) -> dict[str, Any]:
    check_model(state, model, exact=True)
    return _card(state, model)


def _card(state: ServerState, name: str) -> dict[str, Any]:
    mc = state.model_config
    return {
        "id": name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "polyvec",
        "root": str(mc.path),
        "parent": None,
        "max_model_len": mc.max_model_len,
        "permission": [],
    }


@router.get(
    "/models",
    summary="Served models (Infinity's)",
    response_model=None,
    responses={200: {"model": P.InfinityModelList}, **_GET_ERRORS},
)
async def infinity_models(state: State) -> dict[str, Any]:
    """Infinity's model list (its clients call /models): each name with what it can do."""
    tasks = set(state.engine.supported_tasks)
    embeds = bool({"embed", "token_embed"} & tasks)
    has = {
        "embed": embeds,
        "classify": "classify" in tasks,
        "rerank": embeds or state.engine.is_cross_encoder,  # what /rerank can score
        "image_embed": state.model_config.colqwen2 is not None,
    }
    capabilities = [name for name, yes in has.items() if yes]
    created = int(time.time())
    return {
        "object": "list",
        "data": [
            {
                "id": n,
                "object": "model",
                "created": created,
                "stats": {},
                "backend": "polyvec",
                "capabilities": capabilities,
            }
            for n in state.names
        ],
    }


ENGINE_DEAD = {"description": "The engine stopped on an internal error; the body is empty"}


@router.get(
    "/health",
    summary="Liveness",
    response_model=P.HealthResponse,
    response_description="The server is up (no API key needed)",
    responses={503: ENGINE_DEAD},
)
async def health(state: State) -> Response:
    """vLLM's: 200 while the engine runs, 503 once it has died (a load balancer then stops sending it work). The
    body is Infinity's, which its client parses (vLLM's and TEI's are empty; their clients read the status)."""
    if not state.async_engine.alive:
        return Response(status_code=503)
    return Response(f'{{"unix":{time.time():.6f}}}', media_type="application/json")  # fixed length: HEAD = GET


async def liveness(state: State) -> Response:
    """/health's status with an empty body: SageMaker's /ping, as vLLM's."""
    return Response(status_code=200 if state.async_engine.alive else 503)


router.add_api_route(
    "/",
    health,
    methods=["GET"],
    summary="Liveness (TEI's GET /)",
    response_model=P.HealthResponse,
    response_description="The server is up",
    responses={**_GET_ERRORS, 503: ENGINE_DEAD},
    # unlike /health, under the API key: POST / shares the path
)


@router.get(
    "/load",
    summary="Server load (vLLM's)",
    response_model=None,
    responses={200: {"model": P.LoadResponse}, **_GET_ERRORS},
)
async def load(state: State) -> dict[str, int]:
    """`{"server_load": N}`: the POST requests in progress (vLLM counts them with --enable-server-load-tracking;
    here always), for a router in front of several servers."""
    return {"server_load": state.metrics.in_progress}


@router.get(
    "/version",
    summary="polyvec version",
    response_model=None,
    responses={200: {"model": P.VersionResponse}, **_GET_ERRORS},
)
async def version() -> dict[str, str]:
    return {"version": __version__}


@router.get(
    "/metrics",
    summary="Prometheus metrics",
    response_class=Response,
    response_description="Prometheus text exposition format",
    responses=_GET_ERRORS,
)
async def prometheus(state: State) -> Response:
    return Response(export(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
