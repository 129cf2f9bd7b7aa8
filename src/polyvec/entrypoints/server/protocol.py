"""Request and response bodies, with the field names of OpenAI, vLLM, Jina/Cohere rerank and Cohere embed v2.

Field docstrings are the OpenAPI documentation. Unknown fields are rejected (400, naming the field) rather than
silently ignored, so a typo never changes results; vLLM's scheduling-only fields are accepted and ignored.
Input fields (texts and token ids) are checked strictly: booleans are not token ids, lists must not be empty,
and a lone surrogate is not text; each refusal names the field and the item index.
"""

from __future__ import annotations

import json
import time
import uuid
from contextvars import ContextVar
from typing import Annotated, Any, Literal, NoReturn

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    StrictInt,
    Tag,
    ValidationError,
    ValidationInfo,
    WrapValidator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from .errors import INPUT_ERROR, json_type

_SHAPES = {
    "prompts": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "text_or_texts": "a string or a list of strings",
    "texts": "a list of strings",
    "text": "a string",
    "ids": "a list of token ids",
}


def _refuse(message: str, field: str) -> NoReturn:
    raise PydanticCustomError(INPUT_ERROR, "{message}", {"message": message, "param": field})


def _cache_salt(value: str) -> str:
    if not value or len(value) > 128 or any(c in "@/\\\x00" for c in value):
        _refuse("'cache_salt' must be 1 to 128 characters, none of '@', '/', '\\' or NUL", "cache_salt")
    return value


def _request_id(value: str) -> str:
    """The response's id carries it: it must encode as UTF-8 (JSON can escape a lone surrogate)."""
    _check_utf8(value, "request_id", "text")
    return value


def _check_token(value: Any, where: str, field: str) -> None:
    if isinstance(value, bool):
        _refuse(f"{where} is a boolean, not a token id (a non-negative integer)", field)
    if not isinstance(value, int):
        what = "a number with a fraction or exponent" if isinstance(value, float) else json_type(value)
        _refuse(f"{where} is {what}, not a token id (a non-negative integer)", field)
    if value < 0:
        _refuse(f"{where} is negative, out of vocabulary; token ids are non-negative integers", field)


def _diagnose(value: Any, field: str, kind: str) -> None:
    """Refuse `value` with a message naming the field and the first item at fault (it failed validation)."""
    name, shape = f"'{field}'", _SHAPES[kind]
    if kind == "text" or (isinstance(value, str) and kind != "texts"):
        _refuse(f"{name} must be {shape}, not {json_type(value)}", field)
    if not isinstance(value, list):
        _refuse(f"{name} must be {shape}, not {json_type(value)}", field)
    if not value and kind != "ids":
        _refuse(f"{name} must not be empty", field)
    first = value[0] if value else None
    if kind == "ids" or (kind == "prompts" and isinstance(first, int | float)):  # bool is an int
        for i, t in enumerate(value):
            _check_token(t, f"{name} item {i}", field)
    elif kind == "prompts" and isinstance(first, list):
        for i, ids in enumerate(value):
            if not isinstance(ids, list):
                _refuse(
                    f"{name} item {i} is {json_type(ids)}, but item 0 is a list of token ids ({name} is {shape})", field
                )
            if not ids:
                _refuse(f"{name} item {i} is an empty list of token ids", field)
            for j, t in enumerate(ids):
                _check_token(t, f"{name} item {i} position {j}", field)
    else:
        for i, t in enumerate(value):
            if not isinstance(t, str):
                _refuse(f"{name} item {i} is {json_type(t)}, not a string ({name} is {shape})", field)


def _check_utf8(value: Any, field: str, kind: str) -> None:
    """Refuse text with a lone surrogate (JSON can escape one, UTF-8 cannot encode it, tokenizers fail on it)."""
    # A validated list is all texts or all token ids: the first item tells which.
    texts = [value] if isinstance(value, str) else value if value and isinstance(value[0], str) else []
    try:
        "".join(texts).encode("utf-8")
    except UnicodeEncodeError:
        for i, t in enumerate(texts):
            if not t.isascii():
                try:
                    t.encode("utf-8")
                except UnicodeEncodeError:
                    item = "" if kind == "text" or isinstance(value, str) else f" item {i}"
                    _refuse(f"'{field}'{item} is not valid UTF-8 text (lone surrogate)", field)


def _inputs(kind: str) -> WrapValidator:
    """A field of texts or token ids: pydantic checks the type (fast, in Rust); a failure is diagnosed in full."""

    def validate(value: Any, handler: Any, info: ValidationInfo) -> Any:
        field = info.field_name or "input"
        try:
            out = handler(value)
        except ValidationError as exc:
            if exc.errors()[0]["type"] != INPUT_ERROR:  # a field's own validator has said what is wrong
                _diagnose(value, field, kind)
            raise
        if kind != "ids":
            _check_utf8(out, field, kind)
        return out

    return WrapValidator(validate)


