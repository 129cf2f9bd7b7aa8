"""Request outputs with vLLM's class and field names.

Every output keeps its result as a tensor (a view into its batch's result); the list-of-floats fields that
vLLM exposes (`embedding`, `probs`) are built on first access, so a large offline run holds compact tensors.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Any, Generic, TypedDict, TypeVar

import torch

from .late_chunking import LateChunkingMetadata
from .token_codes import TokenCodes


@dataclass
class PoolingOutput:
    data: torch.Tensor
    """embed: [dim]; token_embed: [n_tokens, dim]; classify: [n_labels]; token_classify: [n_tokens, n_labels]."""
    codes: TokenCodes | None = None
    """token_embed with PoolingParams.token_encoding: the codes (and scales); `data` is then `codes.codes`."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, self.__class__) and _same(self.data, other.data)


def _same(a: Any, b: Any) -> bool:
    """vLLM's output equality: every element equal (several tasks' outputs: the same tasks, each equal)."""
    if isinstance(a, dict) or isinstance(b, dict):
        return (
            isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
        )
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and bool((a == b).all())


def _one_dim(output: PoolingOutput, what: str) -> torch.Tensor:
    if not isinstance(output.data, torch.Tensor) or output.data.ndim != 1:
        raise ValueError(f"pooled_data should be a 1-D {what}")
    return output.data


def _vector(values: Any, name: str) -> torch.Tensor:
    """A tensor as given, or vLLM's list of floats as one (its classes are built from lists)."""
    if values is None:
        raise TypeError(f"missing the {name} (a tensor or a list of floats)")
    return values if isinstance(values, torch.Tensor) else torch.as_tensor(values, dtype=torch.float32)


@dataclass
class EmbeddingOutput:
    data: torch.Tensor

    def __init__(self, data: Any = None, *, embedding: Any = None):
        """EmbeddingOutput(tensor), or as vLLM builds it: EmbeddingOutput([floats]) / (embedding=[floats])."""
        self.data = _vector(data if data is not None else embedding, "embedding")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, self.__class__) and _same(self.data, other.data)

    @staticmethod
    def from_base(pooling_output: PoolingOutput) -> EmbeddingOutput:
        return EmbeddingOutput(_one_dim(pooling_output, "embedding vector"))

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

    def __eq__(self, other: object) -> bool:
        return isinstance(other, self.__class__) and _same(self.data, other.data) and self.tokens == other.tokens

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

    def __init__(self, data: Any = None, *, probs: Any = None):
        """ClassificationOutput(tensor), or as vLLM builds it: ClassificationOutput([floats]) / (probs=[floats])."""
        self.data = _vector(data if data is not None else probs, "probs")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, self.__class__) and _same(self.data, other.data)

    @staticmethod
    def from_base(pooling_output: PoolingOutput) -> ClassificationOutput:
        return ClassificationOutput(_one_dim(pooling_output, "probability vector"))

    @property
    def probs(self) -> list[float]:
        return self.data.tolist()

    @property
    def num_classes(self) -> int:
        return int(self.data.shape[-1])


@dataclass
class ScoringOutput:
    score: float

    @staticmethod
    def from_base(pooling_output: PoolingOutput) -> ScoringOutput:
        data = pooling_output.data.squeeze() if isinstance(pooling_output.data, torch.Tensor) else None
        if data is None or data.ndim != 0:
            raise ValueError("pooled_data should be a scalar score")
        return ScoringOutput(float(data.item()))


OutputT = TypeVar("OutputT")


@dataclass
class PoolingRequestOutput(Generic[OutputT]):
    # vLLM's positional order (request_id, outputs, prompt_token_ids, num_cached_tokens, finished), then keywords
    request_id: str
    outputs: OutputT
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    """Leading prompt tokens whose keys and values came from the prefix cache (causal models)."""
    finished: bool = True
    _: KW_ONLY
    num_input_tokens: int = 0
    """Tokens the caller sent, before truncation (equals len(prompt_token_ids) when nothing was cut)."""
    task: str = ""
    input_type: str | None = None
    """ColBERT models: the mode used ("query" or "document")."""
    late_chunking: LateChunkingMetadata | None = None
    """With late_chunking_params: the token and character span of each output row."""
    error: Any = None
    """vLLM's request-level error; always None here (a failed request raises)."""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    @staticmethod
    def from_base(request_output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return EmbeddingRequestOutput(
            outputs=EmbeddingOutput.from_base(request_output.outputs), **_shared(request_output)
        )


class ClassificationRequestOutput(PoolingRequestOutput[ClassificationOutput]):
    @staticmethod
    def from_base(request_output: PoolingRequestOutput) -> ClassificationRequestOutput:
        outputs = ClassificationOutput.from_base(request_output.outputs)
        return ClassificationRequestOutput(outputs=outputs, **_shared(request_output))


class SparseEmbeddingRequestOutput(PoolingRequestOutput[SparseEmbeddingOutput]):
    pass


class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    @staticmethod
    def from_base(request_output: PoolingRequestOutput) -> ScoringRequestOutput:
        return ScoringRequestOutput(outputs=ScoringOutput.from_base(request_output.outputs), **_shared(request_output))


class _SharedFields(TypedDict):
    """The fields `as_task_output` copies from a pooling output to its task's output."""

    request_id: str
    prompt_token_ids: list[int]
    num_input_tokens: int
    num_cached_tokens: int
    finished: bool
    task: str
    input_type: str | None


def _shared(out: PoolingRequestOutput) -> _SharedFields:
    return _SharedFields(
        request_id=out.request_id,
        prompt_token_ids=out.prompt_token_ids,
        num_input_tokens=out.num_input_tokens,
        num_cached_tokens=out.num_cached_tokens,
        finished=out.finished,
        task=out.task,
        input_type=out.input_type,
    )


def as_task_output(out: PoolingRequestOutput[PoolingOutput]) -> PoolingRequestOutput:
    """Re-wrap a generic pooling output as the typed output of its task (embed → Embedding..., ...)."""
    fields = _shared(out)
    if out.task == "embed":
        return EmbeddingRequestOutput(outputs=EmbeddingOutput(out.outputs.data), **fields)
    if out.task == "classify":
        return ClassificationRequestOutput(outputs=ClassificationOutput(out.outputs.data), **fields)
    if out.task == "embed_sparse":
        return SparseEmbeddingRequestOutput(outputs=SparseEmbeddingOutput(out.outputs.data), **fields)
    return out
