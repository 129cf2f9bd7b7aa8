"""Hugging Face text-embeddings-inference (TEI): `/embed`, `/embed_all`, `/predict`, `/similarity`, `/decode`, `/info`,
and TEI's bodies of `/rerank` and `/tokenize`, so that a TEI client switches by base URL.

`/rerank` and `/tokenize` are shared with vLLM's bodies: routes/score.py and routes/utility.py take either
(protocol_tei.RerankBody, TokenizeBody) and hand TEI's to `rerank` and `tokenize` here. Bodies, defaults and
responses follow TEI (protocol_tei.py). Failures answer TEI's `{"error", "error_type"}` with its statuses: Validation
and Tokenizer 422, Empty 400, Backend 424 (the model cannot do what the route asks); refusals made before routing
(API key, body size and time, overload: ServerMiddleware) keep polyvec's error body.

TEI's `truncate` and `truncation_direction` are the engine's truncation and truncation side for the request
(null `truncate`: the server's --truncation). The engine applies a model prompt by input_type only, so inputs with
a `prompt_name` are prompted and tokenized here and reach the engine as token ids. Scores follow TEI: /predict is the
softmax (sigmoid for one label) of the logits, /rerank the sigmoid of a cross-encoder's logit; an embedding model
ranks by cosine and a late-interaction one by MaxSim, as polyvec's own /rerank does (TEI refuses both).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .... import __version__
from ....chat import ChatError
from ....engine.engine import Engine
from ....pooling_params import PoolingParams
from ....scoring import TemplateTooLong, pair_composer, plan_scores
from ....tokenizer import PolyTokenizer
from .. import protocol_tei as T
from ..encoding import VectorJSONResponse, float_array
from ..errors import APIError, ErrorResponse, error_responses, shorten, validation_message
from ..metrics import TE_ERR, TE_STAGES
from ..serving import ServerState, State, count_request, json_body, off_loop, run_pooling

# ---------------------------------------------------------------------------------------------- errors

_STATUS = {"Unhealthy": 503, "Backend": 424, "Overloaded": 429, "Validation": 422, "Tokenizer": 422, "Empty": 400}
# te_request_failure's err label, as TEI's infer.rs and server.rs count each kind (424: a task the model lacks)
_ERR = {"Unhealthy": "inference", "Backend": "model_type", "Overloaded": "overloaded", "Validation": "validation",
        "Tokenizer": "tokenization", "Empty": "validation"}  # fmt: skip


class _TEIJSON(JSONResponse):
    """ASCII-escaped, so that a message quoting a client's lone surrogate still encodes."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


class TEIError(Exception):
    """A refusal in TEI's terms: `{"error": message, "error_type": kind}` with the kind's status (or `status`)."""

    def __init__(self, kind: T.TEIErrorType, message: str, status: int | None = None, err: str | None = None):
        super().__init__(message)
        self.kind, self.message, self.status = kind, message, status or _STATUS[kind]
        self.err = err or _ERR[kind]
        """TEI's te_request_failure label for it."""

    def response(self, request: Request | None = None) -> Response:
        if request is not None:
            request.scope[TE_ERR] = self.err
        return _TEIJSON({"error": self.message, "error_type": self.kind}, status_code=self.status)


def invalid(message: str) -> TEIError:
    """TEI's validation error (its core's wording: "Input validation error: ...")."""
    return TEIError("Validation", f"Input validation error: {message}")


def _empty_input(name: str = "inputs", where: str | None = None) -> TEIError:
    """TEI's words for an empty input; `where` names the item of a batch (TEI names none)."""
    return TEIError("Empty", f"Input validation error: `{name}` cannot be empty" + (f" ({where})" if where else ""))


def _single(inputs: Any) -> bool:
    """One input, as TEI's `Input::Single`: a text or one list of token ids."""
    return isinstance(inputs, str) or (
        isinstance(inputs, list)
        and bool(inputs)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in inputs)
    )


def _first_empty(prompts: list) -> int | None:
    return next((i for i, p in enumerate(prompts) if not p), None)


def _not_embedding() -> TEIError:
    return TEIError("Backend", "Backend error: Model is not an embedding model")


def _from_api_error(exc: APIError) -> TEIError:
    """polyvec's refusal (serving helpers, engine) in TEI's terms: an over-long input in TEI's words, anything else
    (a token id outside the vocabulary, an image over its pixel budget, ...) a validation error; a request over a
    per-request limit (tokens, windows) keeps its 413, as on every route, in TEI's body."""
    if exc.too_long is not None:
        given, most, where = exc.too_long  # TEI's words, and which item (TEI names none); TEI's tokenizer says it
        message = f"Input validation error: `inputs` must have less than {most} tokens. Given: {given} ({where})"
        return TEIError("Validation", message, err="tokenization")
    if exc.status == 413:
        return TEIError("Validation", f"Input validation error: {exc.message}", 413, err="batch_size")
    if exc.status == 503:
        return TEIError("Unhealthy", exc.message)
    return invalid(exc.message)