def _integral(value: Any) -> Any:
    """5.0 is the integer 5 in JSON (and for the schema's "integer"); "5", true and 5.5 stay refused (strict)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


INTEGRAL = BeforeValidator(_integral)
"""Last in an integer body field's Annotated (after its Field constraints, which then stay in the JSON schema);
not for token ids, which must be written as integers (see `_inputs`)."""

TokenId = Annotated[StrictInt, Field(ge=0)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Texts = Annotated[list[str], Field(min_length=1)]
PoolingInput = Annotated[str | Texts | TokenIds | Annotated[list[TokenIds], Field(min_length=1)], _inputs("prompts")]
EncodingFormat = Literal["float", "base64", "bytes", "bytes_only"]
EmbedDType = Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"]
Endianness = Literal["native", "big", "little"]


REQUEST_ID: ContextVar[str | None] = ContextVar("polyvec_request_id", default=None)
"""The client's X-Request-Id, set by the server middleware for the request being handled."""


def random_id(prefix: str, request_id: str | None = None) -> str:
    """A response id as vLLM makes it: the prefix and the client's X-Request-Id, else the body's `request_id`,
    else a random one."""
    return f"{prefix}-{REQUEST_ID.get() or request_id or uuid.uuid4().hex}"


class StrictModel(BaseModel):
    # strict: a body's values have the documented JSON types ("true" or 1 is not a boolean, "5" or 5.5 not an
    # integer; 5.0 is, see INTEGRAL), as the OpenAPI document says; lax coercion accepted bodies it rejects.
    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True, protected_namespaces=())


class VLLMCompatFields(StrictModel):
    """Fields vLLM clients may send that change nothing here (scheduling and multimodal hints)."""

    priority: Annotated[int, Field(ge=-(2**63), le=2**63 - 1), INTEGRAL] = 0
    """vLLM's: under `--scheduling-policy priority`, lower values are served earlier (ties in arrival order);
    ignored under fcfs, the default (a 64-bit integer, as vLLM checks it)."""
    request_id: Annotated[str, AfterValidator(_request_id)] | None = None
    """The response's id (after its prefix), as in vLLM; an X-Request-Id header takes precedence."""
    cache_salt: Annotated[str, AfterValidator(_cache_salt)] | None = None
    """Accepted for vLLM compatibility and checked as vLLM checks it (1 to 128 characters, none of @ / \\ NUL);
    ignored."""
    mm_processor_kwargs: dict[str, Any] | None = None
    """Accepted for vLLM compatibility: text-only models ignore it; image models refuse it (400), their resize
    budget is the server's --mm-processor-kwargs."""


class PoolingBase(VLLMCompatFields):
    model: str | None = None
    """Served model name; must match `--served-model-name` when given."""
    user: str | None = None
    """End-user identifier (OpenAI field); recorded nowhere, accepted for compatibility."""
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, json_schema_extra={"not": {"const": 0}}), INTEGRAL] | None = (
        None
    )
    """Keep at most this many tokens per input (special tokens included), up to max_model_len; -1 = the model's
    maximum (0 is refused)."""
    add_special_tokens: bool = True
    """Add the tokenizer's special tokens ([CLS] ... [SEP]) to text inputs."""
    truncation_side: Literal["left", "right"] | None = None
    """Which end truncation cuts: right (the default) keeps the first tokens, left keeps the last ones."""
    padding: Literal["max_length", "do_not_pad"] | None = None
    """"max_length": each text is filled with the pad token up to truncate_prompt_tokens, else max_model_len, and
    the pads are attended (vLLM's option for models trained on fixed-length input without an attention mask, such
    as SigLIP's text tower); usage counts them."""


class EncodingFields(StrictModel):
    encoding_format: EncodingFormat = "float"
    """float: JSON numbers; base64: base64 of the raw bytes; bytes / bytes_only: an application/octet-stream
    body (bytes adds a `metadata` header with each item's shape, dtype and byte range)."""
    embed_dtype: EmbedDType = "float32"
    """Element type of base64 and bytes outputs."""
    endianness: Endianness = "native"
    """Byte order of base64 and bytes outputs."""


class ChatMessage(BaseModel):
    """One message of a conversation (OpenAI's chat format; fields other than these go to the template as-is)."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any] | str] | None = None
    """A string, or content parts: {"type": "text", "text": ...} (or vLLM's other text parts: input_text,
    output_text, refusal, thinking, a plain string); null is empty text; an image model (ColQwen2) takes one
    {"type": "image_url", "image_url": {"url": "data:image/...;base64,..."}} part instead, text models refuse it."""


class ChatFields(StrictModel):
    """vLLM's chat-style pooling requests: `messages` instead of `input`, rendered by the chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    """A conversation to embed as one input, rendered by the model's chat template (or --chat-template);
    add_special_tokens then defaults to false, as the template writes the special tokens itself."""
    add_generation_prompt: bool = False
    """Append the template's generation prompt (the start of an assistant turn)."""
    continue_final_message: bool = False
    """End the text right after the last message, leaving it open."""
    chat_template: str | None = None
    """A template for this request (only with --trust-request-chat-template)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the template (the request's own fields win over the same names here)."""
    media_io_kwargs: dict[str, dict[str, Any]] | None = None
    """Accepted as vLLM's; images are decoded as polyvec decodes every image."""

    @model_validator(mode="after")
    def _input_or_messages(self) -> Any:
        has_input = getattr(self, "input", None) is not None
        if "input" in self.model_fields_set and not has_input:
            _refuse(f"'input' must be {_SHAPES['prompts']}, not null", "input")
        if self.messages is not None and has_input:
            _refuse("give either 'input' or 'messages', not both", "messages")
        if self.messages is None and not has_input:
            _refuse("field 'input' is required (or 'messages' for a chat-style request)", "input")
        return self


