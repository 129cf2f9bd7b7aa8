"""What the route modules share: the server's state and the steps every pooling request goes through.

`ServerState` (engine, AsyncEngine, ServerConfig, metrics, served names) is built once by `build_app` and kept
on `app.state.server`; handlers receive it through the `State` dependency. The functions below check the model
name and inputs, build PoolingParams from a body, run the request (aborting it if the client leaves) and
shape the embedding / pooling responses.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import torch
from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...chat import ChatError, find_template, load_template, render, text_messages
from ...config import ModelConfig
from ...engine.engine import Engine
from ...engine.input_processor import PromptError
from ...multimodal.image import is_remote
from ...muvera import MuveraParams
from ...pooling_params import PoolingParams, TaskError
from ...scoring import pair_template
from ...tokenizer import special_tokens_map
from . import protocol as P
from .async_engine import AsyncEngine
from .encoding import VectorJSONResponse, build_large, encode_bytes, encode_json
from .errors import APIError, shorten
from .metrics import TE_COUNTED, TE_STAGES, ServerMetrics

if TYPE_CHECKING:  # app.py imports the routes, which import this module
    from .app import ServerConfig

T = TypeVar("T")


@dataclass
class ServerState:
    """Everything the routes share; one per app."""

    engine: Engine
    async_engine: AsyncEngine
    config: ServerConfig
    metrics: ServerMetrics
    names: list[str]
    """Served model names; the first is the one responses report."""
    _chat_templates: dict[bool, str] = field(default_factory=dict, init=False, repr=False)

    @classmethod
    def create(cls, engine: Engine, config: ServerConfig) -> ServerState:
        async_engine = AsyncEngine(engine, warmup=config.warmup)
        names = config.served_model_names or [engine.model_config.model]
        metrics = ServerMetrics(
            lambda: async_engine.queue_depth,
            lambda: async_engine.num_pending,
            names[0],
            engine.model_config.max_model_len,  # TEI's input-length buckets stop at the longest input
        )
        async_engine.on_batch = metrics.on_batch
        async_engine.on_abort = metrics.aborted.inc
        return cls(engine, async_engine, config, metrics, names)

    @property
    def model_config(self) -> ModelConfig:
        return self.engine.model_config

    def chat_template(self, tools: bool = False) -> str | None:
        """--chat-template, else the checkpoint's own (read once): its "tool_use" template, where it names one,
        for a request with tools (as transformers picks it)."""
        if tools not in self._chat_templates:
            mc = self.model_config
            if self.config.chat_template is not None:
                self._chat_templates[tools] = load_template(self.config.chat_template)
            else:
                self._chat_templates[tools] = find_template(mc.path, mc.tokenizer_path.parent, tools=tools) or ""
        return self._chat_templates[tools] or None

    def score_template(self) -> tuple[str | None, dict[str, Any], bool]:
        """A cross-encoder's pair template, its variables and whether the pair gets special tokens (see
        scoring.pair_template); a 400 where the template a CrossEncoder's config names is missing."""
        given = self.chat_template() if self.config.chat_template is not None else None
        try:
            return pair_template(self.model_config, self.engine.is_cross_encoder, given)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None

    def special_tokens(self) -> dict[str, str]:
        """bos_token, eos_token, ... as the template sees them."""
        return special_tokens_map(self.model_config.tokenizer_path.parent)


async def json_body(raw: Request) -> Any:
    """The body of a route that picks its request shape itself, parsed as FastAPI parses every other route's (the
    standard library's decoder: a UTF-8 BOM, NaN and 1e400 read as they do there), its failures raised as FastAPI
    raises them, so that the same error handlers word them."""
    body = await raw.body()
    if not body:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    try:
        return json.loads(body)
    except json.JSONDecodeError as exc:
        error = {"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error", "input": {}}
        raise RequestValidationError([{**error, "ctx": {"error": exc.msg}}], body=exc.doc) from exc
    except Exception as exc:  # undecodable bytes, nesting too deep, too many digits
        raise StarletteHTTPException(400, "There was an error parsing the body") from exc


