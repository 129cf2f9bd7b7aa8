"""OpenAI `/v1/embeddings` and vLLM's `/pooling` (any task) and `/classify`."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from fastapi import APIRouter, Request
from fastapi.responses import Response

from .... import late_chunking
from ....late_chunking import LateChunkingParams
from .. import protocol as P
from ..encoding import VectorJSONResponse, float_array
from ..errors import POST_ERRORS, APIError
from ..serving import (
    ServerState,
    State,
    check_model,
    encoded_response,
    off_loop,
    pooling_params,
    request_prompts,
    run_pooling,
)

router = APIRouter()


def _encoded(model: type) -> dict[int | str, dict[str, Any]]:
    """encoding_format bytes / bytes_only answers raw bytes instead of the JSON body (see encoded_response)."""
    return {
        200: {
            "model": model,
            "description": "The JSON body, or with encoding_format bytes / bytes_only the raw vectors (bytes adds "
            "a `metadata` header)",
            "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
        },
        **POST_ERRORS,
    }


@router.post("/v1/embeddings", summary="OpenAI embeddings", responses=_encoded(P.EmbeddingResponse))
async def create_embeddings(req: P.EmbeddingRequest, raw: Request, state: State) -> Response:
    model = check_model(state, req.model)
    if req._cut is not None and raw.url.path != "/embeddings":  # Infinity's route only: here vLLM's dimensions
        if req._cut == 0:
            message = "invalid value for field 'dimensions': Input should be greater than or equal to 1"
            raise APIError(400, message, "dimensions")
        req.dimensions, req._cut = req._cut, None
    req._cut = req._cut or None  # Infinity's 0: the whole vector
    if req.late_chunking_params is not None:
        return await _late_chunked(req, raw, state, model)
    # A late-interaction model's embedding is its matrix of token vectors (with its shape and mode), and so is any
    # model's on a server whose pooling task is token_embed (vLLM serves its token-embed route here then).
    multi = state.engine.is_late_interaction or state.model_config.pooler_config.task == "token_embed"
    prompts, add_special_tokens, locate = await request_prompts(state, req)
    outputs = await run_pooling(
        state,
        raw,
        prompts,
        pooling_params(req),
        "token_embed" if multi else "embed",
        add_special_tokens=add_special_tokens,
        truncation_side=req.truncation_side,
        padding=req.padding,
        locate=locate,
        single=isinstance(req.input, str),
        priority=req.priority,
    )
    if req._cut is not None:  # Infinity's dimensions: the first values, in its range check
        width = outputs[0].outputs.data.shape[-1]
        if req._cut > width:
            raise APIError(
                400, f"dimensions={req._cut} is not in a valid range: select between 1 and {width}", "dimensions"
            )
        for o in outputs:
            o.outputs.data = o.outputs.data[..., : req._cut]
    return await off_loop(
        outputs, lambda: encoded_response(req, outputs, "embd", "embedding", "embedding", model, with_shape=multi)
    )


def _pipeline_scores(state: ServerState, output: Any) -> list[float]:
    """Infinity's classify scores: transformers' text-classification pipeline on the logits, whatever activation
    the model declares elsewhere: the logits of a regression, sigmoid for one label or multi-label, else softmax."""
    logits, config = output.outputs.data.double(), state.model_config.hf_config
    problem, labels = config.get("problem_type"), logits.shape[-1]
    if problem == "regression":
        return logits.tolist()
    if problem == "multi_label_classification" or labels == 1:
        return torch.sigmoid(logits).tolist()
    return torch.softmax(logits, dim=-1).tolist()


async def _late_chunked(req: P.EmbeddingRequest, raw: Request, state: State, model: str) -> Response:
    """vLLM 0.34's late chunking over HTTP: raw token vectors of each whole text, averaged per chunk."""
    field = "late_chunking_params"
    if req._cut is not None:
        raise APIError(400, "Infinity's dimensions does not apply to late chunking", "dimensions")
    if late_chunking.tokenization_changes({"padding": req.padding}):
        message = "Late chunking does not support input padding, truncation or renderer text normalization"
        raise APIError(400, message, "padding")
    if req.encoding_format != "float" or req.pool_factor is not None:
        raise APIError(400, "late chunking returns float chunk vectors of whole inputs", field)
    if "token_embed" not in state.engine.supported_tasks:
        raise APIError(400, "Late chunking requires token_embed, which this model does not serve", field)
    if req.messages is not None:
        raise APIError(400, "Late chunking requires plain-text input", "messages")
    prompts, add_special_tokens, _ = await request_prompts(state, req)
    chunking = LateChunkingParams(req.late_chunking_params.chunk_size)  # type: ignore[union-attr]
    given = pooling_params(req, late_chunking_params=chunking)
    for i, prompt in enumerate(prompts):  # the checks of offline late chunking, in the body's words
        try:
            late_chunking.check(
                given,
                "token_embed",
                prompt,
                recipe_edits_tokens=state.engine.recipe_edits_tokens,
                lower_case=state.model_config.do_lower_case,
            )
        except late_chunking.LateChunkingError as exc:
            raise APIError(400, (f"'input' item {i}: " if exc.field == "input" else "") + str(exc), exc.field) from None
    # the chunks' character spans need the tokenizer's offsets; tokenized off the event loop, as every input is
    base, limit = state.engine.tokenizer._base, state.model_config.max_model_len
    encodings = await state.async_engine.call(base.encode_batch, prompts, add_special_tokens=add_special_tokens)
    for i, enc in enumerate(encodings):
        if (detail := late_chunking.too_long(len(enc.ids), limit)) is not None:
            raise APIError(400, f"'input' item {i}{detail}", "input")
    try:  # the request's params resolved (a bad field is named by run_pooling below): no instruction prompt
        asked = state.engine.input_processor.verify_params(given, "token_embed")
    except ValueError:
        asked = None
    if asked is not None:
        try:
            for text in prompts:
                late_chunking.check_no_prompt(state.engine.input_processor, text, asked)
        except ValueError as exc:
            raise APIError(400, str(exc), "input_type") from None
    metas = []
    for i, enc in enumerate(encodings):
        special = [bool(m) for m in enc.special_tokens_mask]
        try:
            metas.append(late_chunking.metadata(len(enc.ids), list(enc.offsets), special, chunking.chunk_size))
        except ValueError as exc:
            raise APIError(400, f"'input' item {i}: {exc}", "input") from None
    outputs = await run_pooling(
        state,
        raw,
        prompts,
        given,
        "token_embed",
        add_special_tokens=add_special_tokens,
        truncation="error",
        single=isinstance(req.input, str),
        priority=req.priority,
    )
    data = []
    for i, (meta, out) in enumerate(zip(metas, outputs)):
        item = {"index": i, "object": "embedding", "embedding": float_array(out.outputs.data)}
        data.append(item | {"late_chunking": dataclasses.asdict(meta)})
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return VectorJSONResponse(P.envelope("embd", model, data, tokens, req.request_id))


