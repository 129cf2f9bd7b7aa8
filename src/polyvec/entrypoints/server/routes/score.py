"""Scoring: vLLM's `/score` and `/v1/score` (1:1, 1:N, N:N) and Jina / Cohere `/rerank`, `/v1/rerank`, `/v2/rerank`."""

from __future__ import annotations

from typing import Any

import torch
from fastapi import APIRouter, Request
from fastapi.responses import Response

from ....chat import ChatError
from ....scoring import SideError, check_token_limits, cut_side, pair_composer, plan_scores
from .. import protocol as P
from .. import protocol_tei as T
from ..encoding import VectorJSONResponse
from ..errors import POST_ERRORS, APIError
from ..serving import ServerState, State, check_model, check_processor_kwargs, pooling_params, prompts_of, run_pooling
from . import tei

router = APIRouter()


Side = tuple[str, P.ScoreInput]
"""One side of a score request: (body field name, one text or a list)."""


async def score_pairs(
    state: ServerState, raw: Request, side_1: Side, side_2: Side, req: P.ScoreRequest | P.RerankRequest
) -> tuple[list[float], int]:
    """One score per (text_1, text_2) pair, by the model's kind (see scoring.py), and the tokens it took."""
    engine = state.engine
    (name_1, text_1), (name_2, text_2) = side_1, side_2
    # vLLM's per-side limits: each text cut to its first N content tokens before anything is added to it
    limits = {"max_tokens_per_query": req.max_tokens_per_query or 0, "max_tokens_per_doc": req.max_tokens_per_doc or 0}
    try:
        check_token_limits(limits, state.model_config.max_model_len)
    except SideError as exc:
        raise APIError(400, str(exc), list(limits)[exc.side]) from None
    text_1 = cut_side(text_1, limits["max_tokens_per_query"], engine.tokenizer._base)
    text_2 = cut_side(text_2, limits["max_tokens_per_doc"], engine.tokenizer._base)
    # vLLM renders a cross-encoder's pair through a chat template only when one is given: --chat-template, else
    # the one a sentence-transformers CrossEncoder's config declares (its `instruction` a variable of it, as the
    # Qwen3-Reranker template reads it)
    template, saved, special = state.score_template()
    for name in ("instruction", "chat_template_kwargs"):  # they would change scores in vLLM; dropped, they would not
        if getattr(req, name) is not None and template is None:
            raise APIError(400, f"'{name}' needs a reranker served with a --chat-template that uses it", name)
    # vLLM's: the request's chat_template_kwargs over the saved ones; `instruction` unless those name one
    variables = {**saved, **(req.chat_template_kwargs or {})}
    reserved = ("chat_template", "tools", "tokenize", "messages")  # vLLM refuses the first three; the last is ours
    if given := [name for name in reserved if name in variables]:
        raise APIError(400, f"chat_template_kwargs cannot set {', '.join(given)}", "chat_template_kwargs")
    if req.instruction is not None and "instruction" not in (req.chat_template_kwargs or {}):
        variables["instruction"] = req.instruction  # over a saved one: the request's
    try:
        # a rendered pair over max_model_len has its document cut, not the template's end (where truncation applies)
        fits = engine.engine_config.truncation == "auto" and req.truncate_prompt_tokens is None
        fit_to = (engine.tokenizer._base, state.model_config.max_model_len) if fits else None
        compose = pair_composer(
            state.model_config.hf_config, template, state.special_tokens(), variables, fit_to, special
        )
        plan = await state.async_engine.call(  # in a worker thread: a template renders each pair
            plan_scores,
            text_1,
            text_2,
            engine.supported_tasks,
            engine.is_cross_encoder,
            late_interaction=engine.scores_by_maxsim,
            names=(name_1, name_2),
            compose=compose,
        )
    except SideError as exc:  # an empty side, or lengths that do not pair (N:M)
        raise APIError(400, str(exc), (name_1, name_2)[exc.side]) from None
    except ChatError as exc:  # the template failed on a pair: most often a variable it needs was not sent
        raise APIError(400, str(exc), "chat_template_kwargs" if req.chat_template_kwargs else "instruction") from None
    except ValueError as exc:  # a model that cannot score
        raise APIError(400, str(exc)) from None
    for name, value in side_1, side_2:
        prompts_of(state, value, name)

    def item(side: Side, i: int) -> str:
        return f"'{side[0]}'" if isinstance(side[1], str) else f"'{side[0]}' item {i}"

    def locate(k: int) -> tuple[str, str]:
        """The body item(s) behind prompt k: both sides are one prompt list to the engine (or one pair each)."""
        where = plan.describe(k, lambda s, i: item((side_1, side_2)[s], i))
        return where, (name_1, name_2)[plan.origin(k)[-1][0]]

    # A score body's use_activation is the cross-encoder's sigmoid; embedding scores keep the model's default.
    params = pooling_params(req, use_activation=req.use_activation if plan.task == "classify" else None)
    per_prompt = plan.params(params)
    outputs = await run_pooling(
        state,
        raw,
        plan.prompts,
        per_prompt,
        plan.task,
        locate=locate,
        truncation_side=req.truncation_side,
        add_special_tokens=req.add_special_tokens and (special or plan.task != "classify"),
        padding=req.padding,
        priority=req.priority,
    )
    return plan.scores(outputs), sum(len(o.prompt_token_ids) for o in outputs)