async def server_state(request: Request) -> ServerState:
    # async: FastAPI runs a plain-def dependency in its thread pool, a thread hop (queue put, wake-up, GIL
    # hand-off) per request for one attribute read
    return request.app.state.server


State = Annotated[ServerState, Depends(server_state)]


INFINITY_ANY_MODEL = "default/not-specified"
"""The model name Infinity's client sends when its user names none (Infinity then serves its one model)."""


def check_model(state: ServerState, name: str | None, exact: bool = False) -> str:
    """The model name responses report; 404 if the request names a model this server does not serve (`exact`:
    also Infinity's name for any model)."""
    if name is not None and name not in state.names and (exact or name != INFINITY_ANY_MODEL):
        raise APIError(404, f"the model '{shorten(name)}' does not exist; served: {', '.join(state.names)}", "model")
    return state.names[0]


def check_processor_kwargs(state: ServerState, req: Any) -> None:
    """A request's own mm_processor_kwargs: text models ignore them (vLLM's field); an image model's resize
    budget is the server's (--mm-processor-kwargs), which a request cannot change, so it is told so."""
    if state.model_config.colqwen2 is not None and getattr(req, "mm_processor_kwargs", None):
        message = "a request cannot change the image processor's settings; the server's --mm-processor-kwargs apply"
        raise APIError(400, message, "mm_processor_kwargs")


def prompts_of(state: ServerState, value: Any, field_name: str = "input") -> list:
    """A body's input as a list of prompts (texts or token-id lists), within the per-request limit."""
    limit = state.config.max_inputs_per_request
    prompts: list[Any]
    if isinstance(value, str):
        prompts = [value]
    elif value and all(isinstance(x, int) for x in value):
        prompts = [list(value)]
    else:
        prompts = list(value)
    if not prompts:
        raise APIError(400, f"'{field_name}' must not be empty", field_name)
    if len(prompts) > limit:
        raise APIError(400, f"'{field_name}' has {len(prompts)} items; the limit is {limit} per request", field_name)
    for i, p in enumerate(prompts):  # an empty string is valid (its special tokens are embedded)
        if isinstance(p, list) and not p:
            raise APIError(400, f"'{field_name}' item {i} is an empty list of token ids", field_name)
    return prompts


# The route chooses the task; every other PoolingParams field is copied from a body field of the same name.
_BODY_PARAMS = frozenset(f.name for f in dataclasses.fields(PoolingParams)) - {"task"}


def pooling_params(req: BaseModel, **renamed: Any) -> PoolingParams:
    """PoolingParams from a request body: each body field named like a PoolingParams field, then `renamed`
    (values the body spells differently, e.g. Cohere's output_dimension, or a field a route overrides)."""
    values = {name: getattr(req, name) for name in type(req).model_fields if name in _BODY_PARAMS}
    values = {k: v.model_dump() if isinstance(v, BaseModel) else v for k, v in values.items()}
    return PoolingParams(**{**values, **renamed})


CHAT_OPTIONS = frozenset({"chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message"})
"""A chat body's options for rendering its template."""