@contextmanager
def _as_tei() -> Iterator[None]:
    """APIError from the shared serving helpers as TEIError (for TEI bodies on the shared routes)."""
    try:
        yield
    except APIError as exc:
        if exc.status == 499:  # the client left: nobody reads the body
            raise
        raise _from_api_error(exc) from None


_TAGS = (T.TEI_TAG, T.POLYVEC_TAG)


def _untagged(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Errors without the union tag a shared route's body puts after "body" in their location."""
    out = []
    for e in errors:
        loc = tuple(e.get("loc", ()))
        if len(loc) > 1 and loc[1] in _TAGS:
            e = {**e, "loc": loc[:1] + loc[2:]}
        out.append(e)
    return out


def _body_error(exc: RequestValidationError) -> TEIError:
    """A body that failed validation: 400 when it is empty or no JSON, else 422 (as TEI's JSON extractor)."""
    message, _ = validation_message(exc)
    first = (exc.errors() or [{}])[0]
    if first.get("type") == "json_invalid":
        return TEIError("Validation", message, 400)
    if first.get("type") == "missing" and tuple(first.get("loc", ())) == ("body",):  # an empty body
        return TEIError("Validation", "the request body is empty; send a JSON object", 400)
    return TEIError("Validation", message)


def _unparsable(exc: StarletteHTTPException) -> TEIError:
    """FastAPI's 400 for a body json.loads failed on (undecodable bytes, too deep, too many digits)."""
    cause = exc.__cause__
    if isinstance(cause, RecursionError):
        return TEIError("Validation", "the request body is nested too deeply", 400)
    if isinstance(cause, ValueError) and "integer string conversion" in str(cause):
        return TEIError("Validation", "the request body has a number with too many digits", 400)
    return TEIError("Validation", "the request body is not valid JSON (it must be UTF-8 encoded JSON)", 400)


class TEIRoute(APIRoute):
    """A TEI route: its failures answer TEI's error body."""

    tei_by_default = True
    """Body errors not tagged by a shared body's union (unparsable or empty bodies) are TEI's."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        tei_by_default = self.tei_by_default

        async def tei_handler(request: Request) -> Response:
            try:
                return await handler(request)
            except TEIError as exc:
                return exc.response(request)
            except RequestValidationError as exc:
                errors = exc.errors()
                tag = errors[0].get("loc", (None, None))[1:2] if errors else ()
                untagged = RequestValidationError(_untagged(list(errors)), body=exc.body)
                if tag == (T.TEI_TAG,) or (tei_by_default and tag != (T.POLYVEC_TAG,)):
                    return _body_error(untagged).response()
                raise untagged from None  # polyvec's body: app.py's handler answers it
            except StarletteHTTPException as exc:
                if not tei_by_default or exc.status_code != 400:
                    raise
                return _unparsable(exc).response()
            except APIError as exc:
                if not tei_by_default or exc.status == 499:
                    raise
                return _from_api_error(exc).response(request)

        return tei_handler


class SharedRoute(TEIRoute):
    """A path that takes polyvec's body or TEI's (`RerankBody`, `TokenizeBody`): errors of TEI's body are TEI's,
    all others polyvec's (the TEI handlers raise TEIError themselves)."""

    tei_by_default = False


router = APIRouter(route_class=TEIRoute)

# ---------------------------------------------------------------------------------------------- OpenAPI

_TEI_DESCRIPTIONS = {
    400: "Empty input (error_type Empty), or a body that is not a JSON object",
    422: "Invalid input (error_type Validation): a wrong field, an unknown prompt_name, an over-long input with "
    "truncate false, too many inputs (--max-inputs-per-request) or tokens (--max-tokens-per-request)",
    424: "The model cannot do this (error_type Backend), e.g. /predict on an embedding model",
    503: "The engine stopped on an internal error (error_type Unhealthy): the server needs a restart",
}


def tei_error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for TEI's error statuses, each with the `TEIErrorResponse` schema."""
    return {s: {"model": T.TEIErrorResponse, "description": _TEI_DESCRIPTIONS[s]} for s in statuses}


# Before routing, ServerMiddleware answers 401, 408, 413, 429 and 500 with polyvec's error body.
_MIDDLEWARE_ERRORS = error_responses(401, 408, 413, 429, 500)


def _responses(model: type, backend: bool = True) -> dict[int | str, dict[str, Any]]:
    codes = (400, 422, 424, 503) if backend else (400, 422, 503)
    return {200: {"model": model}, **tei_error_responses(*codes), **_MIDDLEWARE_ERRORS}


def shared_responses(
    polyvec: dict[int | str, dict[str, Any]], tei_model: type, backend: bool = True
) -> dict[int | str, dict[str, Any]]:
    """A shared route's responses: polyvec's and TEI's 200, 400 (and 503) bodies, TEI's 422 (and 424)."""
    both = {s: f"{polyvec[s]['description']} (TEI's body: {_TEI_DESCRIPTIONS[s]})" for s in (400, 503) if s in polyvec}
    return {
        **polyvec,
        200: {"model": polyvec[200]["model"] | tei_model},
        **{s: {"model": ErrorResponse | T.TEIErrorResponse, "description": d} for s, d in both.items()},
        **tei_error_responses(*((422, 424) if backend else (422,))),
    }


# ---------------------------------------------------------------------------------------------- inputs


def _check_batch(state: ServerState, n: int, name: str) -> None:
    """TEI's batch checks: not empty, at most max_client_batch_size (--max-inputs-per-request) items."""
    if n == 0:
        raise TEIError("Empty", f"`{name}` cannot be empty")
    most = state.config.max_inputs_per_request
    if n > most:
        raise TEIError("Validation", f"batch size {n} > maximum allowed batch size {most}", err="batch_size")


def _embed_inputs(state: ServerState, inputs: str | list) -> list:
    """TEI's `Input` as prompts: one string or token-id list, or a batch of them."""
    if isinstance(inputs, str) or all(isinstance(x, int) for x in inputs):  # [] is one empty id list, as in TEI
        prompts = [inputs]
    else:
        prompts = list(inputs)
        _check_batch(state, len(prompts), "inputs")
        empty = _first_empty(prompts)
        if empty is not None:
            raise _empty_input(where=f"'inputs' item {empty}")
    if not all(prompts):
        raise _empty_input()
    return prompts


def _chars(prompts: list) -> int:
    """TEI's x-compute-characters: characters of texts, ids of token-id inputs."""
    return sum(sum(map(len, p)) if isinstance(p, tuple) else len(p) for p in prompts)


def prompt_named(prompts: dict[str, str], name: str) -> str:
    """The text of the model's prompt `name`; ValueError in TEI's words if the model has no such prompt."""
    quoted = shorten(name)
    if not prompts:
        raise ValueError(
            f"`default-prompt-name` is set to `{quoted}` but no prompts were found in the Sentence Transformers "
            "configuration"
        )
    if name not in prompts:
        available = "[" + ", ".join(json.dumps(k) for k in prompts) + "]"
        raise ValueError(
            f"`default-prompt-name` is set to `{quoted}` but it was not found in the Sentence Transformers prompts. "
            f"Available prompts: {available}"
        )
    return prompts[name]


def set_default_prompt(model_config: Any, name: str | None, text: str | None) -> tuple[str | None, str | None]:
    """TEI's `--default-prompt-name` (one of the model's prompts) or `--default-prompt` (a text): what text inputs
    that name no prompt get, in place of the model's own default (ValueError for an unknown name, or both; nothing
    changes then). Returns the model's (default_prompt_name, default_prompt) before, to put back."""
    before = model_config.default_prompt_name, model_config.default_prompt
    if name is not None and text is not None:
        raise ValueError("--default-prompt-name and --default-prompt cannot be used together (as in TEI)")
    if name is not None:
        prompt_named(model_config.prompts, name)
        model_config.default_prompt_name, model_config.default_prompt = name, None
    elif text is not None:
        model_config.default_prompt = text
    return before


def _prompt_text(state: ServerState, name: str | None) -> str | None:
    """The text of the prompt `prompt_name` names (None when not given), refused in TEI's words if the model has
    no such prompt."""
    if name is None:
        return None
    try:
        return prompt_named(state.model_config.prompts, name)
    except ValueError as exc:
        raise invalid(str(exc)) from None


def _default_prompt(state: ServerState) -> str:
    """The prompt the engine puts before text inputs by default (InputProcessor._with_prompt)."""
    mc = state.model_config
    if mc.default_prompt is not None:
        return mc.default_prompt
    if not mc.prompts or not mc.default_prompt_name:
        return ""
    return mc.prompts.get(mc.default_prompt_name, "")


def _truncation(truncate: bool | None, direction: str) -> tuple[dict[str, Any], str | None]:
    """TEI's `truncate` and `truncation_direction` for the engine: run_pooling's `truncation` and
    `truncation_side`, and PoolingParams.long_input (null `truncate`: the server's --truncation)."""
    # TEI cuts where the request says (Right by default), whatever side the tokenizer's config names
    kwargs: dict[str, Any] = {"truncation_side": "left" if direction in ("Left", "left") else "right"}
    if truncate is None:
        return kwargs, None
    # true cuts even where the server splits long input into windows; false refuses it unless the server does
    return {**kwargs, "truncation": "auto" if truncate else "error"}, "truncate" if truncate else None


def _with_long_input(params: PoolingParams | list[PoolingParams], long_input: str | None) -> Any:
    if long_input is None:
        return params
    if isinstance(params, PoolingParams):
        return dataclasses.replace(params, long_input=long_input)
    copies: dict[int, PoolingParams] = {}  # one copy per distinct object: the engine verifies each once
    return [copies.setdefault(id(p), dataclasses.replace(p, long_input=long_input)) for p in params]


def _decoded(engine: Engine, prompts: list) -> list:
    """Token-id inputs as their text (special tokens left out, as TEI decodes them to put a prompt before them)."""
    tokenizer = engine.tokenizer
    vocab = tokenizer.vocab_size
    out = list(prompts)
    for i, p in enumerate(prompts):
        if isinstance(p, list):
            if any(t >= vocab for t in p):
                raise invalid(f"`inputs` item {i} has token ids outside the vocabulary (size {vocab})")
            out[i] = tokenizer.decode(p, skip_special_tokens=True, clean_up_tokenization_spaces=False)  # TEI's
    return out


def _prompted(engine: Engine, prompts: list, prompt: str, ids_only: bool = False) -> list:
    """Prompts with the text of `prompt_name` before each text, as token ids (the engine knows prompts by
    input_type only, and would put the model's default prompt before a text); a token-id input is decoded and
    prompted too, as in TEI. `ids_only`: only token-id inputs (texts get the default prompt from the engine)."""
    texts = _decoded(engine, prompts)
    at = [i for i, p in enumerate(prompts) if isinstance(p, list) or not ids_only]
    out = list(prompts)
    encoded = engine.tokenizer.encode_prompts([prompt + texts[i] for i in at], 1 << 62, truncate=False) if at else []
    for i, enc in zip(at, encoded):
        out[i] = enc.input_ids
    return out


def _with_input_type(params: PoolingParams | list[PoolingParams], name: str) -> Any:
    if isinstance(params, PoolingParams):
        return dataclasses.replace(params, input_type=name)
    copies: dict[int, PoolingParams] = {}
    return [copies.setdefault(id(p), dataclasses.replace(p, input_type=name)) for p in params]


_PROMPTED_TASKS = ("embed", "token_embed", "embed_sparse")
"""The tasks of TEI's routes that take a prompt_name (its embed routes and /similarity)."""


async def _run(
    state: ServerState,
    raw: Request,
    prompts: list,
    params: PoolingParams | list[PoolingParams],
    task: str,
    options: T.TruncationOptions,
    *,
    prompt_name: str | None = None,
    field: str = "inputs",
    locate: Callable[[int], tuple[str, str]] | None = None,
    single: bool = False,
    add_special_tokens: bool = True,
) -> list:
    """`run_pooling` with TEI's truncate, truncation_direction and prompt_name (`single`: one input, not a list)."""
    kwargs, long_input = _truncation(options.truncate, options.truncation_direction)
    prompt = _prompt_text(state, prompt_name)
    mc = state.model_config
    # a model that pools without its prompt (include_prompt false) gets texts and the prompt's name: the engine
    # puts the prompt before them and leaves its tokens out (prompted token ids would be pooled whole)
    as_texts = not mc.pool_prompt and mc.colbert is None
    call = state.async_engine.call
    if prompt is not None and as_texts:
        prompts, params = await call(_decoded, state.engine, prompts), _with_input_type(params, prompt_name or "")
    elif prompt is not None:
        prompts = await call(_prompted, state.engine, prompts, prompt)
    elif task in _PROMPTED_TASKS and any(isinstance(p, list) for p in prompts) and (default := _default_prompt(state)):
        # token ids get the default prompt too, as in TEI (the engine puts it before texts only)
        prompts = await (call(_decoded, state.engine, prompts) if as_texts else call(_prompted, state.engine, prompts,
                                                                                   default, True))  # fmt: skip
    params = _with_long_input(params, long_input)
    return await run_pooling(
        state, raw, prompts, params, task, field=field, locate=locate, single=single,
        add_special_tokens=add_special_tokens, **kwargs,
    )  # fmt: skip


def _headers(state: ServerState, raw: Request, start: float, outputs: list, chars: int) -> dict[str, str]:
    """TEI's x-compute-* headers and its stages' times (milliseconds; a batch's, the mean over its inputs)."""
    ms = str(int((time.perf_counter() - start) * 1000))
    tokenization, queue, inference = raw.scope.get(TE_STAGES, (0.0, 0.0, 0.0))
    return {
        "x-compute-type": "gpu" if state.engine.device.type == "cuda" else "cpu",
        "x-compute-time": ms,
        "x-compute-characters": str(chars),
        "x-compute-tokens": str(sum(len(o.prompt_token_ids) for o in outputs)),
        "x-total-time": ms,
        "x-tokenization-time": str(int(tokenization * 1000)),
        "x-queue-time": str(int(queue * 1000)),
        "x-inference-time": str(int(inference * 1000)),
    }


# ---------------------------------------------------------------------------------------------- embeddings


def _dimensions(state: ServerState, dimensions: int | None, full: int | None = None) -> int | None:
    """TEI's `dimensions`, checked as TEI does; None when the whole vector is asked for."""
    if dimensions is None:
        return None
    if dimensions == 0:
        raise invalid("`dimensions` should be positive")
    mc = state.model_config
    full = full or mc.pooler_config.dimensions or mc.truncate_dim or mc.embed_dim
    if dimensions > full:
        raise invalid("`dimensions` should be smaller than the maximum embedding dimension.")
    return None if dimensions == full else dimensions


@router.post("/embed", summary="TEI embed", responses=_responses(T.TEIEmbedResponse))
async def embed(req: T.TEIEmbedRequest, raw: Request, state: State) -> Response:
    """One vector per input, `[[float, ...], ...]`; `dimensions` keeps the first values of the vector (for any
    model, as TEI), then `normalize` L2-normalizes it."""
    start = time.perf_counter()
    count_request(state, raw, single=_single(req.inputs))
    tasks = state.engine.supported_tasks
    splade = "embed" not in tasks and "embed_sparse" in tasks
    if splade and req.normalize:
        raise TEIError("Backend", "Backend error: `normalize` is not available for SPLADE models")
    if "embed" not in tasks and not splade:
        raise _not_embedding()
    prompts = _embed_inputs(state, req.inputs)
    dims = _dimensions(state, req.dimensions, state.engine.output_width("embed_sparse") if splade else None)
    params = PoolingParams(use_activation=req.normalize and dims is None)  # with dimensions: normalized below
    # SPLADE (normalize false): its pooled vector over the vocabulary, dense, as TEI returns it
    task = "embed_sparse" if splade else "embed"
    single = _single(req.inputs)
    outputs = await _run(
        state,
        raw,
        prompts,
        PoolingParams() if splade else params,
        task,
        req,
        prompt_name=req.prompt_name,
        single=single,
    )
    vectors = []
    for o in outputs:
        v = o.outputs.data
        if dims is not None:
            v = v[:dims].double()
            v = F.normalize(v, dim=-1) if req.normalize else v
        vectors.append(float_array(v))
    return VectorJSONResponse(vectors, headers=_headers(state, raw, start, outputs, _chars(prompts)))


@router.post("/embed_all", summary="TEI embed_all: token vectors", responses=_responses(T.TEIEmbedAllResponse))
async def embed_all(req: T.TEIEmbedAllRequest, raw: Request, state: State) -> Response:
    """Per input, one vector per token, `[[[float, ...], ...], ...]`: the model's token states, not normalized
    (a late-interaction model's normalized token vectors, bge-m3's its ColBERT vectors)."""
    start = time.perf_counter()
    count_request(state, raw, single=_single(req.inputs))
    if "token_embed" not in state.engine.supported_tasks:
        raise _not_embedding()
    prompts = _embed_inputs(state, req.inputs)
    # TEI returns raw token states; a ColBERT model's vectors are normalized as the model was trained, and so
    # are bge-m3's, its token_embed output (projected, without [CLS]: un-normalized they were neither form)
    multi_vector = state.engine.is_late_interaction or state.model_config.bge_m3 is not None
    params = PoolingParams(use_activation=None if multi_vector else False)
    single = _single(req.inputs)
    outputs = await _run(state, raw, prompts, params, "token_embed", req, prompt_name=req.prompt_name, single=single)
    headers = _headers(state, raw, start, outputs, _chars(prompts))
    return await off_loop(
        outputs, lambda: VectorJSONResponse([float_array(o.outputs.data) for o in outputs], headers=headers)
    )


@router.post("/embed_sparse", summary="TEI embed_sparse: SPLADE", responses=_responses(T.TEIEmbedSparseResponse))
async def embed_sparse(req: T.TEIEmbedSparseRequest, raw: Request, state: State) -> Response:
    """Per input, its non-zero weights `[[{"index", "value"}, ...], ...]` by ascending vocabulary id."""
    start = time.perf_counter()
    count_request(state, raw, single=_single(req.inputs))
    if "embed_sparse" not in state.engine.supported_tasks:
        raise TEIError("Backend", "Backend error: Model is not an embedding model with SPLADE pooling")
    prompts = _embed_inputs(state, req.inputs)
    single = _single(req.inputs)
    outputs = await _run(
        state, raw, prompts, PoolingParams(), "embed_sparse", req, prompt_name=req.prompt_name, single=single
    )
    body = []
    for o in outputs:
        v = o.outputs.data
        ids = v.nonzero().squeeze(1)
        body.append([{"index": i, "value": x} for i, x in zip(ids.tolist(), v[ids].tolist())])
    return VectorJSONResponse(body, headers=_headers(state, raw, start, outputs, _chars(prompts)))


@router.post("/similarity", summary="TEI sentence similarity", responses=_responses(T.TEISimilarityResponse))
async def similarity(req: T.TEISimilarityRequest, raw: Request, state: State) -> Response:
    """The cosine similarity of each of `inputs.sentences` with `inputs.source_sentence`, `[float, ...]`."""
    start = time.perf_counter()
    tasks = state.engine.supported_tasks
    # SPLADE: TEI embeds with normalize false, the pooled vector over the vocabulary (cosine normalizes it)
    task = "embed" if "embed" in tasks else "embed_sparse" if "embed_sparse" in tasks else None
    if task is None:
        raise _not_embedding()
    source, sentences = req.inputs.source_sentence, req.inputs.sentences
    if not sentences:
        raise TEIError("Empty", "`inputs.sentences` cannot be empty")
    _check_batch(state, len(sentences) + 1, "inputs.sentences")
    count_request(state, raw, single=False)  # as TEI: its embed call counts the request, after those checks
    prompts = [source, *sentences]
    empty = _first_empty(prompts)
    if empty is not None:
        raise _empty_input("inputs.source_sentence") if empty == 0 else _empty_input(*_sentence(empty)[::-1])
    options = req.parameters or T.TEISimilarityParameters()
    outputs = await _run(
        state, raw, prompts, PoolingParams(), task, options, prompt_name=options.prompt_name, locate=_sentence
    )
    vectors = torch.stack([o.outputs.data for o in outputs]).float()
    scores = F.cosine_similarity(vectors[:1], vectors[1:], dim=-1)
    return VectorJSONResponse(float_array(scores), headers=_headers(state, raw, start, outputs, _chars(prompts)))


def _sentence(i: int) -> tuple[str, str]:
    """Prompt i of /similarity (the source sentence first) as its body names it."""
    if i == 0:
        return "'inputs.source_sentence'", "inputs.source_sentence"
    return f"'inputs.sentences' item {i - 1}", "inputs.sentences"


# ---------------------------------------------------------------------------------------------- classification


def _predict_inputs(state: ServerState, inputs: str | list) -> tuple[bool, list[str | tuple[str, str]]]:
    """TEI's `PredictInput`: (whether it is one input, its texts and text pairs)."""
    items: list[Any]
    if _one_prediction(inputs):
        single, items = True, [inputs]
    else:
        single, items = False, list(inputs)
        _check_batch(state, len(items), "inputs")
    prompts: list[str | tuple[str, str]] = [
        x if isinstance(x, str) else x[0] if len(x) == 1 else (x[0], x[1]) for x in items
    ]
    if any(p == "" or p == ("", "") for p in prompts):
        raise _empty_input()
    return single, prompts


def _one_prediction(inputs: str | list) -> bool:
    """TEI's `PredictInput::Single`: one text, or one pair (a list of texts), not a list of those."""
    return isinstance(inputs, str) or (bool(inputs) and isinstance(inputs[0], str))


def _predictions(logits: torch.Tensor, id2label: dict[int, str], raw_scores: bool) -> list[dict[str, Any]]:
    """Each label's score, best first: the logits, or TEI's softmax of them (sigmoid for a single one)."""
    logits = logits.float()
    if raw_scores:
        scores = logits
    else:
        scores = torch.sigmoid(logits) if logits.numel() == 1 else torch.softmax(logits, dim=-1)
    if torch.isnan(scores).any():
        raise TEIError("Backend", "score is NaN", err="inference")
    values = scores.tolist()
    order = sorted(range(len(values)), key=lambda i: -values[i])
    return [{"score": values[i], "label": id2label.get(i, f"LABEL_{i}")} for i in order]


@router.post("/predict", summary="TEI predict: classification", responses=_responses(T.TEIPredictResponse))
async def predict(req: T.TEIPredictRequest, raw: Request, state: State) -> Response:
    """Per input (a text or a text pair), each label's score, best first: `[{"score", "label"}, ...]`, or a list of
    those for a batch."""
    start = time.perf_counter()
    count_request(state, raw, single=_one_prediction(req.inputs))
    if "classify" not in state.engine.supported_tasks:
        raise TEIError("Backend", "Backend error: Model is not a classifier model")
    single, prompts = _predict_inputs(state, req.inputs)
    params = PoolingParams(use_activation=False)  # TEI's activation is applied to the logits below
    outputs = await _run(state, raw, prompts, params, "classify", req, single=single)
    id2label = state.model_config.id2label
    results = [_predictions(o.outputs.data, id2label, req.raw_scores) for o in outputs]
    body = results[0] if single else results
    return JSONResponse(body, headers=_headers(state, raw, start, outputs, _chars(prompts)))


async def rerank(req: T.TEIRerankRequest, raw: Request, state: ServerState) -> Response:
    """TEI's /rerank body (routes/score.py hands it here): `[{"index", "text"?, "score"}]`, best first. A
    cross-encoder scores each (query, text) pair, as TEI's reranker does; an embedding model scores by cosine and
    a late-interaction one by MaxSim."""
    with _as_tei():
        start = time.perf_counter()
        if not req.texts:  # TEI's failure before it counts the request
            raise TEIError("Empty", "`texts` cannot be empty")
        count_request(state, raw, single=False)
        _check_batch(state, len(req.texts), "texts")
        engine = state.engine
        try:
            template, saved, special = state.score_template()
            # as /score: a rendered pair over max_model_len has its text cut, not the template's end
            cuts = req.truncate if req.truncate is not None else engine.engine_config.truncation == "auto"
            fit_to = (engine.tokenizer._base, state.model_config.max_model_len) if cuts else None
            compose = pair_composer(
                state.model_config.hf_config, template, state.special_tokens(), saved, fit_to, special
            )
            plan = await state.async_engine.call(  # in a worker thread: a template renders each pair
                plan_scores,
                req.query,
                req.texts,
                engine.supported_tasks,
                engine.is_cross_encoder,
                late_interaction=engine.scores_by_maxsim,
                compose=compose,
            )
        except ChatError as exc:  # the --chat-template failed on a pair (a ValueError too: named first)
            raise TEIError("Validation", f"Input validation error: {exc}") from None
        except TemplateTooLong as exc:
            raise TEIError("Validation", f"Input validation error: {exc}") from None
        except ValueError:
            raise TEIError("Backend", "Backend error: model is not a re-ranker model") from None
        cross = plan.task == "classify"
        for k, text in enumerate(req.texts):  # TEI's Empty for an empty pair, as /predict; /embed's for one text
            if text == "" and (req.query == "" or not cross):
                raise _empty_input("texts", f"'texts' item {k}")
        if req.query == "" and not cross:
            raise _empty_input("query")

        def locate(k: int) -> tuple[str, str]:
            if cross:
                return f"the pair of 'query' and 'texts' item {k}", "texts"
            return ("'query'", "query") if k == 0 else (f"'texts' item {k - 1}", "texts")

        base = PoolingParams(use_activation=False) if cross else PoolingParams()  # a cross-encoder's logit
        outputs = await _run(
            state, raw, plan.prompts, plan.params(base), plan.task, req, field="texts", locate=locate,
            add_special_tokens=special or not cross,
        )  # fmt: skip
        scores = torch.tensor(plan.scores(outputs), dtype=torch.float32)
        if cross and not req.raw_scores:
            scores = torch.sigmoid(scores)
        if torch.isnan(scores).any():
            raise TEIError("Backend", "score is NaN", err="inference")
        values = scores.tolist()
        ranks: list[dict[str, Any]] = []
        for i in sorted(range(len(values)), key=lambda i: -values[i]):
            rank: dict[str, Any] = {"index": i}
            if req.return_text:
                rank["text"] = req.texts[i]
            rank["score"] = values[i]
            ranks.append(rank)
        chars = len(req.query) * len(req.texts) + sum(map(len, req.texts))
        return JSONResponse(ranks, headers=_headers(state, raw, start, outputs, chars))


# ---------------------------------------------------------------------------------------------- tokenizer


def _tokens_json(tokenizer: PolyTokenizer, texts: list[str], add_special_tokens: bool, most: int = 0) -> bytes:
    """TEI's tokens of each text as JSON: id, text, special, and the byte offsets of the text (null for special
    tokens, whose text is the token itself); `most` > 0: the most tokens of all texts together."""
    encoded = [t.lower() for t in texts] if tokenizer.do_lower_case else texts
    parts = []
    # `tokenizers` releases the GIL in encode_batch, not in encode; its offsets count characters
    batch = tokenizer._base.encode_batch(encoded, add_special_tokens=add_special_tokens)
    total = sum(len(enc.ids) for enc in batch)
    if 0 < most < total:
        message = f"the inputs have {total} tokens; the limit is {most} per request (--max-tokens-per-request)"
        raise APIError(413, message, "inputs")
    for text, lowered, enc in zip(texts, encoded, batch):
        source = text if len(text) == len(lowered) else lowered  # offsets of lowered text, on the original's letters
        byte_at = None if source.isascii() else list(itertools.accumulate((len(c.encode()) for c in source), initial=0))
        tokens = []
        for tid, (s, e), special, token in zip(enc.ids, enc.offsets, enc.special_tokens_mask, enc.tokens):
            if special:
                tokens.append(f'{{"id":{tid},"text":{json.dumps(token)},"special":true,"start":null,"stop":null}}')
                continue
            start, stop = (s, e) if byte_at is None else (byte_at[s], byte_at[e])
            tokens.append(
                f'{{"id":{tid},"text":{json.dumps(source[s:e])},"special":false,"start":{start},"stop":{stop}}}'
            )
        parts.append("[" + ",".join(tokens) + "]")
    return ("[" + ",".join(parts) + "]").encode("ascii")


async def tokenize(req: T.TEITokenizeRequest, state: ServerState) -> Response:
    """TEI's /tokenize body (routes/utility.py hands it here): per input, its tokens `[[{"id", "text", "special",
    "start", "stop"}, ...], ...]`, with the prompt (prompt_name, else the model's default) before the text."""
    with _as_tei():
        texts = [req.inputs] if isinstance(req.inputs, str) else list(req.inputs)
        if not isinstance(req.inputs, str):
            _check_batch(state, len(texts), "inputs")
        if not all(texts):
            raise _empty_input()
        prompt = _prompt_text(state, req.prompt_name)
        prefix = _default_prompt(state) if prompt is None else prompt
        body = await state.async_engine.call(
            _tokens_json,
            state.engine.tokenizer,
            [prefix + t for t in texts],
            req.add_special_tokens,
            state.config.max_tokens_per_request,
        )
        return Response(body, media_type="application/json")


@router.post("/decode", summary="TEI decode", responses=_responses(T.TEIDecodeResponse, backend=False))
async def decode(req: T.TEIDecodeRequest, state: State) -> Response:
    """The text of each token-id list, `["text", ...]`."""
    ids: list = req.ids
    batch = bool(ids) and isinstance(ids[0], list)
    lists: list[list[int]] = list(ids) if batch else [ids]
    if batch:
        _check_batch(state, len(lists), "ids")
    if not all(lists):
        raise _empty_input("input_ids")
    tokenizer = state.engine.tokenizer
    vocab = tokenizer.vocab_size
    bad = next(((i, j, t) for i, ids_ in enumerate(lists) for j, t in enumerate(ids_) if t >= vocab), None)
    if bad is not None:
        i, j, t = bad
        where = f"`ids` item {i} position {j}" if batch else f"`ids` item {j}"
        raise invalid(f"{where} is {t}, outside the vocabulary (size {vocab})")
    # `tokenizers` releases the GIL in decode_batch, not in decode
    texts = await state.async_engine.call(
        tokenizer._base.decode_batch, lists, skip_special_tokens=req.skip_special_tokens
    )
    return JSONResponse(texts)


# ---------------------------------------------------------------------------------------------- info

_POOLING_NAMES = {"CLS": "cls", "MEAN": "mean", "LAST": "last_token"}


def _model_type(state: ServerState) -> dict[str, Any]:
    """TEI's ModelType: a classifier, a reranker (a one-label classifier) or an embedding model and its pooling."""
    engine, mc = state.engine, state.model_config
    tasks = engine.supported_tasks
    # TEI has no token classifier: a NER model's labels say more than an "embedding" pooling would
    if "classify" in tasks or ("token_classify" in tasks and "embed" not in tasks and "embed_sparse" not in tasks):
        id2label = {str(i): mc.id2label.get(i, f"LABEL_{i}") for i in range(max(mc.num_labels, 1))}
        classes = {"id2label": id2label, "label2id": {label: int(i) for i, label in id2label.items()}}
        return {"reranker" if engine.is_cross_encoder else "classifier": classes}
    if "embed" not in tasks and "embed_sparse" in tasks:
        return {"embedding": {"pooling": "splade"}}  # as TEI names a SPLADE model's pooling
    pooling = engine.default_pooling("embed")
    return {"embedding": {"pooling": "+".join(_POOLING_NAMES.get(p, p.lower()) for p in pooling)}}


@router.get(
    "/info",
    summary="TEI model info",
    response_model=None,
    responses={200: {"model": T.TEIInfo}, **error_responses(401, 500)},
)
async def info(state: State) -> dict[str, Any]:
    """TEI's Info, from this server's configuration: max_input_length is max_model_len, max_batch_tokens and
    max_batch_requests the engine's batch limits, max_client_batch_size --max-inputs-per-request, auto_truncate
    whether --truncation is auto."""
    mc, engine_config, config = state.model_config, state.engine.engine_config, state.config
    return {
        "model_id": mc.model,
        "model_sha": None,
        "model_dtype": str(mc.dtype).removeprefix("torch."),
        "served_model_name": state.names[0],
        "model_type": _model_type(state),
        "max_concurrent_requests": config.max_concurrent_requests,
        "max_input_length": mc.max_model_len,
        "max_batch_tokens": engine_config.max_num_batched_tokens,
        "max_batch_requests": engine_config.max_num_seqs,
        "max_client_batch_size": config.max_inputs_per_request,
        "auto_truncate": engine_config.truncation == "auto",
        "tokenization_workers": state.async_engine._pool._max_workers,
        "version": __version__,
        "sha": None,
        "docker_label": None,
    }


# ---------------------------------------------------------------------------------------------- POST /


@router.post(
    "/",
    summary="TEI: the model's own route (what huggingface_hub's InferenceClient calls)",
    response_class=Response,
    responses={
        200: {
            "model": T.TEIEmbedResponse
            | T.TEIEmbedSparseResponse
            | T.TEIPredictResponse
            | T.TEIRerankResponse
            | T.TEISimilarityResponse
        },
        **tei_error_responses(400, 422, 424, 503),
        **_MIDDLEWARE_ERRORS,
    },
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"type": "object"}}},
            "description": "The body of /embed, /embed_sparse, /predict or /rerank, by the model's kind (an "
            "embedding model also takes /similarity's)",
        }
    },
)
async def model_route(raw: Request, state: State) -> Response:
    """As TEI binds `/`: a classifier answers /predict, a reranker (one-label classifier) /rerank, a SPLADE model
    /embed_sparse, an embedding model /embed."""
    tasks = state.engine.supported_tasks
    kind: tuple[type[BaseModel], Callable[..., Coroutine[Any, Any, Response]]] | None
    if "classify" in tasks:
        kind = (T.TEIRerankRequest, rerank) if state.engine.is_cross_encoder else (T.TEIPredictRequest, predict)
    elif "embed" in tasks:
        kind = (T.TEIEmbedRequest, embed)
    elif "embed_sparse" in tasks:
        kind = (T.TEIEmbedSparseRequest, embed_sparse)
    else:
        kind = None
    body = await json_body(raw)  # its failures worded as /embed's (TEIRoute)
    if kind is None:  # a body TEI would refuse is refused as such first (400 / 422, not 424)
        try:
            T.TEIEmbedRequest.model_validate(body)
        except ValidationError as exc:
            raise RequestValidationError(exc.errors()) from None
        raise TEIError("Backend", "Backend error: this model has no route of TEI's")
    if kind[1] is embed and isinstance(body, dict) and isinstance(body.get("inputs"), dict):
        # huggingface_hub's InferenceClient.sentence_similarity posts /similarity's body to the base URL
        kind = (T.TEISimilarityRequest, similarity)
    model, handler = kind
    try:
        req = model.model_validate(body)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None
    return await handler(req, raw, state)


async def invoke_model_route(raw: Request, state: State) -> Response:
    """POST /'s answer from another path (SageMaker's /invocations with TEI's body), failures in TEI's body."""
    try:
        return await model_route(raw, state)
    except TEIError as exc:
        return exc.response(raw)
    except RequestValidationError as exc:
        return _body_error(RequestValidationError(_untagged(list(exc.errors())), body=exc.body)).response()