async def _score(req: P.ScoreRequest, raw: Request, state: State) -> Response:
    model = check_model(state, req.model)
    check_processor_kwargs(state, req)
    try:
        side_1, side_2 = req.sides()
    except P.SidesError as exc:
        raise APIError(400, str(exc), exc.param) from None
    scores, tokens = await score_pairs(state, raw, side_1, side_2, req)
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    return VectorJSONResponse(P.envelope("score", model, data, tokens, req.request_id))


async def _rerank(req: P.RerankRequest, raw: Request, state: State) -> Response:
    model = check_model(state, req.model)
    check_processor_kwargs(state, req)
    prompts_of(state, req.documents, "documents")
    scores, tokens = await score_pairs(state, raw, ("query", req.query), ("documents", req.documents), req)
    if req.raw_scores is False and state.engine.is_cross_encoder:  # Infinity's sigmoid of the logit
        scores = torch.sigmoid(torch.tensor(scores, dtype=torch.float64)).tolist()  # saturates, as numpy's
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    if req.top_n:
        order = order[: req.top_n]
    results = []
    given = req._given_documents  # Cohere v1's objects read through rank_fields: returned as sent
    infinity = req.raw_scores is not None  # Infinity's body: documents only when asked for, as strings
    shown = (
        bool(req.return_documents and "return_documents" in req.model_fields_set)
        if infinity
        else (req.return_documents is not False)
    )
    for i in order:
        item: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if shown and infinity:
            item["document"] = req.documents[i]
        elif shown and i in req._content_parts:
            item["document"] = {"multi_modal": req._content_parts[i]}
        elif shown:
            item["document"] = (
                given[i] if given is not None and isinstance(given[i], dict) else {"text": req.documents[i]}
            )
        results.append(item)
    return VectorJSONResponse(
        {
            "id": P.random_id("score", req.request_id),  # vLLM serves rerank from its scoring handler
            "model": model,
            "results": results,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )


async def _rerank_or_tei(req: T.RerankBody, raw: Request, state: State) -> Response:
    """/rerank: Jina / Cohere / vLLM's body, or TEI's (`texts` and no `documents`; routes/tei.py answers it)."""
    if isinstance(req, T.TEIRerankRequest):
        return await tei.rerank(req, raw, state)
    return await _rerank(req, raw, state)


_SCORE: dict[int | str, dict[str, Any]] = {200: {"model": P.ScoreResponse}, **POST_ERRORS}
_RERANK: dict[int | str, dict[str, Any]] = {200: {"model": P.RerankResponse}, **POST_ERRORS}

# One handler per family under several paths; the names stay `_score` / `_rerank` so OpenAPI operation ids hold.
for _path in ("/score", "/v1/score"):
    router.post(_path, summary="vLLM score (1:1, 1:N, N:N)", responses=_SCORE)(_score)
# /rerank also takes TEI's body; its route keeps the name `_rerank` (and so its operation id).
router.add_api_route(
    "/rerank",
    _rerank_or_tei,
    methods=["POST"],
    name="_rerank",
    summary="Jina / Cohere / TEI rerank",
    responses=tei.shared_responses(_RERANK, T.TEIRerankResponse),
    route_class_override=tei.SharedRoute,
)
for _path in ("/v1/rerank", "/v2/rerank"):
    router.post(_path, summary="Jina / Cohere rerank", responses=_RERANK)(_rerank)