async def request_prompts(state: ServerState, req: Any) -> tuple[list, bool, Locate | None]:
    """A pooling body's prompts, add_special_tokens and how its errors name the prompt: its `input` items, or each
    of its conversations (`messages`: one, or on /v1/embeddings a list) rendered by the chat template as one text,
    which then gets no special tokens unless the body asks; for an image model each conversation's one image, with
    the model's own prompt."""
    check_processor_kwargs(state, req)
    if req.messages is None:
        prompts = prompts_of(state, req.input)
        if getattr(req, "modality", None) == "image":  # Infinity's: each input string is an image
            if state.model_config.colqwen2 is None:
                raise APIError(400, "modality 'image' needs an image model; this server embeds text", "modality")
            if not all(isinstance(p, str) for p in prompts):
                raise APIError(400, "modality 'image' takes image URLs as 'input' strings", "input")
            prompts = [image_url(p, f"'input' item {i}", "input") for i, p in enumerate(prompts)]
        return prompts, req.add_special_tokens, None
    conversations = req.conversations() if isinstance(req, P.EmbeddingRequest) else [req.messages]
    batched = conversations is req.messages  # a list of conversations, not one wrapped
    image_model = state.model_config.colqwen2 is not None
    if image_model:
        chat = sorted(CHAT_OPTIONS & req.model_fields_set)
        if chat:  # not dropped silently: these shape a rendered template, and image models render none
            message = "this model encodes an image with its own prompt, not a chat template"
            raise APIError(400, f"{', '.join(chat)}: {message}", chat[0])
    prompts, places = [], []
    for c, messages in enumerate(conversations):
        try:
            if image_model:
                image, where = image_of_messages(messages)
                prompts.append(image)
            else:
                # in a worker thread, as vLLM renders: a template is code, which may take its time
                prompts.append(await state.async_engine.call(render_messages, state, req, messages))
                where = "the rendered messages"
        except APIError as exc:
            if batched:  # which conversation, before what is wrong in it
                exc.message = f"'messages' conversation {c}: {exc.message}"
            raise
        places.append(f"'messages' conversation {c} ({where})" if batched else where)
    special = req.add_special_tokens if image_model else chat_special_tokens(req)
    return prompts, special, lambda i: (places[i], "messages")


def image_url(url: Any, where: str, param: str) -> str | dict[str, Any]:
    """An image_url part's URL: a base64 data: URL, or an http(s) URL that the engine fetches if the server
    allows its host (--allowed-media-domains; refused with 400 otherwise)."""
    value = url.get("url") if isinstance(url, dict) else getattr(url, "url", url)
    if is_remote(value):  # the scheme in any case, as load_image and vLLM
        return {"multi_modal_data": {"image": value}}
    if not isinstance(value, str) or value[:11].lower() != "data:image/":
        raise APIError(
            400,
            f"{where}: images must be base64 data: URLs (data:image/png;base64,...) or http(s) URLs on a host the "
            "server allows (--allowed-media-domains)",
            param,
        )
    return value


def image_of_messages(messages: list[Any]) -> tuple[str | dict[str, Any], str]:
    """A ColQwen2-style model encodes one image with its own prompt: the messages must hold exactly one image
    part and no text (a query is sent as text `input` with input_type query). The image, and where it is."""
    found = []
    for i, message in enumerate(messages):
        content = message.content
        parts = content if isinstance(content, list) else ([] if content in (None, "") else [{"type": "text"}])
        for j, part in enumerate(parts):
            where = f"messages item {i} content part {j}"
            if part.get("type") != "image_url":
                message = "this model encodes an image with its own prompt; send text as 'input' (input_type query)"
                raise APIError(400, f"{where}: {message}, images alone in messages", "messages")
            found.append((image_url(part.get("image_url"), where, "messages"), where))
    if len(found) != 1:
        raise APIError(400, f"messages hold {len(found)} images; send one image per request item", "messages")
    return found[0]


def chat_special_tokens(req: Any) -> bool:
    """A chat body's add_special_tokens: false unless it says (the template writes them), as in vLLM."""
    return req.add_special_tokens if "add_special_tokens" in req.model_fields_set else False