def _is_conversation(value: Any) -> bool:
    """vLLM's test: a non-empty list of objects with a string `role`."""
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                          for m in value)  # fmt: skip


def _conversations_shape(value: Any) -> str:
    batch = isinstance(value, list) and bool(value) and all(isinstance(c, list) for c in value)
    return "conversations" if batch else "conversation"


Conversation = Annotated[list[ChatMessage], Field(min_length=1)]
Conversations = Annotated[
    Annotated[Conversation, Tag("conversation")]
    | Annotated[Annotated[list[Conversation], Field(min_length=1)], Tag("conversations")],
    Discriminator(_conversations_shape),
]
"""One conversation, or a list of them."""


class LateChunkingConfig(StrictModel):
    """vLLM 0.34's late chunking: the whole input encoded once, its token vectors averaged per chunk_size tokens."""

    chunk_size: Annotated[int, Field(gt=0, le=2**63 - 1, strict=True)]
    """Tokens per chunk (special tokens included; the last chunk may be shorter)."""


class EmbeddingRequest(PoolingBase, EncodingFields, ChatFields):
    """OpenAI `POST /v1/embeddings`, and vLLM's chat-style forms: `messages` holding one conversation or a list
    of them, or those in `input`."""

    input: PoolingInput | None = None
    """A string, a list of strings, a list of token ids, or a list of token-id lists; or, as vLLM takes them, a
    conversation or a list of conversations (then read as `messages`)."""
    messages: Conversations | None = None  # type: ignore[assignment]  # ChatFields' one conversation, or several
    """A conversation to embed as one input, or a list of conversations (one output each), rendered by the
    model's chat template (or --chat-template); add_special_tokens then defaults to false, as the template writes
    the special tokens itself."""
    dimensions: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    """Matryoshka output size (only for models trained for it)."""
    use_activation: bool | None = None
    """L2-normalize the output (default true)."""
    normalize: bool | None = None
    """Older name of use_activation."""
    input_type: str | None = None
    """Late-interaction (ColBERT) models: "query" or "document" (default); search_query / search_document
    are accepted. The response says which mode was used. Models with instruction prompts
    (config_sentence_transformers.json, e.g. Qwen3-Embedding) prepend the prompt of that name to text."""
    long_input: Literal["truncate", "window"] | None = None
    """Encoder input longer than the model's maximum: "truncate" it (even on a server that refuses long input,
    --truncation error), or split it into "window"s (embed: the token-weighted mean of the windows, then
    normalized; token_embed: one vector per input token). Default: the server's --long-input."""
    window_overlap: Annotated[int, Field(ge=0), INTEGRAL] | None = None
    """long_input="window": tokens shared by consecutive windows (default: the server's --window-overlap)."""
    pool_factor: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    """token_embed of documents: token vectors clustered into len // pool_factor groups, one mean each (PyLate's
    hierarchical token pooling, the first vector kept); queries are not pooled."""
    late_chunking_params: LateChunkingConfig | None = None
    """vLLM's late chunking: each text's `embedding` is its chunk vectors, one per `chunk_size` tokens, each the
    mean of the whole-context token vectors (normalized unless use_activation is false), with `late_chunking`
    (the chunks' token and character ranges). Text input within max_model_len; encoding_format float."""
    modality: Literal["text", "image"] | None = None
    """Infinity's: "image" reads each `input` string as an image (a base64 data: URL, or an http(s) URL on a host
    the server allows), for an image model; "text", the default, as without it. With it, `dimensions` is
    Infinity's: the first values of the (normalized) vector of any model, not normalized again; 0 the full size."""
    _cut: int | None = PrivateAttr(default=None)
    """Infinity's `dimensions` (a body with `modality`): the vectors' first values kept once they are made."""

    @model_validator(mode="wrap")
    @classmethod
    def _infinity_dimensions(cls, data: Any, handler: Any) -> Any:
        """Infinity's body (one with `modality`) cuts any model's vector to `dimensions` values after it is
        normalized (0: the full size); vLLM's `dimensions` is the model's Matryoshka reduction."""
        infinity = (  # Infinity's body (its client sends modality; raw bodies its model name), not /pooling's
            cls is EmbeddingRequest
            and isinstance(data, dict)
            and ("modality" in data or data.get("model") == "default/not-specified")
        )
        cut = data.get("dimensions") if infinity else None
        if not isinstance(cut, int) or isinstance(cut, bool) or cut < 0:
            return handler(data)
        model = handler({k: v for k, v in data.items() if k != "dimensions"})
        model._cut = cut  # 0: Infinity's full size (its route); vLLM's refused value on /v1/embeddings
        return model

    @model_validator(mode="before")
    @classmethod
    def _conversations_in_input(cls, data: Any) -> Any:
        """vLLM takes conversations in `input` too: they are `messages`."""
        if isinstance(data, dict) and "messages" not in data:
            given = data.get("input")
            if _is_conversation(given) or (
                isinstance(given, list) and given and all(_is_conversation(c) for c in given)
            ):
                data = {k: v for k, v in data.items() if k != "input"} | {"messages": given}
        return data

    def conversations(self) -> list[list[ChatMessage]]:
        """The body's conversations (one for a single `messages` conversation)."""
        if self.messages is None:
            return []
        if _conversations_shape(self.messages) == "conversations":
            return self.messages  # type: ignore[return-value]
        return [self.messages]  # type: ignore[list-item]


