"""Request and response bodies of Hugging Face text-embeddings-inference (TEI), with TEI's field names and defaults.

As in protocol.py, unknown fields are refused and values are strictly typed (TEI's serde ignores unknown fields; a
typo here is an error rather than a silently dropped option). Input fields are diagnosed in full: the message names
the field and the first item at fault. `TruncationDirection` takes TEI's four spellings.

`/rerank` and `/tokenize` are shared with vLLM's bodies: `RerankBody` and `TokenizeBody` are unions that pick TEI's
model by the body's fields (TEI's `texts` without `documents`, TEI's `inputs` without `prompt`), and pydantic then
validates against that one model only, its errors located under the tag (`TEI_TAG` or `POLYVEC_TAG`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal, NoReturn

from pydantic import BaseModel, ConfigDict, Discriminator, Field, RootModel, Tag, ValidationError, WrapValidator
from pydantic_core import PydanticCustomError

from . import protocol as P
from .errors import INPUT_ERROR, json_type

TruncationDirection = Literal["Left", "Right", "left", "right"]
"""Left cuts the beginning (keeps the last tokens), Right the end."""

TEIErrorType = Literal["Unhealthy", "Backend", "Overloaded", "Validation", "Tokenizer", "Empty"]

TEI_TAG, POLYVEC_TAG = "tei", "polyvec"


def _refuse(message: str, field: str) -> NoReturn:
    raise PydanticCustomError(INPUT_ERROR, "{message}", {"message": message, "param": field})


def _not_token(value: Any) -> str | None:
    """What `value` is when it is not a token id (a non-negative integer), else None."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "a negative number" if value < 0 else None
    return "a number with a fraction or exponent" if isinstance(value, float) else json_type(value)


def _bad_ids(ids: list, where: str, word: str = "position") -> str | None:
    for j, t in enumerate(ids):
        what = _not_token(t)
        if what is not None:
            return f"{where} {word} {j} is {what}, not a token id (a non-negative integer)"
    return None