def render_messages(state: ServerState, req: Any, conversation: list[Any] | None = None) -> str:
    """A chat-style body's conversation (its `messages`, or the one given) as the chat template writes it (400
    naming what is wrong)."""
    messages = [m.model_dump(exclude_unset=True) for m in (req.messages if conversation is None else conversation)]
    for i, message in enumerate(messages):  # as for `input`: JSON can escape a lone surrogate, UTF-8 cannot
        try:
            json.dumps(message, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, f"messages item {i} is not valid UTF-8 text (lone surrogate)", "messages") from None
    try:
        text_messages(messages)  # an image part is named before anything else is said
    except ChatError as exc:
        raise APIError(400, str(exc), "messages") from None
    given = dict(req.chat_template_kwargs or {})
    for name, why in (
        ("chat_template", "a template by another name, refused as vLLM does"),
        ("messages", "the conversation"),
    ):
        if name in given:
            raise APIError(400, f"chat_template_kwargs cannot set {name} ({why})", "chat_template_kwargs")
    for name in ("add_generation_prompt", "continue_final_message"):  # the request's own fields win, as in vLLM
        given.pop(name, None)
    if req.chat_template is not None and not state.config.trust_request_chat_template:
        raise APIError(
            400,
            "a request's own chat_template needs the server flag --trust-request-chat-template",
            "chat_template",
        )
    template_kwargs = given
    if (tools := getattr(req, "tools", None)) is not None:  # /tokenize's field, as chat completions have it
        template_kwargs["tools"] = tools
    template = req.chat_template or state.chat_template(tools=bool(tools))
    if template is None:
        raise APIError(
            400, "this model has no chat template; start the server with --chat-template to embed messages", "messages"
        )
    try:
        return render(
            template,
            messages,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            special_tokens=state.special_tokens(),
            content_format_option=state.config.chat_template_content_format,
            variables=template_kwargs,
        )
    except ChatError as exc:
        raise APIError(400, str(exc), "messages") from None


Locate = Callable[[int], tuple[str, str]]
"""Prompt index → (how messages name it, the request field), for routes whose prompts are not one field's items."""


def check_limits(state: ServerState, requests: list, field: str = "input", locate: Locate | None = None) -> None:
    """413 before anything is queued when the tokenized request is over --max-windows-per-input (one
    long_input="window" input split into too many windows) or --max-tokens-per-request (all its inputs)."""
    config = state.config
    most_windows = config.max_windows_per_input
    if most_windows > 0:
        for i, r in enumerate(requests):
            if r.windows and len(r.windows) > most_windows:
                where, param = locate(i) if locate is not None else (f"'{field}' item {i}", field)
                raise APIError(
                    413,
                    f"{where} has {r.num_tokens} tokens, split into {len(r.windows)} windows of "
                    f"{state.model_config.max_model_len} tokens; the limit is {most_windows} windows per input "
                    "(--max-windows-per-input)",
                    param,
                )
    most_tokens = config.max_tokens_per_request
    if most_tokens > 0:
        total = sum(r.num_tokens for r in requests)
        if total > most_tokens:
            raise APIError(
                413,
                f"the request's inputs have {total} tokens after tokenization and truncation; the limit is "
                f"{most_tokens} tokens per request (--max-tokens-per-request)",
                None if locate is not None else field,
            )
        # MUVERA's size does not shrink with the input: held to the token vectors the token limit allows
        most_numbers = most_tokens * state.model_config.token_dim
        numbers = sum(r.params.muvera.output_dim() for r in requests if isinstance(r.params.muvera, MuveraParams))
        if numbers > most_numbers:
            raise APIError(
                413,
                f"the request asks for {numbers} MUVERA numbers ({len(requests)} inputs); the limit is "
                f"{most_numbers}, as many as the token vectors of {most_tokens} tokens (--max-tokens-per-request)",
                "muvera",
            )


def check_ids_sent(state: ServerState, prompts: list, param: str | None) -> None:
    """413 for token ids numbering more than --max-tokens-per-request as sent, before truncation (a large body's
    are counted before it is parsed, ServerMiddleware._check_items: the same limit, whatever the body's size)."""
    most = state.config.max_tokens_per_request
    if most <= 0:
        return
    sent = 0
    for p in prompts:
        ids = p.get("prompt_token_ids") if isinstance(p, dict) else p
        if isinstance(ids, list) and ids and type(ids[0]) is int:
            sent += len(ids)
    if sent > most:
        raise APIError(
            413,
            f"the request carries {sent} token ids; the limit is {most} per request (--max-tokens-per-request, "
            "counted before truncation for token ids)",
            param,
        )


