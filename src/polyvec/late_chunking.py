"""Late chunking (vLLM 0.34's `LateChunkingParams`): one document is encoded once, in full context, and its
hidden states are mean-pooled per span of `chunk_size` consecutive tokens (special tokens included), each mean
then through the model's token head (projection, `dimensions`, normalization), so every chunk's vector has seen
the whole document. The pooler computes the vectors (`PoolingSpec.chunk_size`); this module checks requests
and maps chunks to the text."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LateChunkingParams:
    chunk_size: int
    """Tokens per chunk (the last chunk may be shorter)."""

    def __post_init__(self) -> None:
        self.verify()

    def verify(self) -> None:
        """Also at use: a chunk_size set after construction is checked too, as vLLM checks it."""
        if type(self.chunk_size) is not int or not 1 <= self.chunk_size < 2**63:
            raise ValueError("chunk_size must be a positive integer less than 2**63")


@dataclass
class LateChunk:
    token_range: tuple[int, int]
    """[start, end) in the prompt's tokens."""
    char_range: tuple[int, int] | None
    """[start, end) in the text; None for a chunk of special tokens only."""


@dataclass
class LateChunkingMetadata:
    chunk_size: int
    input_tokens: int
    chunks: list[LateChunk] = field(default_factory=list)
    strategy: str = "fixed_tokens"  # vLLM's only one


def tokenization_changes(kwargs: dict | None) -> bool:
    """Whether vLLM's `tokenization_kwargs` pad, truncate or lower-case the text (late chunking refuses them)."""
    kwargs = kwargs or {}
    return (
        kwargs.get("truncation") not in (None, False, "do_not_truncate")
        or kwargs.get("padding") not in (None, False, "do_not_pad")
        or kwargs.get("truncate_prompt_tokens") is not None
        or kwargs.get("pad_prompt_tokens") is not None
        or bool(kwargs.get("do_lower_case"))
    )


class LateChunkingError(ValueError):
    """What late chunking cannot take, and the request field it is about (`input` for the prompt itself)."""

    def __init__(self, message: str, field: str = "late_chunking_params"):
        super().__init__(message)
        self.field = field


def check(params, task: str, prompt, *, recipe_edits_tokens: bool, lower_case: bool) -> str:
    """The prompt's text, or LateChunkingError with vLLM's wording for what late chunking cannot take."""
    chunking = params.late_chunking_params
    if not isinstance(chunking, LateChunkingParams):
        raise LateChunkingError(f"late_chunking_params must be LateChunkingParams, got {chunking!r}")
    chunking.verify()
    if task != "token_embed":
        raise LateChunkingError("Late chunking requires token_embed")
    if recipe_edits_tokens:  # marker tokens added, skiplist ones dropped: rows are not the text's tokens
        raise LateChunkingError(
            "Late chunking does not support a ColBERT model's query and document recipe (marker tokens, skiplist)"
        )
    if params.long_input == "window":
        raise LateChunkingError(
            "Late chunking reads the whole document in one pass: no long_input windows", "long_input"
        )
    if params.truncate_prompt_tokens is not None or lower_case:
        raise LateChunkingError(
            "Late chunking does not support input padding, truncation or renderer text normalization",
            "truncate_prompt_tokens" if params.truncate_prompt_tokens is not None else "late_chunking_params",
        )
    text = prompt.get("prompt") if isinstance(prompt, dict) and "multi_modal_data" not in prompt else prompt
    if not isinstance(text, str):
        raise LateChunkingError("Late chunking requires plain-text input", "input")
    if not text:  # whitespace is text (its chunks have no characters: char_range None), as in vLLM
        raise LateChunkingError("Late chunking requires nonempty plain-text input", "input")
    return text


def too_long(num_tokens: int, max_model_len: int) -> str | None:
    """What is wrong with a document of `num_tokens` (None: nothing): it is read whole, never cut nor windowed."""
    if num_tokens <= max_model_len:
        return None
    return (
        f" has {num_tokens} tokens, more than max_model_len={max_model_len}: late chunking reads the whole document "
        "in one pass (no truncation or windows); shorten it or raise max_model_len"
    )


def check_no_prompt(input_processor, text: str, verified_params) -> None:
    """Chunks are spans of the text as sent: a model's instruction prompt (input_type, or its default prompt)
    in front of it is refused, not misaligned."""
    if input_processor._with_prompt(text, verified_params) != text:
        raise ValueError(
            "Late chunking does not support an instruction prompt (this request's input_type or the model's "
            "default_prompt_name): the chunks are spans of the text as sent"
        )


def metadata(
    num_tokens: int, offsets: list[tuple[int, int]], special: list[bool], chunk_size: int
) -> LateChunkingMetadata:
    """Each chunk's token range and its characters in the text (from the tokenizer's offsets)."""
    if len(offsets) != num_tokens:
        raise ValueError("Late chunking requires a fast tokenizer with offsets aligned to all input tokens")
    meta = LateChunkingMetadata(chunk_size, num_tokens)
    for start in range(0, num_tokens, chunk_size):
        end = min(start + chunk_size, num_tokens)
        spans = [offsets[i] for i in range(start, end) if not special[i]]
        chars = (min(a for a, _ in spans), max(b for _, b in spans)) if spans else None
        meta.chunks.append(LateChunk((start, end), chars))
    return meta
