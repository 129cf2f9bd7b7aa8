"""Request outputs with vLLM's class and field names.

Every output keeps its result as a tensor (a view into its batch's result); the list-of-floats fields that
vLLM exposes (`embedding`, `probs`) are built on first access, so a large offline run holds compact tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypedDict, TypeVar

import torch

from .late_chunking import LateChunkingMetadata
from .token_codes import TokenCodes


@dataclass
class PoolingOutput:
    data: torch.Tensor
    """embed: [dim]; token_embed: [n_tokens, dim]; classify: [n_labels]; token_classify: [n_tokens, n_labels]."""
    codes: TokenCodes | None = None
    """token_embed with PoolingParams.token_encoding: the codes (and scales); `data` is then `codes.codes`."""


@dataclass
class EmbeddingOutput:
    data: torch.Tensor

    @property
    def embedding(self) -> list[float]:
        return self.data.tolist()

    @property
    def hidden_size(self) -> int:
        return int(self.data.shape[-1])


@dataclass
class SparseEmbeddingOutput:
    """embed_sparse: the non-zero weights of a vocabulary-sized vector, by ascending vocabulary id."""

    data: torch.Tensor
    """The whole vector [vocab] (float32)."""
    tokens: list[str] | None = None
    """With return_tokens: the vocabulary string of each index."""

    @property
    def indices(self) -> list[int]:
        return self.data.nonzero().squeeze(1).tolist()

    @property
    def values(self) -> list[float]:
        return self.data[self.data != 0].tolist()

    @property
    def dim(self) -> int:
        return int(self.data.shape[-1])


@dataclass
class ClassificationOutput:
    data: torch.Tensor

    @property
    def probs(self) -> list[float]:
        return self.data.tolist()

    @property
    def num_classes(self) -> int:
        return int(self.data.shape[-1])


@dataclass
class ScoringOutput:
    score: float


OutputT = TypeVar("OutputT")


@dataclass
class PoolingRequestOutput(Generic[OutputT]):
    request_id: str
    outputs: OutputT
    prompt_token_ids: list[int]
    num_input_tokens: int = 0
    """Tokens the caller sent, before truncation (equals len(prompt_token_ids) when nothing was cut)."""
    num_cached_tokens: int = 0
    """Leading prompt tokens whose keys and values came from the prefix cache (causal models)."""
    finished: bool = True
    task: str = ""
    input_type: str | None = None
    """ColBERT models: the mode used ("query" or "document")."""
    late_chunking: LateChunkingMetadata | None = None
    """With late_chunking_params: the token and character span of each output row."""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    pass


class ClassificationRequestOutput(PoolingRequestOutput[ClassificationOutput]):
    pass


class SparseEmbeddingRequestOutput(PoolingRequestOutput[SparseEmbeddingOutput]):
    pass


class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    pass


class _SharedFields(TypedDict):
    """The fields `as_task_output` copies from a pooling output to its task's output."""

    request_id: str
    prompt_token_ids: list[int]
    num_input_tokens: int
    num_cached_tokens: int
    finished: bool
    task: str
    input_type: str | None


def as_task_output(out: PoolingRequestOutput[PoolingOutput]) -> PoolingRequestOutput:
    """Re-wrap a generic pooling output as the typed output of its task (embed → Embedding..., ...)."""
    fields = _SharedFields(
        request_id=out.request_id,
        prompt_token_ids=out.prompt_token_ids,
        num_input_tokens=out.num_input_tokens,
        num_cached_tokens=out.num_cached_tokens,
        finished=out.finished,
        task=out.task,
        input_type=out.input_type,
    )
    if out.task == "embed":
        return EmbeddingRequestOutput(outputs=EmbeddingOutput(out.outputs.data), **fields)
    if out.task == "classify":
        return ClassificationRequestOutput(outputs=ClassificationOutput(out.outputs.data), **fields)
    if out.task == "embed_sparse":
        return SparseEmbeddingRequestOutput(outputs=SparseEmbeddingOutput(out.outputs.data), **fields)
    return out