_PARAM = re.compile(r"^(?:Unsupported )?([a-z_]+)\b")  # "input_type=...", or vLLM's "Unsupported input_type ..."


def _param_of(message: str) -> str | None:
    """The request field a parameter check's message is about: PoolingParams' checks start with its name."""
    match = _PARAM.match(message)
    name = match.group(1) if match else None
    return name if name in _BODY_PARAMS else None


def count_request(state: ServerState, raw: Request, single: bool) -> str:
    """Count a pooling request in TEI's te_request_count once (a TEI route counts it before its own checks, as
    TEI does); returns its method label."""
    method = raw.scope.get(TE_COUNTED)
    if method is None:
        method = raw.scope[TE_COUNTED] = "single" if single else "batch"
        state.metrics.te_count.labels(method).inc()
    return method


async def run_pooling(
    state: ServerState,
    raw: Request,
    prompts: list,
    params: PoolingParams | list[PoolingParams],
    task: str | Sequence[str],
    *,
    field: str = "input",
    locate: Locate | None = None,
    task_param: str | None = None,
    names: dict[str, str] | None = None,
    too_long_hint: str | None = None,
    single: bool = False,
    priority: int | None = 0,
    **kwargs: Any,
) -> list:
    """Run one request's prompts (the items of body field `field`) through the engine; a rejected parameter or
    input is a 400 that names the field and item (`task_param`: the body field that chose the task, if any).
    `single`: the body gave one input, not a list (TEI's metrics tell them apart). `priority`: the body's, for
    the priority scheduling policy (null: 0)."""
    start = time.perf_counter()
    method = count_request(state, raw, single)
    check_ids_sent(state, prompts, field if locate is None else None)
    began = time.monotonic()
    # a client that leaves while its inputs wait for (or are in) tokenization is let go at once; its tokenization
    # is not started if it has not begun
    requests = await until_disconnect(
        raw,
        process_prompts(
            state,
            prompts,
            params,
            task,
            field=field,
            locate=locate,
            task_param=task_param,
            names=names,
            too_long_hint=too_long_hint,
            **kwargs,
        ),
    )
    check_limits(state, requests, field, locate)
    for r in requests:
        r.priority = priority or 0
        for w in r.windows or ():
            w.priority = r.priority
    kind = "predict" if {r.params.task for r in requests} <= {"classify", "score"} else "embed"
    state.metrics.te_inputs[kind].count.inc(len(requests))
    queued = time.monotonic()
    outputs = await until_disconnect(raw, state.async_engine.run(requests))
    done = time.monotonic()
    # TEI's stages, per input then averaged over the request's inputs: tokenization, the wait for a step, the steps
    taken = [r.scheduled_time or done for r in requests]  # one no step ran (an inference-free query): all waiting
    per_input = [(t - queued, done - t) for t in taken]
    stages = (queued - began, sum(q for q, _ in per_input) / len(taken), sum(i for _, i in per_input) / len(taken))
    raw.scope[TE_STAGES] = stages
    state.metrics.on_request(
        [len(o.prompt_token_ids) for o in outputs], time.perf_counter() - start, method, stages, kind, per_input
    )
    return outputs


