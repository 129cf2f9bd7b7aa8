"""Tokenizer, model listing and operations: `/tokenize`, `/detokenize`, `/v1/models`, `/health`, `/version`,
`/metrics` (Prometheus)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .... import __version__
from .. import protocol as P
from ..errors import APIError
from ..serving import State, check_model

router = APIRouter()


# response_model=None: the dict annotations must not add response schemas to the OpenAPI document.
@router.post("/tokenize", summary="Tokenize text", response_model=None)
async def tokenize(req: P.TokenizeRequest, state: State) -> dict[str, Any]:
    check_model(state, req.model)
    ids, strs = state.engine.tokenizer.tokenize(req.prompt, req.add_special_tokens)
    return {
        "count": len(ids),
        "max_model_len": state.model_config.max_model_len,
        "tokens": ids,
        "token_strs": strs if req.return_token_strs else None,
    }


@router.post("/detokenize", summary="Detokenize token ids", response_model=None)
async def detokenize(req: P.DetokenizeRequest, state: State) -> dict[str, Any]:
    check_model(state, req.model)
    tokenizer = state.engine.tokenizer
    vocab = tokenizer.vocab_size
    bad = [t for t in req.tokens if t >= vocab]
    if bad:
        raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary (size {vocab})", "tokens")
    return {"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)}


@router.get("/v1/models", summary="Served models", response_model=None)
async def models(state: State) -> dict[str, Any]:
    created = int(time.time())
    mc = state.model_config
    return {
        "object": "list",
        "data": [
            {
                "id": n,
                "object": "model",
                "created": created,
                "owned_by": "polyvec",
                "root": str(mc.path),
                "parent": None,
                "max_model_len": mc.max_model_len,
                "permission": [],
            }
            for n in state.names
        ],
    }


@router.get("/health", summary="Liveness")
async def health() -> Response:
    return Response(status_code=200)


@router.get("/version", summary="polyvec version", response_model=None)
async def version() -> dict[str, str]:
    return {"version": __version__}


@router.get("/metrics", summary="Prometheus metrics")
async def prometheus(state: State) -> Response:
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