class MuveraFields(StrictModel):
    """MUVERA's parameters (fastembed's names and defaults)."""

    k_sim: Annotated[int, Field(ge=1, le=10), INTEGRAL] = 5
    """SimHash hyperplanes per repetition: 2^k_sim partitions."""
    dim_proj: Annotated[int, Field(ge=1), INTEGRAL] = 16
    """Each partition's vector projected to this width (at most the token vectors' width)."""
    r_reps: Annotated[int, Field(ge=1), INTEGRAL] = 20
    """Repetitions, concatenated: r_reps · 2^k_sim · dim_proj numbers in all."""
    seed: Annotated[int, Field(ge=0), INTEGRAL] = 42
    """Seed of the random hyperplanes and projections."""


def _removed_task(value: Any) -> Any:
    from ...pooling_params import REMOVED_TASKS  # here: the protocol module stays free of torch

    if isinstance(value, str) and value in REMOVED_TASKS:
        _refuse(REMOVED_TASKS[value], "task")
    return value


class PoolingRequest(EmbeddingRequest):
    """vLLM `POST /pooling`: any pooling task."""

    task: Annotated[
        Literal["embed", "token_embed", "classify", "token_classify", "embed_sparse"]
        | Annotated[
            list[Literal["embed", "token_embed", "classify", "token_classify", "embed_sparse"]],
            Field(min_length=1),
        ]
        | None,
        BeforeValidator(_removed_task),
    ] = None
    """Which output: embed (one vector), token_embed (one vector per token), classify (label probabilities),
    token_classify (per-token label scores), embed_sparse (SPLADE); a list: each of them from one forward pass,
    each item's `data` and `shape` keyed by task. Default: the model's own task."""
    activation: bool | None = None
    """Older name of use_activation for the classify tasks."""
    sparse_top_k: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    """embed_sparse: keep only the k largest weights."""
    sparse_threshold: Annotated[float, Field(ge=0)] | None = None
    """embed_sparse: drop weights below this value."""
    return_tokens: bool = False
    """embed_sparse: also return the vocabulary string of each index (`tokens`)."""
    muvera: MuveraFields | None = None
    """token_embed: the token vectors' MUVERA fixed-dimensional encoding instead, one vector per input, for a
    single-vector index (`{}` for the defaults). Send documents and queries (`input_type: "query"`) with the same
    parameters."""
    token_encoding: Literal["int8", "binary"] | None = None
    """token_embed: codes instead of float vectors, for storage: "int8" (`data` rows of integers in −127..127 and
    `scales`, one per row: vector ≈ row · scale) or "binary" (`data` rows of bytes 0..255, the sign bits packed
    most significant bit first; `shape` gives the vectors' width). JSON only (encoding_format float)."""


class ClassificationRequest(PoolingBase, ChatFields):
    """vLLM `POST /classify`, and its chat-style form (`messages`); Infinity's body (with `raw_scores`) gets
    Infinity's response."""

    input: PoolingInput | None = None
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    use_activation: bool | None = None
    """Apply softmax (sigmoid for one-label or multi-label models); false returns logits."""
    activation: bool | None = None
    """Older name of use_activation."""
    raw_scores: bool | None = None
    """Infinity's. A body with it is answered as Infinity answers: `data` holds, per input, every label with its
    score, highest first; the scores are the model's probabilities either way, as Infinity's (its text-
    classification pipeline applies its activation whatever raw_scores says)."""


