"""OpenAI `/v1/embeddings` and vLLM's `/pooling` (any task) and `/classify`."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from .. import protocol as P
from ..errors import POST_ERRORS, APIError
from ..serving import State, check_model, encoded_response, pooling_params, prompts_of, run_pooling

router = APIRouter()


@router.post("/v1/embeddings", summary="OpenAI embeddings", responses=POST_ERRORS)
async def create_embeddings(req: P.EmbeddingRequest, raw: Request, state: State) -> Response:
    model = check_model(state, req.model)
    multi = state.engine.is_late_interaction
    # A late-interaction model's embedding is its matrix of token vectors (with its shape and mode).
    outputs = await run_pooling(
        state,
        raw,
        prompts_of(state, req.input),
        pooling_params(req),
        "token_embed" if multi else "embed",
        add_special_tokens=req.add_special_tokens,
    )
    return encoded_response(req, outputs, "embd", "embedding", "embedding", model, with_shape=multi)


@router.post("/pooling", summary="vLLM pooling: any task", responses=POST_ERRORS)
async def create_pooling(req: P.PoolingRequest, raw: Request, state: State) -> Response:
    model = check_model(state, req.model)
    supported = state.engine.supported_tasks
    task = req.task
    if task is None:
        task = next((t for t in ("token_embed", "token_classify") if t in supported), None)
        if task is None:
            raise APIError(400, f"'task' is required for this model; it supports: {', '.join(supported)}", "task")
    outputs = await run_pooling(
        state, raw, prompts_of(state, req.input), pooling_params(req), task, add_special_tokens=req.add_special_tokens
    )
    return encoded_response(req, outputs, "pool", "pooling", "data", model, with_shape=True)


@router.post("/classify", summary="vLLM classification", responses=POST_ERRORS)
async def create_classify(req: P.ClassificationRequest, raw: Request, state: State) -> Response:
    model = check_model(state, req.model)
    outputs = await run_pooling(
        state,
        raw,
        prompts_of(state, req.input),
        pooling_params(req),
        "classify",
        add_special_tokens=req.add_special_tokens,
    )
    id2label = state.model_config.id2label
    data = []
    for i, o in enumerate(outputs):
        probs = o.outputs.data
        label = int(probs.argmax())
        data.append(
            {
                "index": i,
                "label": id2label.get(label, str(label)),
                "probs": probs.tolist(),
                "num_classes": int(probs.shape[-1]),
            }
        )
    return JSONResponse(P.envelope("classify", model, data, sum(len(o.prompt_token_ids) for o in outputs)))
