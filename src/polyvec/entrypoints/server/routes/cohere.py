"""Cohere embed v2: `/v2/embed`, with float, base64, binary and ubinary embedding types."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from .. import protocol as P
from ..encoding import VectorJSONResponse, encode_by_type
from ..errors import POST_ERRORS, APIError
from ..serving import State, check_model, pooling_params, prompts_of, run_pooling

router = APIRouter()


@router.post("/v2/embed", summary="Cohere embed v2", responses={200: {"model": P.CohereEmbedResponse}, **POST_ERRORS})
async def cohere_embed(req: P.CohereEmbedRequest, raw: Request, state: State) -> Response:
    check_model(state, req.model)
    if req.truncate == "START":
        raise APIError(400, "truncate='START' is not supported; use END or NONE", "truncate")
    params = pooling_params(req, dimensions=req.output_dimension, truncate_prompt_tokens=req.max_tokens)
    kinds: list[str] = list(req.embedding_types or ["float"])
    multi = state.engine.is_late_interaction
    if multi and set(kinds) - {"float", "base64"}:
        raise APIError(400, "a late-interaction model returns float or base64 token matrices only", "embedding_types")
    outputs = await run_pooling(
        state,
        raw,
        prompts_of(state, req.texts, "texts"),
        params,
        "token_embed" if multi else "embed",
        field="texts",
        truncation="error" if req.truncate == "NONE" else "auto",
    )
    tensors = [o.outputs.data for o in outputs]
    try:
        embeddings = encode_by_type(tensors, kinds)
    except ValueError as exc:  # binary / ubinary of a dimension not divisible by 8
        raise APIError(400, str(exc), "embedding_types") from None
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    body: dict[str, Any] = {"id": P.random_id("embd"), "embeddings": embeddings, "texts": req.texts}
    if multi:
        body |= {"shapes": [list(t.shape) for t in tensors], "input_type": outputs[0].input_type}
    body |= {
        "meta": {"api_version": {"version": "2"}, "billed_units": {"input_tokens": tokens}},
        "response_type": "embeddings_by_type",
    }
    return VectorJSONResponse(body)