def _lone_surrogate(value: Any, where: str, depth: int = 0) -> str | None:
    """Where a text of a validated value has a lone surrogate (JSON can escape one, UTF-8 cannot encode it,
    tokenizers fail on it); None if nowhere."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return f"{where} is not valid UTF-8 text (lone surrogate)"
        return None
    if isinstance(value, list) and value and not isinstance(value[0], int):  # a validated list of ids is all ints
        for i, item in enumerate(value):
            problem = _lone_surrogate(item, f"{where} {'position' if depth else 'item'} {i}", depth + 1)
            if problem:
                return problem
    return None


def _checked(diagnose: Callable[[Any, str], str]) -> WrapValidator:
    """pydantic checks the type (in Rust); a failure is explained by `diagnose(value, "`field`")`, and text that
    passed is checked for lone surrogates."""

    def validate(value: Any, handler: Any, info: Any) -> Any:
        field = info.field_name or "inputs"
        try:
            out = handler(value)
        except ValidationError:
            _refuse(diagnose(value, f"`{field}`"), field)
        problem = _lone_surrogate(out, f"`{field}`")
        if problem:
            _refuse(problem, field)
        return out

    return WrapValidator(validate)


_INPUT_SHAPE = "a string, a list of token ids, or a list of strings and token-id lists"


def _diagnose_inputs(value: Any, name: str) -> str:
    """`Input`: a string, the token ids of one input, or a batch of strings and token-id lists."""
    if not isinstance(value, list):
        return f"{name} must be {_INPUT_SHAPE}, not {json_type(value)}"
    if value and isinstance(value[0], int | float):  # the token ids of one input
        return _bad_ids(value, name, "item") or f"{name} must be {_INPUT_SHAPE}"
    for i, item in enumerate(value):
        where = f"{name} item {i}"
        if isinstance(item, list):
            problem = _bad_ids(item, where)
            if problem:
                return problem
        elif not isinstance(item, str):
            return f"{where} is {json_type(item)}, not a string or a list of token ids ({name} is {_INPUT_SHAPE})"
    return f"{name} must be {_INPUT_SHAPE}"


_PREDICT_SHAPE = "a string, a pair of strings [string, string] or a batch [[string], [string, string], ...]"


def _diagnose_predict(value: Any, name: str) -> str:
    """`PredictInput`: a string, one pair, or a batch of 1- and 2-string lists."""
    if not isinstance(value, list):
        return f"{name} must be {_PREDICT_SHAPE}, not {json_type(value)}"
    if not value:
        return f"{name} must not be empty ({_PREDICT_SHAPE})"
    if not isinstance(value[0], list):  # one input: a string, or a pair
        for i, s in enumerate(value):
            if not isinstance(s, str):
                return f"{name} item {i} is {json_type(s)}, not a string"
        return f"{name} has {len(value)} strings; a pair has 2 (a batch is a list of lists)"
    for i, item in enumerate(value):
        where = f"{name} item {i}"
        if not isinstance(item, list):
            return f"{where} is {json_type(item)}, not a list of 1 or 2 strings (item 0 is a list: {name} is a batch)"
        for j, s in enumerate(item):
            if not isinstance(s, str):
                return f"{where} position {j} is {json_type(s)}, not a string"
        if not 1 <= len(item) <= 2:
            return f"{where} has {len(item)} strings; a batch item is 1 string or a pair of 2"
    return f"{name} must be {_PREDICT_SHAPE}"


def _diagnose_text(value: Any, name: str) -> str:
    return f"{name} must be a string, not {json_type(value)}"


def _diagnose_texts(value: Any, name: str, shape: str = "a list of strings") -> str:
    if not isinstance(value, list):
        return f"{name} must be {shape}, not {json_type(value)}"
    for i, item in enumerate(value):
        if not isinstance(item, str):
            return f"{name} item {i} is {json_type(item)}, not a string"
    return f"{name} must be {shape}"


def _diagnose_text_or_texts(value: Any, name: str) -> str:
    return _diagnose_texts(value, name, "a string or a list of strings")


def _diagnose_ids(value: Any, name: str) -> str:
    """A list of token ids, or a list of such lists."""
    shape = "a list of token ids or a list of token-id lists"
    if not isinstance(value, list):
        return f"{name} must be {shape}, not {json_type(value)}"
    if value and isinstance(value[0], list):
        for i, ids in enumerate(value):
            if not isinstance(ids, list):
                return f"{name} item {i} is {json_type(ids)}, but item 0 is a list of token ids"
            problem = _bad_ids(ids, f"{name} item {i}")
            if problem:
                return problem
    return _bad_ids(value, name, "item") or f"{name} must be {shape}"


_Pair = Annotated[list[str], Field(min_length=1, max_length=2)]
Input = Annotated[str | list[P.TokenId] | list[str | list[P.TokenId]], _checked(_diagnose_inputs)]
PredictInput = Annotated[str | _Pair | Annotated[list[_Pair], Field(min_length=1)], _checked(_diagnose_predict)]
Text = Annotated[str, _checked(_diagnose_text)]
Texts = Annotated[list[str], _checked(_diagnose_texts)]
TextOrTexts = Annotated[str | list[str], _checked(_diagnose_text_or_texts)]
Ids = Annotated[list[P.TokenId] | list[list[P.TokenId]], _checked(_diagnose_ids)]


class TruncationOptions(P.StrictModel):
    truncate: bool | None = None
    """Cut input longer than the model's maximum (true) or refuse it (false); null: the server's setting
    (--truncation)."""
    truncation_direction: TruncationDirection = "Right"
    """Right cuts the end; Left cuts the beginning, keeping the last tokens."""


class TEIEmbedRequest(TruncationOptions):
    """TEI `POST /embed`."""

    inputs: Input
    """A string, the token ids of one input, or a batch of strings and token-id lists."""
    prompt_name: str | None = None
    """A prompt the model declares (config_sentence_transformers.json `prompts`), prepended to each input; null:
    the model's default prompt, if any."""
    normalize: bool = True
    """L2-normalize each vector (after `dimensions`)."""
    dimensions: Annotated[int, Field(ge=0), P.INTEGRAL] | None = None
    """Keep the first `dimensions` values (Matryoshka truncation), then normalize."""
    encoding_format: Literal["float", "base64"] | None = None
    """Accepted and not used, as TEI does (its /embed answers floats): huggingface_hub's InferenceClient sends its
    feature_extraction option here."""


class TEIEmbedAllRequest(TruncationOptions):
    """TEI `POST /embed_all`: one vector per token."""

    inputs: Input
    """A string, the token ids of one input, or a batch of strings and token-id lists."""
    prompt_name: str | None = None
    """A prompt the model declares, prepended to each input; null: the model's default prompt, if any."""


class TEIEmbedSparseRequest(TEIEmbedAllRequest):
    """TEI `POST /embed_sparse`: one sparse vector per input (SPLADE models)."""


class TEIPredictRequest(TruncationOptions):
    """TEI `POST /predict`: classification of texts or text pairs."""

    inputs: PredictInput
    """A string, a pair [string, string] (one input), or a batch of those as lists: [[string], [string, string]]."""
    raw_scores: bool = False
    """Return the logits instead of softmax (sigmoid for one-label models) scores."""
    parameters: dict[str, Any] | None = None
    """Accepted and not used, as TEI does: huggingface_hub's InferenceClient sends its text-classification
    options (top_k, function_to_apply) here."""