async def process_prompts(
    state: ServerState,
    prompts: list,
    params: PoolingParams | list[PoolingParams] | None,
    task: str | Sequence[str],
    *,
    field: str = "input",
    locate: Locate | None = None,
    task_param: str | None = None,
    names: dict[str, str] | None = None,
    too_long_hint: str | None = None,
    **kwargs: Any,
) -> list:
    """Tokenize and check a request's prompts (the engine's Requests); a 400 naming the field and item (`names`:
    the body's names of PoolingParams fields it spells differently, e.g. Cohere's output_dimension;
    `too_long_hint`: what the route's own body offers against an over-long input, in place of the engine's list)."""
    windows, window = state.config.max_windows_per_input, state.model_config.max_model_len
    bound = windows * window if windows > 0 else None  # more tokens than this: over the window limit, surely
    try:
        return await state.async_engine.process(prompts, params, task, max_window_tokens=bound, **kwargs)
    except PromptError as exc:  # named by its position in `prompts`: say which field's item it is
        where, param = locate(exc.index) if locate is not None else (f"'{field}' item {exc.index}", field)
        if exc.over_windows:
            raise APIError(
                413,
                f"{where} has at least {exc.num_tokens} tokens, more than {windows} windows of {window} tokens hold; "
                f"the limit is {windows} windows per input (--max-windows-per-input)",
                param,
            ) from None
        detail = exc.detail
        if exc.advice and too_long_hint is not None:
            detail = f"{detail.removesuffix(exc.advice)}; {too_long_hint}"
        error = APIError(400, where + detail, param)
        if exc.num_tokens is not None and exc.max_len is not None:
            error.too_long = (exc.num_tokens, exc.max_len, where)
        raise error from None
    except TaskError as exc:  # a task the body chose names its field; one the route chose, none
        raise APIError(400, str(exc), task_param) from None
    except (ValueError, TypeError) as exc:
        message, about = str(exc), _param_of(str(exc))
        if about is not None and names and about in names:  # the check's words, with the body's name
            message, about = names[about] + message[len(about) :], names[about]
        raise APIError(400, message, about) from None


_OFF_LOOP_NUMBERS = 1 << 18
"""Outputs of more numbers than this are encoded in a worker thread (a large body held the event loop)."""


async def off_loop(outputs: list, build: Callable[[], Response]) -> Response:
    """`build()` (a response encoding `outputs`) off the event loop when the outputs are large; small ones are
    encoded in place (a thread hop costs more than they do)."""
    numbers = sum(o.outputs.data.numel() for o in outputs if isinstance(o.outputs.data, torch.Tensor))
    if numbers <= _OFF_LOOP_NUMBERS:
        return build()
    return await asyncio.get_running_loop().run_in_executor(None, build_large, build)


def encoded_response(
    req: P.EmbeddingRequest, outputs: list, prefix: str, obj: str, key: str, model: str, with_shape: bool
) -> Response:
    """The `/v1/embeddings` and `/pooling` response in the body's encoding_format (JSON or raw bytes)."""
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    tensors = [o.outputs.data for o in outputs]
    if req.encoding_format in ("bytes", "bytes_only"):
        body, items = encode_bytes(tensors, req.embed_dtype, req.endianness)
        headers = None
        if req.encoding_format == "bytes":
            meta = P.envelope(prefix, model, items, tokens, req.request_id)
            headers = {"metadata": json.dumps({k: meta[k] for k in ("id", "created", "model", "data", "usage")})}
        return Response(body, media_type="application/octet-stream", headers=headers)
    data = []
    for i, t in enumerate(tensors):
        item = {"index": i, "object": obj, key: encode_json(t, req.encoding_format, req.embed_dtype, req.endianness)}
        if with_shape:
            item["shape"] = list(t.shape)
        if outputs[i].input_type is not None:
            item["input_type"] = outputs[i].input_type
        data.append(item)
    return VectorJSONResponse(P.envelope(prefix, model, data, tokens, req.request_id))


async def until_disconnect(raw: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts its queued requests) if the client disconnects first.

    Once the body has been read, the next ASGI `receive()` only returns when the client disconnects, so one
    waiting call per request watches for it without polling.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(raw))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    raise APIError(499, "client disconnected")


async def _disconnected(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass
