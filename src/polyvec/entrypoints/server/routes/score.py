"""Scoring: vLLM's `/score` and `/v1/score` (1:1, 1:N, N:N) and Jina / Cohere `/rerank`, `/v1/rerank`, `/v2/rerank`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ....scoring import plan_scores
from .. import protocol as P
from ..errors import APIError
from ..serving import ServerState, State, check_model, pooling_params, prompts_of, run_pooling

router = APIRouter()


async def score_pairs(
    state: ServerState, raw: Request, text_1: P.ScoreInput, text_2: P.ScoreInput, req: P.ScoreRequest | P.RerankRequest
) -> tuple[list[float], int]:
    """One score per (text_1, text_2) pair, by the model's kind (see scoring.py), and the tokens it took."""
    engine = state.engine
    try:
        plan = plan_scores(
            text_1, text_2, engine.supported_tasks, engine.is_cross_encoder, late_interaction=engine.is_late_interaction
        )
    except ValueError as exc:
        raise APIError(400, str(exc)) from None
    for side, value in (("text_1", text_1), ("text_2", text_2)):
        prompts_of(state, value, side)
    # A score body's use_activation is the cross-encoder's sigmoid; embedding scores keep the model's default.
    params = pooling_params(req, use_activation=req.use_activation if plan.task == "classify" else None)
    outputs = await run_pooling(state, raw, plan.prompts, plan.params(params), plan.task)
    return plan.scores(outputs), sum(len(o.prompt_token_ids) for o in outputs)


async def _score(req: P.ScoreRequest, raw: Request, state: State) -> Response:
    model = check_model(state, req.model)
    try:
        text_1, text_2 = req.sides()
    except ValueError as exc:
        raise APIError(400, str(exc), "text_1") from None
    scores, tokens = await score_pairs(state, raw, text_1, text_2, req)
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    return JSONResponse(P.envelope("score", model, data, tokens))


async def _rerank(req: P.RerankRequest, raw: Request, state: State) -> Response:
    model = check_model(state, req.model)
    prompts_of(state, req.documents, "documents")
    scores, tokens = await score_pairs(state, raw, req.query, req.documents, req)
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    if req.top_n:
        order = order[: req.top_n]
    results = []
    for i in order:
        item: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if req.return_documents:
            item["document"] = {"text": req.documents[i]}
        results.append(item)
    return JSONResponse(
        {
            "id": P.random_id("rerank"),
            "model": model,
            "results": results,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )


# One handler per family under several paths; the names stay `_score` / `_rerank` so OpenAPI operation ids hold.
for _path in ("/score", "/v1/score"):
    router.post(_path, summary="vLLM score (1:1, 1:N, N:N)")(_score)
for _path in ("/rerank", "/v1/rerank", "/v2/rerank"):
    router.post(_path, summary="Jina / Cohere rerank")(_rerank)