class TEIRerankRequest(TruncationOptions):
    """TEI `POST /rerank`."""

    query: Text
    """The query text."""
    texts: Texts
    """Texts to rank by relevance to the query."""
    raw_scores: bool = False
    """Cross-encoders: the logit instead of its sigmoid."""
    return_text: bool = False
    """Include each text in its result."""


class TEISimilarityInput(P.StrictModel):
    source_sentence: Text
    """The text the sentences are compared with."""
    sentences: Texts
    """Texts to compare with the source sentence."""


class TEISimilarityParameters(TruncationOptions):
    prompt_name: str | None = None
    """A prompt the model declares, prepended to each sentence; null: the model's default prompt, if any."""


class TEISimilarityRequest(P.StrictModel):
    """TEI `POST /similarity`: the cosine similarity of each sentence with the source sentence."""

    inputs: TEISimilarityInput
    parameters: TEISimilarityParameters | None = None
    """Truncation and prompt options."""


class TEITokenizeRequest(P.StrictModel):
    """TEI `POST /tokenize`."""

    inputs: TextOrTexts
    """A string or a list of strings."""
    add_special_tokens: bool = True
    """Add the tokenizer's special tokens ([CLS] ... [SEP])."""
    prompt_name: str | None = None
    """A prompt the model declares, prepended to each input; null: the model's default prompt, if any."""


class TEIDecodeRequest(P.StrictModel):
    """TEI `POST /decode`."""

    ids: Ids
    """The token ids of one text, or a list of those."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the text."""


def _tag(tei_field: str, polyvec_field: str) -> Discriminator:
    """TEI's model for a body with `tei_field` and without `polyvec_field`; any other body is polyvec's."""

    def tag(body: Any) -> str:
        is_tei = isinstance(body, dict) and tei_field in body and polyvec_field not in body
        return TEI_TAG if is_tei else POLYVEC_TAG

    return Discriminator(tag)


RerankBody = Annotated[
    Annotated[P.RerankRequest, Tag(POLYVEC_TAG)] | Annotated[TEIRerankRequest, Tag(TEI_TAG)],
    _tag("texts", "documents"),
]
TokenizeBody = Annotated[
    Annotated[P.TokenizeRequest, Tag(POLYVEC_TAG)] | Annotated[TEITokenizeRequest, Tag(TEI_TAG)],
    _tag("inputs", "prompt"),
]


# ---------------------------------------------------------------------------------------------- responses
# Documentation only (the routes build lists and dicts); /openapi.json promises these for a 200.


class TEIErrorResponse(BaseModel):
    """TEI's error body."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    error: str
    """What was wrong."""
    error_type: TEIErrorType
    """Validation or Tokenizer (422), Empty (400), Backend (424: the model cannot do this), Overloaded (429)."""


class TEIEmbedResponse(RootModel[list[list[float]]]):
    """One vector per input."""


class TEIEmbedAllResponse(RootModel[list[list[list[float]]]]):
    """Per input, one vector per token."""


class TEISparseValue(BaseModel):
    index: int
    value: float


class TEIEmbedSparseResponse(RootModel[list[list[TEISparseValue]]]):
    """Per input, its non-zero weights by vocabulary id."""


class TEIPrediction(BaseModel):
    score: float
    label: str


class TEIPredictResponse(RootModel[list[TEIPrediction] | list[list[TEIPrediction]]]):
    """Each label's score, best first; a list of those for a batch."""


class TEIRank(BaseModel):
    index: int
    text: str | None = None
    """With return_text."""
    score: float


class TEIRerankResponse(RootModel[list[TEIRank]]):
    """Best first; `index` is the position in `texts`."""


class TEISimilarityResponse(RootModel[list[float]]):
    """One cosine similarity per sentence."""


class TEIToken(BaseModel):
    id: int
    text: str
    special: bool
    start: int | None
    """Byte offset in the (prompted) input; null for special tokens."""
    stop: int | None


class TEITokenizeResponse(RootModel[list[list[TEIToken]]]):
    """Per input, its tokens."""


class TEIDecodeResponse(RootModel[list[str]]):
    """One text per id list."""


class TEIEmbeddingModel(BaseModel):
    pooling: str


class TEIClassifierModel(BaseModel):
    id2label: dict[str, str]
    label2id: dict[str, int]


class TEIModelType(BaseModel):
    """Exactly one of the three."""

    embedding: TEIEmbeddingModel | None = None
    classifier: TEIClassifierModel | None = None
    reranker: TEIClassifierModel | None = None


class TEIInfo(BaseModel):
    """TEI `GET /info`, from the server's configuration."""

    model_id: str
    model_sha: str | None
    model_dtype: str
    served_model_name: str
    model_type: TEIModelType
    max_concurrent_requests: int
    max_input_length: int
    max_batch_tokens: int
    max_batch_requests: int | None
    max_client_batch_size: int
    auto_truncate: bool
    tokenization_workers: int
    version: str
    sha: str | None
    docker_label: str | None