def _score_content(value: Any, info: ValidationInfo) -> Any:
    """vLLM's score items `{"content": [part]}` as the text or the data: URL of their one part (text or
    image_url); other items are left to the type check."""
    field = info.field_name or "documents"

    def one(item: Any, where: str) -> Any:
        if not isinstance(item, dict) or "content" not in item:
            return item
        parts = item["content"]
        part = parts[0] if isinstance(parts, list) and len(parts) == 1 and isinstance(parts[0], dict) else None
        if part is not None and part.get("type") == "text" and isinstance(part.get("text"), str):
            return part["text"]
        url = part.get("image_url") if part is not None and part.get("type") == "image_url" else None
        url = url.get("url") if isinstance(url, dict) else url
        if isinstance(url, str) and url[:11].lower() == "data:image/":
            return url
        _refuse(
            f"{where}: a {{'content': [...]}} item takes one part, text or an image_url with a base64 data: URL",
            field,
        )

    if isinstance(value, list):
        return [one(x, f"'{field}' item {i}") for i, x in enumerate(value)]
    return one(value, f"'{field}'")


ScoreInput = Annotated[str | Texts, BeforeValidator(_score_content), _inputs("text_or_texts")]


class SidesError(ValueError):
    """A score body's sides missing or given twice; `param` is the field to name."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class ScoreRequest(PoolingBase):
    """vLLM `POST /score`: score text_1 against text_2 (1:1, 1:N, N:N).

    `data_1`/`data_2`, `queries`/`documents` and `queries`/`items` are accepted as the same two sides.
    """

    text_1: ScoreInput | None = None
    """The query side: one text or a list."""
    text_2: ScoreInput | None = None
    """The document side: one text or a list (for an image model, also base64 data: URLs of page images). On
    either side an item may be vLLM's `{"content": [part]}` with one text or image_url part."""
    data_1: ScoreInput | None = None
    data_2: ScoreInput | None = None
    queries: ScoreInput | None = None
    documents: ScoreInput | None = None
    items: ScoreInput | None = None
    use_activation: bool | None = None
    """Cross-encoders: apply the sigmoid/softmax to the logit (default true)."""
    max_tokens_per_query: Annotated[int, Field(ge=0), INTEGRAL] | None = 0
    """Cut each query text to at most this many tokens, not counting special tokens or prompts (0, null: no
    limit)."""
    max_tokens_per_doc: Annotated[int, Field(ge=0), INTEGRAL] | None = 0
    """Cut each document text to at most this many tokens, not counting special tokens or prompts (0, null: no
    limit)."""
    instruction: str | None = None
    """A reranker's instruction, the `instruction` variable of its --chat-template (as vLLM passes it; the
    Qwen3-Reranker template reads it); refused when the server has no template."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Variables of a reranker's --chat-template (its "instruction" wins over `instruction`); refused when the
    server has no template."""

    def sides(self) -> tuple[tuple[str, ScoreInput], tuple[str, ScoreInput]]:
        """The two sides as (field name, value), from the first pair of field names the body gives."""
        pairs = [("text_1", "text_2"), ("data_1", "data_2"), ("queries", "documents"), ("queries", "items")]
        given = [(a, b) for a, b in pairs if getattr(self, a) is not None and getattr(self, b) is not None]
        if not given:  # named: the missing half of a pair the body began, else the first pair
            half = next((b if getattr(self, a) is not None else a for a, b in pairs
                         if (getattr(self, a) is None) != (getattr(self, b) is None)), "text_1")  # fmt: skip
            message = "text_1 and text_2 are required (or data_1/data_2, queries/documents, queries/items)"
            raise SidesError(message, half)
        a, b = given[0]
        extra = [f for f in ("text_1", "text_2", "data_1", "data_2", "queries", "documents", "items")
                 if f not in (a, b) and getattr(self, f) is not None]  # fmt: skip
        if extra:  # a second pair of sides, or half of one: which to score would be a guess
            raise SidesError(f"give one pair of sides: {a}/{b} and {', '.join(extra)} were both given", extra[0])
        return (a, getattr(self, a)), (b, getattr(self, b))


def _document_texts(value: Any) -> Any:
    """Cohere v1's document objects (`{"text": ...}`, as its client sends them) as their text, the field Cohere
    ranks by when no rank_fields are given; one document alone (vLLM's `documents: "text"`) as a list of it."""
    if isinstance(value, (str, dict)):
        value = [value]
    if isinstance(value, list):
        return [x["text"] if isinstance(x, dict) and isinstance(x.get("text"), str) else x for x in value]
    return value


def _or_one_document(schema: dict[str, Any]) -> None:
    """The schema of a list of documents that also takes one document alone (vLLM's `documents: "text"`); a
    document is a text or an object (Cohere v1's, read through rank_fields; vLLM's `{"content": [part]}`)."""
    array = {k: schema.pop(k) for k in list(schema) if k not in ("title", "description")}
    document = [{"type": "string"}, {"type": "object"}]
    schema["anyOf"] = [{**array, "items": {"anyOf": document}}, *document]