# TEI serves the OpenAI route at /embeddings too
router.add_api_route(
    "/embeddings",
    create_embeddings,
    methods=["POST"],
    summary="OpenAI embeddings (TEI's path for /v1/embeddings)",
    responses=_encoded(P.EmbeddingResponse),
)


@router.post("/pooling", summary="vLLM pooling: any task", responses=_encoded(P.PoolingResponse))
async def create_pooling(req: P.PoolingRequest, raw: Request, state: State) -> Response:
    model = check_model(state, req.model)
    if req.late_chunking_params is not None:  # vLLM's /pooling has no such field; its embeddings route does
        message = "late chunking is served on /v1/embeddings (for any model with token_embed)"
        raise APIError(400, message, "late_chunking_params")
    task = req.task or state.engine.pooling_task  # vLLM: a request without a task gets the model's own
    multi = not isinstance(task, str)
    if multi or task == "embed_sparse":  # JSON objects per item: refused before any work
        if req.token_encoding is not None:
            raise APIError(400, "token_encoding applies to one token_embed task", "token_encoding")
        if req.encoding_format != "float":
            message = "embed_sparse and several tasks return JSON objects; encoding_format must be float"
            raise APIError(400, message, "encoding_format")
    prompts, add_special_tokens, locate = await request_prompts(state, req)
    outputs = await run_pooling(
        state,
        raw,
        prompts,
        pooling_params(req),
        task,
        add_special_tokens=add_special_tokens,
        truncation_side=req.truncation_side,
        padding=req.padding,
        locate=locate,
        task_param="task" if req.task is not None else None,
        single=isinstance(req.input, str),
        priority=req.priority,
    )
    if multi or task == "embed_sparse":
        tokenizer = state.engine.tokenizer

        def entry(name: str, v: Any) -> Any:
            if name != "embed_sparse":
                return float_array(v)
            ids = v.nonzero().squeeze(1)  # {"indices", "values"}: what Qdrant's sparse vectors take
            sparse: dict[str, Any] = {"indices": ids.tolist(), "values": float_array(v[ids])}
            if req.return_tokens:
                sparse["tokens"] = [tokenizer.id_to_token(t) or "" for t in sparse["indices"]]
            return sparse

        data = []
        for i, o in enumerate(outputs):
            d = o.outputs.data
            if multi:  # one entry per task, keyed by its name, all from one forward pass
                item = {"index": i, "object": "pooling", "data": {t: entry(t, v) for t, v in d.items()}}
                item["shape"] = {t: list(v.shape) for t, v in d.items()}
            else:
                item = {"index": i, "object": "pooling", "data": entry("embed_sparse", d), "shape": list(d.shape)}
            data.append(item)
        tokens = sum(len(o.prompt_token_ids) for o in outputs)
        return VectorJSONResponse(P.envelope("pooling", model, data, tokens, req.request_id))
    if req.token_encoding is not None:  # codes: rows of integers, with int8's scales
        if req.encoding_format != "float":
            raise APIError(400, "token_encoding returns JSON rows of codes; encoding_format must be float",
                           "encoding_format")  # fmt: skip
        data = []
        for i, o in enumerate(outputs):
            codes = o.outputs.codes
            item = {"index": i, "object": "pooling", "data": codes.codes.numpy(), "encoding": codes.encoding,
                    "shape": [codes.codes.shape[0], codes.dim]}  # fmt: skip
            if codes.scales is not None:
                item["scales"] = codes.scales.double().numpy()
            if o.input_type is not None:
                item["input_type"] = o.input_type
            data.append(item)
        tokens = sum(len(o.prompt_token_ids) for o in outputs)
        return VectorJSONResponse(P.envelope("pooling", model, data, tokens, req.request_id))
    return await off_loop(
        outputs, lambda: encoded_response(req, outputs, "pooling", "pooling", "data", model, with_shape=True)
    )


