"""Cohere embed: `/v2/embed` and `/v1/embed`, for text (`texts`, or v2 `inputs` of text parts), with every
embedding type (float, int8, uint8, binary, ubinary, base64: see `encode_by_type`) and truncate END, START or
NONE. Images (the `images` field, image_url parts of `inputs`, as base64 data: URLs) are embedded by image models
(ColQwen2) and refused with a 400 by text models, never dropped.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from .. import protocol as P
from ..encoding import VectorJSONResponse, encode_by_type
from ..errors import POST_ERRORS, APIError
from ..serving import State, check_model, image_url, pooling_params, prompts_of, run_pooling

router = APIRouter()

_NO_IMAGES = "images are not supported yet; this server embeds text"


@router.post("/v2/embed", summary="Cohere embed v2", responses={200: {"model": P.CohereEmbedResponse}, **POST_ERRORS})
async def cohere_embed(req: P.CohereEmbedRequest, raw: Request, state: State) -> Response:
    return await _embed(req, raw, state, "2")


@router.post(
    "/v1/embed",
    summary="Cohere embed v1",
    responses={200: {"model": P.CohereEmbedFloatsResponse | P.CohereEmbedResponse}, **POST_ERRORS},
)
async def cohere_embed_v1(req: P.CohereEmbedV1Request, raw: Request, state: State) -> Response:
    return await _embed(req, raw, state, "1")


async def _embed(req: P.CohereEmbedV1Request, raw: Request, state: State, version: str) -> Response:
    check_model(state, req.model)
    field, texts, is_image = _texts(req, state.model_config.colqwen2 is not None)
    images = state.model_config.colqwen2 is not None
    if req.input_type == "image" and not images:
        raise APIError(400, f"input_type 'image' is for images; {_NO_IMAGES}", "input_type")
    v2 = req if isinstance(req, P.CohereEmbedRequest) else None
    max_tokens = v2.max_tokens if v2 else None
    limit = state.model_config.max_model_len
    if max_tokens is not None and max_tokens > limit:
        raise APIError(400, f"max_tokens={max_tokens} is more than the model's max_model_len ({limit})", "max_tokens")
    kinds = list(dict.fromkeys(req.embedding_types or ["float"]))
    multi = state.engine.is_late_interaction
    if multi and version == "1":  # its response schema has one vector per text: Cohere's v1 client fails on matrices
        raise APIError(400, "a late-interaction model's token matrices are served on /v2/embed (or /pooling), not v1",
                       field)  # fmt: skip
    if multi and set(kinds) - {"float", "base64"}:
        raise APIError(400, "a late-interaction model returns float or base64 token matrices only", "embedding_types")
    # END and START always cut (to max_tokens, else the model's maximum), whatever the server's --long-input.
    cut = None if req.truncate == "NONE" else (max_tokens or -1)
    params = pooling_params(req, dimensions=v2.output_dimension if v2 else None, truncate_prompt_tokens=cut)
    if req.input_type == "image":  # an image model's documents
        params.input_type = "search_document"
    # START keeps the last tokens, END the first, whatever side the tokenizer's config names (Cohere's meaning)
    side: dict[str, Any] = {"truncation_side": "left" if req.truncate == "START" else "right"}
    outputs = await run_pooling(
        state,
        raw,
        prompts_of(state, texts, field),
        params,
        "token_embed" if multi else "embed",
        field=field,
        truncation="error" if req.truncate == "NONE" else "auto",
        names={"dimensions": "output_dimension"},
        too_long_hint="shorten it, or send truncate END or START to cut it",
        **side,
        priority=v2.priority if v2 else 0,
    )
    if req.truncate == "NONE" and max_tokens is not None:  # checked after the run, as vLLM does
        for i, o in enumerate(outputs):
            if len(o.prompt_token_ids) > max_tokens:
                raise APIError(
                    400,
                    f"'{field}' item {i} has {len(o.prompt_token_ids)} tokens, more than max_tokens={max_tokens}; "
                    "truncate='NONE' rejects it (END or START would cut it)",
                    "max_tokens",
                )
    tensors = [o.outputs.data for o in outputs]
    body: dict[str, Any]
    if version == "1" and req.embedding_types is None:
        body = {"response_type": "embeddings_floats", "id": P.random_id("embd")}
        body["embeddings"] = encode_by_type(tensors, ["float"])["float"]
    else:
        try:
            embeddings = encode_by_type(tensors, kinds)
        except ValueError as exc:  # binary / ubinary of a dimension not divisible by 8
            raise APIError(400, str(exc), "embedding_types") from None
        body = {"response_type": "embeddings_by_type", "id": P.random_id("embd"), "embeddings": embeddings}
    if field == "texts":
        body["texts"] = texts
    if multi:
        # one input_type per item (`inputs` may mix text queries and image documents); the single field when all agree
        types = [o.input_type for o in outputs]
        body |= {"shapes": [list(t.shape) for t in tensors], "input_types": types}
        if len(set(types)) == 1:
            body["input_type"] = types[0]
    # vLLM's: a request with images bills all its tokens as image_tokens, one without as input_tokens
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    billed = (
        {"input_tokens": 0, "image_tokens": tokens} if any(is_image) else {"input_tokens": tokens, "image_tokens": 0}
    )
    body["meta"] = {"api_version": {"version": version}, "billed_units": billed}
    return VectorJSONResponse(body)


def _texts(req: P.CohereEmbedV1Request, images: bool = False) -> tuple[str, list[Any], list[bool]]:
    """The texts to embed, the field they come from, and which are images: `texts`, `images` (data: URLs, for an
    image model), or v2 `inputs` (each item's text parts joined with a newline, as vLLM joins text parts; for an
    image model an item of one image part is that image); other images are refused."""
    inputs = req.inputs if isinstance(req, P.CohereEmbedRequest) else None
    if req.images is not None:
        if not images:
            raise APIError(400, f"'images': {_NO_IMAGES} (send 'texts')", "images")
        if req.texts is not None or inputs is not None:
            raise APIError(400, "give one of 'texts', 'images' and 'inputs'", "images")
        if not req.images:
            raise APIError(400, "'images' must not be empty", "images")
        return (
            "images",
            [image_url(u, f"'images' item {i}", "images") for i, u in enumerate(req.images)],
            [True] * len(req.images),
        )
    if req.texts is not None:
        if inputs is not None:
            raise APIError(400, "give one of 'texts' and 'inputs', not both", "inputs")
        return "texts", req.texts, [False] * len(req.texts)
    if inputs is None:
        needed = "one of 'texts' and 'inputs' is" if isinstance(req, P.CohereEmbedRequest) else "field 'texts' is"
        raise APIError(400, f"{needed} required", "texts")
    texts: list[Any] = []
    is_image: list[bool] = []
    for i, item in enumerate(inputs):
        parts = []
        image: Any = None
        for j, part in enumerate(item.content):
            where = f"'inputs' item {i} content {j}"
            if isinstance(part, P.CohereImage):
                if not images:
                    raise APIError(400, f"{where} is an image_url part; {_NO_IMAGES}", "inputs")
                if len(item.content) != 1:
                    raise APIError(400, f"'inputs' item {i}: an image is encoded alone (one image part, no text)",
                                   "inputs")  # fmt: skip
                image = image_url(part.image_url, where, "inputs")
                continue
            try:
                part.text.encode("utf-8")
            except UnicodeEncodeError:
                raise APIError(400, f"{where} is not valid UTF-8 text (lone surrogate)", "inputs") from None
            parts.append(part.text)
        texts.append(image if image is not None else "\n".join(parts))
        is_image.append(image is not None)
    return "inputs", texts, is_image