class RerankRequest(PoolingBase):
    """Jina / Cohere rerank: `POST /rerank`, `/v1/rerank`, `/v2/rerank`."""

    query: Annotated[str, BeforeValidator(_score_content), _inputs("text")]
    """The query text."""
    documents: Annotated[
        Texts,
        BeforeValidator(_document_texts),
        BeforeValidator(_score_content),
        _inputs("texts"),
        Field(json_schema_extra=_or_one_document),
    ]
    """Documents to order by relevance to the query: texts (for an image model, also base64 data: URLs of page
    images), Cohere v1's `{"text": ...}` objects, or vLLM's `{"content": [part]}` with one text or image_url
    part; one document may be given alone, as vLLM takes it."""
    top_n: Annotated[int, Field(ge=0), INTEGRAL] | None = 0
    """Return only the best top_n documents (0 or null: all)."""
    return_documents: bool | None = True
    """Include each document's text in the results (null: the default, true)."""
    use_activation: bool | None = None
    """Cross-encoders: apply the sigmoid/softmax to the logit (default true)."""
    priority: Annotated[int, Field(ge=-(2**63), le=2**63 - 1), INTEGRAL] | None = 0  # type: ignore[assignment]
    """As vLLM's `priority` (lower served earlier under `--scheduling-policy priority`); null too (0), as Cohere's
    rerank takes it."""
    max_tokens_per_query: Annotated[int, Field(ge=0), INTEGRAL] | None = 0
    """Cut each query text to at most this many tokens, not counting special tokens or prompts (0, null: no
    limit)."""
    max_tokens_per_doc: Annotated[int, Field(ge=0), INTEGRAL] | None = 0
    """Cut each document text to at most this many tokens, not counting special tokens or prompts (0, null: no
    limit)."""
    instruction: str | None = None
    """A reranker's instruction, the `instruction` variable of its --chat-template (as vLLM passes it; the
    Qwen3-Reranker template reads it); refused when the server has no template."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Variables of a reranker's --chat-template (its "instruction" wins over `instruction`); refused when the
    server has no template."""
    rank_fields: Annotated[list[str], Field(min_length=1)] | None = None
    """Cohere v1: the fields of object documents to rank by, in order: one field's value alone, several as
    "field: value" lines (default: "text")."""
    max_chunks_per_doc: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    """Cohere v1: accepted; a document longer than the model's input is cut (see max_tokens_per_doc), not split
    into chunks."""
    raw_scores: bool | None = None
    """Infinity's: a cross-encoder's logit, else (false) its sigmoid, whatever activation the model declares, as
    Infinity computes it. A body with it is answered as Infinity answers: documents as strings, and only when
    return_documents is true."""

    @model_validator(mode="after")
    def _raw_scores(self) -> Any:
        if self.raw_scores is not None:
            if self.use_activation is not None and self.use_activation == self.raw_scores:
                _refuse(
                    f"raw_scores={self.raw_scores} conflicts with use_activation={self.use_activation}", "raw_scores"
                )
            self.use_activation = False  # the logit; routes/score.py applies Infinity's sigmoid
        return self

    _given_documents: list[Any] | None = PrivateAttr(default=None)
    """The object documents as sent, where rank_fields read them (returned as they came)."""
    _content_parts: dict[int, list[Any]] = PrivateAttr(default_factory=dict)
    """vLLM's `{"content": [part]}` documents by index: returned as vLLM does, `{"multi_modal": parts}`."""

    @model_validator(mode="wrap")
    @classmethod
    def _rank_fields(cls, data: Any, handler: Any) -> Any:
        """Cohere v1's object documents read through rank_fields, before the documents are validated."""
        fields = data.get("rank_fields") if isinstance(data, dict) else None
        documents = data.get("documents") if isinstance(data, dict) else None
        if not isinstance(fields, list) or not fields or not all(isinstance(f, str) for f in fields):
            model = handler(data)
            given = [documents] if isinstance(documents, dict) else documents
            if isinstance(given, list):
                model._content_parts = {
                    i: doc["content"] for i, doc in enumerate(given) if isinstance(doc, dict) and "content" in doc
                }
            return model
        if isinstance(documents, dict):  # one document alone, as for texts
            documents = [documents]
        if not isinstance(documents, list):
            return handler(data)
        model = handler({**data, "documents": [_ranked_text(doc, fields) for doc in documents]})
        model._given_documents = documents
        return model


def _ranked_text(document: Any, fields: list[str]) -> Any:
    """An object document's text to rank by: the value of the one rank field, or "field: value" lines of several
    (values that are not strings as JSON); other documents as they are."""
    if not isinstance(document, dict) or "content" in document:
        return document
    values = [(f, v if isinstance(v, str) else json.dumps(v)) for f in fields if (v := document.get(f)) is not None]
    if len(fields) == 1:
        return values[0][1] if values else document
    return "\n".join(f"{name}: {value}" for name, value in values) if values else document


CohereEmbeddingType = Literal["float", "int8", "uint8", "binary", "ubinary", "base64"]


class CohereText(StrictModel):
    """A text part of a Cohere `inputs` item."""

    type: Literal["text"]
    text: str


class CohereImageURL(StrictModel):
    url: str


class CohereImage(StrictModel):
    """An image part of a Cohere `inputs` item (a base64 data: URL): image models only, alone in its item."""

    type: Literal["image_url"]
    image_url: CohereImageURL


