"""Request and response bodies, with the field names of OpenAI, vLLM, Jina/Cohere rerank and Cohere embed v2.

Field docstrings are the OpenAPI documentation. Unknown fields are rejected (400, naming the field) rather than
silently ignored, so a typo never changes results; vLLM's scheduling-only fields are accepted and ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

TokenIds = list[Annotated[int, Field(ge=0)]]
PoolingInput = str | list[str] | TokenIds | list[TokenIds]
EncodingFormat = Literal["float", "base64", "bytes", "bytes_only"]
EmbedDType = Literal["float32", "float16", "bfloat16"]
Endianness = Literal["native", "big", "little"]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, protected_namespaces=())


class VLLMCompatFields(StrictModel):
    """Fields vLLM clients may send that change nothing here (scheduling and multimodal hints)."""

    priority: int = 0
    """Accepted for vLLM compatibility; polyvec schedules by arrival and length."""
    request_id: str | None = None
    """Accepted for vLLM compatibility; responses carry their own id."""
    cache_salt: str | None = None
    """Accepted for vLLM compatibility; ignored."""
    mm_processor_kwargs: dict[str, Any] | None = None
    """Accepted for vLLM compatibility; text-only models ignore it."""


class PoolingBase(VLLMCompatFields):
    model: str | None = None
    """Served model name; must match `--served-model-name` when given."""
    user: str | None = None
    """End-user identifier (OpenAI field); recorded nowhere, accepted for compatibility."""
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    """Keep at most this many tokens per input (special tokens included); -1 = the model's maximum."""
    add_special_tokens: bool = True
    """Add the tokenizer's special tokens ([CLS] ... [SEP]) to text inputs."""


class EncodingFields(StrictModel):
    encoding_format: EncodingFormat = "float"
    """float: JSON numbers; base64: base64 of the raw bytes; bytes / bytes_only: an application/octet-stream
    body (bytes adds a `metadata` header with each item's shape, dtype and byte range)."""
    embed_dtype: EmbedDType = "float32"
    """Element type of base64 and bytes outputs."""
    endianness: Endianness = "native"
    """Byte order of base64 and bytes outputs."""


class EmbeddingRequest(PoolingBase, EncodingFields):
    """OpenAI `POST /v1/embeddings`."""

    input: PoolingInput
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    dimensions: Annotated[int, Field(ge=1)] | None = None
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
    """Encoder input longer than the model's maximum: "truncate" it, or split it into "window"s (embed: the
    token-weighted mean of the windows, then normalized; token_embed: one vector per input token). Default:
    the server's --long-input."""
    window_overlap: Annotated[int, Field(ge=0)] | None = None
    """long_input="window": tokens shared by consecutive windows (default: the server's --window-overlap)."""


class PoolingRequest(EmbeddingRequest):
    """vLLM `POST /pooling`: any pooling task."""

    task: Literal["embed", "token_embed", "classify", "token_classify"] | None = None
    """Which output: embed (one vector), token_embed (one vector per token), classify (label probabilities),
    token_classify (per-token label scores). Default: token_embed if the model supports it, else
    token_classify."""
    activation: bool | None = None
    """Older name of use_activation for the classify tasks."""


class ClassificationRequest(PoolingBase):
    """vLLM `POST /classify`."""

    input: PoolingInput
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    use_activation: bool | None = None
    """Apply softmax (sigmoid for one-label or multi-label models); false returns logits."""
    activation: bool | None = None
    """Older name of use_activation."""


ScoreInput = str | list[str]


class ScoreRequest(PoolingBase):
    """vLLM `POST /score`: score text_1 against text_2 (1:1, 1:N, N:N).

    `data_1`/`data_2`, `queries`/`documents` and `queries`/`items` are accepted as the same two sides.
    """

    text_1: ScoreInput | None = None
    """The query side: one text or a list."""
    text_2: ScoreInput | None = None
    """The document side: one text or a list."""
    data_1: ScoreInput | None = None
    data_2: ScoreInput | None = None
    queries: ScoreInput | None = None
    documents: ScoreInput | None = None
    items: ScoreInput | None = None
    use_activation: bool | None = None
    """Cross-encoders: apply the sigmoid/softmax to the logit (default true)."""

    def sides(self) -> tuple[ScoreInput, ScoreInput]:
        pairs = [("text_1", "text_2"), ("data_1", "data_2"), ("queries", "documents"), ("queries", "items")]
        given = [(a, b) for a, b in pairs if getattr(self, a) is not None and getattr(self, b) is not None]
        if not given:
            raise ValueError("text_1 and text_2 are required (or data_1/data_2, queries/documents)")
        a, b = given[0]
        return getattr(self, a), getattr(self, b)


class RerankRequest(PoolingBase):
    """Jina / Cohere rerank: `POST /rerank`, `/v1/rerank`, `/v2/rerank`."""

    query: str
    """The query text."""
    documents: list[str]
    """Documents to order by relevance to the query."""
    top_n: Annotated[int, Field(ge=0)] = 0
    """Return only the best top_n documents (0: all)."""
    return_documents: bool = True
    """Include each document's text in the results."""
    use_activation: bool | None = None
    """Cross-encoders: apply the sigmoid/softmax to the logit (default true)."""


class CohereEmbedRequest(StrictModel):
    """Cohere embed v2: `POST /v2/embed`."""

    model: str | None = None
    """Served model name."""
    texts: list[str]
    """Texts to embed."""
    input_type: str | None = None
    """search_query, search_document, classification or clustering."""
    embedding_types: list[Literal["float", "base64", "binary", "ubinary"]] | None = None
    """Output types to return (default ["float"])."""
    truncate: Literal["NONE", "START", "END"] = "END"
    """END cuts over-long input at the end; NONE rejects it; START is not supported."""
    output_dimension: Annotated[int, Field(ge=1)] | None = None
    """Matryoshka output size."""
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    """Truncate each text to this many tokens."""
    priority: int = 0
    """Accepted for compatibility; ignored."""


class TokenizeRequest(StrictModel):
    model: str | None = None
    prompt: str
    """Text to tokenize."""
    add_special_tokens: bool = True
    """Add the tokenizer's special tokens."""
    return_token_strs: bool = False
    """Also return each token as a string."""


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]
    """Token ids to turn back into text."""


# ---------------------------------------------------------------------------------------------- responses


def usage(tokens: int) -> dict[str, int | None]:
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0, "prompt_tokens_details": None}


def envelope(prefix: str, model: str, data: list[dict[str, Any]], tokens: int) -> dict[str, Any]:
    return {
        "id": random_id(prefix),
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": usage(tokens),
    }