@router.post(
    "/classify",
    summary="vLLM classification",
    responses={200: {"model": P.ClassificationResponse | P.InfinityClassifyResponse}, **POST_ERRORS},
)
async def create_classify(req: P.ClassificationRequest, raw: Request, state: State) -> Response:
    model = check_model(state, req.model)
    prompts, add_special_tokens, locate = await request_prompts(state, req)
    infinity = req.raw_scores is not None  # Infinity's body: the logits, then its pipeline's activation below
    outputs = await run_pooling(
        state,
        raw,
        prompts,
        pooling_params(req, use_activation=False) if infinity else pooling_params(req),
        "classify",
        add_special_tokens=add_special_tokens,
        truncation_side=req.truncation_side,
        padding=req.padding,
        locate=locate,
        single=isinstance(req.input, str),
        priority=req.priority,
    )
    id2label = state.model_config.id2label
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    if infinity:  # its response: every label by score, highest first
        ranked = []
        for o in outputs:
            scores = _pipeline_scores(state, o)
            order = sorted(range(len(scores)), key=lambda j: -scores[j])
            ranked.append([{"score": scores[j], "label": id2label.get(j, str(j))} for j in order])
        return VectorJSONResponse(
            {**P.envelope("classify", model, ranked, tokens, req.request_id), "object": "classify"}
        )
    data = []
    for i, o in enumerate(outputs):
        probs = o.outputs.data
        label = int(probs.argmax())
        data.append(
            {
                "index": i,
                "label": id2label.get(label, str(label)),
                "probs": float_array(probs),
                "num_classes": int(probs.shape[-1]),
            }
        )
    return VectorJSONResponse(P.envelope("classify", model, data, tokens, req.request_id))