class CohereEmbedInput(StrictModel):
    """One Cohere v2 `inputs` item, embedded as one vector."""

    content: Annotated[list[Annotated[CohereText | CohereImage, Field(discriminator="type")]], Field(min_length=1)]
    """Its parts: text parts are joined with a newline; an image model takes one image_url part alone."""


class CohereEmbedV1Request(StrictModel):
    """Cohere embed v1: `POST /v1/embed`."""

    model: str | None = None
    """Served model name."""
    texts: Annotated[Texts, _inputs("texts")] | None = None
    """Texts to embed."""
    images: list[str] | None = None
    """Images as base64 data: URIs, for image models (ColQwen2); text models answer 400."""
    input_type: str | None = None
    """search_query, search_document, classification or clustering: a late-interaction (ColBERT) model's query
    or document mode, or the model's instruction prompt of that name (config_sentence_transformers.json)."""
    embedding_types: Annotated[list[CohereEmbeddingType], Field(min_length=1)] | None = None
    """Output types to return. v1 without it: the `embeddings_floats` response; v2 default ["float"]. int8 and
    uint8 are scaled per vector (127 * x / max|x|, rounded; uint8 adds 128); binary and ubinary pack the sign
    bits (set where x >= 0), most significant bit first, binary as the byte minus 128."""
    truncate: Literal["NONE", "START", "END"] | None = "END"
    """Over-long input: END (the default, also for null) cuts its end, START its beginning (keeping the last
    tokens), each to max_tokens or the model's maximum input length; NONE rejects it."""


class CohereEmbedRequest(CohereEmbedV1Request):
    """Cohere embed v2: `POST /v2/embed`. Exactly one of `texts` and `inputs`."""

    inputs: Annotated[list[CohereEmbedInput], Field(min_length=1)] | None = None
    """Inputs of content parts (text; one image for image models), each embedded as one vector."""
    output_dimension: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    """Matryoshka output size."""
    max_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    """At most this many tokens per input, special tokens included (at most the model's maximum input length);
    longer input is cut as `truncate` says, or rejected with NONE."""
    priority: Annotated[int, Field(ge=-(2**63), le=2**63 - 1), INTEGRAL] | None = 0
    """As vLLM's `priority` (lower served earlier under `--scheduling-policy priority`, else ignored); a 64-bit
    integer, or null (0), as Cohere's clients send it."""


class TokenizeRequest(StrictModel):
    """vLLM `POST /tokenize`: a `prompt`, or a conversation (`messages`) rendered by the chat template."""

    model: str | None = None
    prompt: Annotated[str, _inputs("text")] | None = None
    """Text to tokenize."""
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    """A conversation, rendered by the model's chat template (or --chat-template) before tokenizing."""
    add_generation_prompt: bool = True
    """messages: append the template's generation prompt (vLLM's default for /tokenize)."""
    continue_final_message: bool = False
    """messages: end the text right after the last message."""
    chat_template: str | None = None
    """messages: a template for this request (only with --trust-request-chat-template)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """messages: extra variables for the template."""
    add_special_tokens: bool = True
    """Add the tokenizer's special tokens (default false with messages: the template writes them)."""
    return_token_strs: bool | None = False
    """Also return each token as a string."""
    tools: list[dict[str, Any]] | None = None
    """messages: tool definitions, given to the chat template as `tools` (as transformers and vLLM do)."""
    response_format: dict[str, Any] | None = None
    """Accepted as vLLM's; a pooling model's text conversation renders the same with or without it."""
    media_io_kwargs: dict[str, dict[str, Any]] | None = None
    """Accepted as vLLM's; images are decoded as the embedding routes decode them."""
    mm_processor_kwargs: dict[str, Any] | None = None
    """As on the embedding routes: text-only models ignore it; image models refuse it (400), their resize
    budget is the server's --mm-processor-kwargs."""

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> Any:
        if (self.prompt is None) == (self.messages is None):
            _refuse("give either 'prompt' or 'messages'", "prompt")
        return self


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: Annotated[list[TokenId], _inputs("ids")]
    """Token ids to turn back into text."""


# ---------------------------------------------------------------------------------------------- responses


# Response bodies: documentation only (the routes build dicts, or raw bytes); each describes what
# /openapi.json promises for a 200, which tests/entrypoints/server/test_openapi_contract.py checks.

Vector = float | list[float] | list[list[float]] | str
"""A float vector (a token matrix for multi-vector outputs, a bare number for a scalar output), or base64."""


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0
    prompt_tokens_details: dict[str, Any] | None = None


class LateChunkItem(BaseModel):
    token_range: tuple[int, int]
    char_range: tuple[int, int] | None


class LateChunkingItem(BaseModel):
    chunk_size: int
    input_tokens: int
    chunks: list[LateChunkItem]
    strategy: str = "fixed_tokens"


class EmbeddingItem(BaseModel):
    index: int
    object: str
    embedding: Vector
    shape: list[int] | None = None
    """Multi-vector (late-interaction) outputs: [n_tokens, dim]."""
    input_type: str | None = None
    late_chunking: LateChunkingItem | None = None
    """With late_chunking_params: each chunk's token range and its characters in the text."""


class SparseVector(BaseModel):
    """embed_sparse: the non-zero weights, by ascending vocabulary id."""

    indices: list[int]
    values: list[float]
    tokens: list[str] | None = None


class PoolingItem(BaseModel):
    index: int
    object: str
    data: Vector | SparseVector | dict[str, Vector | SparseVector]
    shape: list[int] | dict[str, list[int]] | None = None
    input_type: str | None = None
    encoding: Literal["int8", "binary"] | None = None
    """With token_encoding: the codes' form."""
    scales: list[float] | None = None
    """token_encoding int8: each row's scale."""


class ClassificationItem(BaseModel):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class ScoreItem(BaseModel):
    index: int
    object: str
    score: float


class _Envelope(BaseModel):
    id: str
    object: str
    created: int
    model: str
    usage: Usage


class EmbeddingResponse(_Envelope):
    data: list[EmbeddingItem]


class PoolingResponse(_Envelope):
    data: list[PoolingItem]


class ClassificationResponse(_Envelope):
    data: list[ClassificationItem]


class ScoreResponse(_Envelope):
    data: list[ScoreItem]


class HealthResponse(BaseModel):
    """GET /health: Infinity's body."""

    unix: float
    """The server's clock, seconds since the epoch."""


class RerankDocument(BaseModel):
    text: str | None = None
    multi_modal: list[dict[str, Any]] | None = None
    """vLLM's: a `{"content": [part]}` document's parts as sent."""


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | dict[str, Any] | str | None = None
    """With return_documents: {"text"}, {"multi_modal": parts} for vLLM's content documents, or an object document
    (Cohere's, with rank_fields) as it was sent; the text itself for Infinity's body (one with `raw_scores`)."""


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage


class CohereApiVersion(BaseModel):
    version: str
    """The route's API version: "1" or "2"."""


class CohereBilledUnits(BaseModel):
    input_tokens: int
    """Tokens of all inputs after truncation, special tokens included."""


class CohereMeta(BaseModel):
    api_version: CohereApiVersion
    billed_units: CohereBilledUnits


FloatEmbedding = list[float] | list[list[float]]
"""One input's float vector, or its token matrix for multi-vector (late-interaction) models."""
Int8Codes = list[list[Annotated[int, Field(ge=-128, le=127)]]]
Uint8Codes = list[list[Annotated[int, Field(ge=0, le=255)]]]


class CohereEmbeddingsByType(BaseModel):
    """One list per requested type, one entry per input."""

    float_: list[FloatEmbedding] | None = Field(None, alias="float")
    int8: Int8Codes | None = None
    uint8: Uint8Codes | None = None
    binary: Int8Codes | None = None
    """Sign bits packed 8 to a byte, most significant first, as the byte minus 128."""
    ubinary: Uint8Codes | None = None
    """Sign bits packed 8 to a byte, most significant first."""
    base64: list[str] | None = None
    """Base64 of each vector's little-endian float32 bytes."""


class _CohereEmbed(BaseModel):
    id: str
    texts: list[str] | None = None
    """The texts, when the request gave `texts`."""
    shapes: list[list[int]] | None = None
    """Multi-vector (late-interaction) models: each input's [n_tokens, dim]."""
    input_type: str | None = None
    """Multi-vector models: the mode used, query or document."""
    meta: CohereMeta


class CohereEmbedResponse(_CohereEmbed):
    """`/v2/embed`, and `/v1/embed` with embedding_types."""

    response_type: Literal["embeddings_by_type"]
    embeddings: CohereEmbeddingsByType


class CohereEmbedFloatsResponse(_CohereEmbed):
    """`/v1/embed` without embedding_types."""

    response_type: Literal["embeddings_floats"]
    embeddings: list[FloatEmbedding]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: str
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int
    permission: list[Any]


class ModelList(BaseModel):
    object: str
    data: list[ModelCard]


class InfinityModelCard(BaseModel):
    id: str
    object: str
    created: int
    stats: dict[str, Any]
    backend: str
    capabilities: list[str]


class InfinityModelList(BaseModel):
    object: str
    data: list[InfinityModelCard]


class InfinityLabelScore(BaseModel):
    score: float
    label: str


class InfinityClassifyResponse(BaseModel):
    """/classify's answer to Infinity's body (one with `raw_scores`): per input, every label by score."""

    id: str
    object: str
    created: int
    model: str
    data: list[list[InfinityLabelScore]]
    usage: Usage


class VersionResponse(BaseModel):
    version: str


class LoadResponse(BaseModel):
    server_load: int


def usage(tokens: int) -> dict[str, int | None]:
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0, "prompt_tokens_details": None}


def envelope(prefix: str, model: str, data: list[Any], tokens: int, request_id: str | None = None) -> dict[str, Any]:
    return {
        "id": random_id(prefix, request_id),
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": usage(tokens),
    }
