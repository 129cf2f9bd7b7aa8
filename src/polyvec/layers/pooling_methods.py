"""Pooling methods: one class per pooling type, holding both of its forms.

A sequence method turns a request's hidden states into one vector, either over whole requests of a packed
batch at once (`pool`) or chunk by chunk across the steps of a chunked prefill (`start` / `update` /
`finish`, carried in a `PoolingState`); both forms give the same vector. A token method picks which token
rows a request returns. Adding a pooling type is one class here, registered in `SEQUENCE_METHODS` or
`TOKEN_METHODS`. Modes follow sentence-transformers' `Pooling` module; CLS/LAST/MEAN/ALL/STEP are vLLM's names.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Any

import torch

from .attention import AttentionMetadata


class PoolingTask(str, Enum):
    """vLLM's pooling tasks (a `str`, so "embed" == PoolingTask.EMBED)."""

    EMBED = "embed"
    TOKEN_EMBED = "token_embed"
    CLASSIFY = "classify"
    TOKEN_CLASSIFY = "token_classify"
    EMBED_SPARSE = "embed_sparse"
    """One sparse vector over the vocabulary per request (SPLADE; polyvec's, not vLLM's)."""

    @property
    def is_sequence(self) -> bool:
        """One output per request (else one per token)."""
        return self in (PoolingTask.EMBED, PoolingTask.CLASSIFY, PoolingTask.EMBED_SPARSE)


class PoolingType(str, Enum):
    CLS = "CLS"
    LAST = "LAST"
    MEAN = "MEAN"
    MAX = "MAX"
    MEAN_SQRT_LEN = "MEAN_SQRT_LEN"
    WEIGHTED_MEAN = "WEIGHTED_MEAN"
    ALL = "ALL"
    STEP = "STEP"


class SequencePooling:
    """One vector per request. `pool` runs on float32 packed hidden [T, H] → [B, H]; the chunked form keeps a
    small state per request (float32) and must equal `pool` on the whole request."""

    type: PoolingType

    def pool(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        raise NotImplementedError

    def start(self) -> Any:
        return None

    def update(self, state: Any, hidden: torch.Tensor, start: int, count: int) -> Any:
        """Fold rows [start, start + len(hidden)) into `state`; `count` is the rows seen before them."""
        raise NotImplementedError

    def finish(self, state: Any, count: int) -> torch.Tensor:
        return state


def _lens(hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Sequence lengths [B, 1] in hidden's dtype."""
    return (meta.cu_seqlens[1:] - meta.cu_seqlens[:-1]).to(hidden.dtype).unsqueeze(1)


def _sums(hidden: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence sums [B, H] and lengths [B, 1]."""
    return hidden.new_zeros(meta.num_seqs, hidden.shape[1]).index_add_(0, meta.seq_ids, hidden), _lens(hidden, meta)


def _add(state: torch.Tensor | None, part: torch.Tensor) -> torch.Tensor:
    return part if state is None else state + part


class ClsPooling(SequencePooling):
    type = PoolingType.CLS

    def pool(self, hidden, meta):
        return hidden.index_select(0, meta.cu_seqlens[:-1])

    def update(self, state, hidden, start, count):
        return hidden[0] if state is None else state  # the first row pooled (after any rows left out)


class LastPooling(SequencePooling):
    type = PoolingType.LAST

    def pool(self, hidden, meta):
        return hidden.index_select(0, meta.cu_seqlens[1:] - 1)

    def update(self, state, hidden, start, count):
        return hidden[-1]


class MeanPooling(SequencePooling):
    type = PoolingType.MEAN

    def pool(self, hidden, meta):
        summed, lens = _sums(hidden, meta)
        return summed / lens

    def update(self, state, hidden, start, count):
        return _add(state, hidden.sum(0))

    def finish(self, state, count):
        return state / count


class MeanSqrtLenPooling(SequencePooling):
    type = PoolingType.MEAN_SQRT_LEN

    def pool(self, hidden, meta):
        summed, lens = _sums(hidden, meta)
        return summed / lens.sqrt()

    def update(self, state, hidden, start, count):
        return _add(state, hidden.sum(0))

    def finish(self, state, count):
        return state / math.sqrt(count)


class WeightedMeanPooling(SequencePooling):
    """Position weights 1..L inside each sequence (sentence-transformers' weightedmean)."""

    type = PoolingType.WEIGHTED_MEAN

    def pool(self, hidden, meta):
        weights = (meta.positions + 1).to(hidden.dtype).unsqueeze(1)
        summed = hidden.new_zeros(meta.num_seqs, hidden.shape[1]).index_add_(0, meta.seq_ids, hidden * weights)
        lens = _lens(hidden, meta)
        return summed / (lens * (lens + 1) / 2)

    def update(self, state, hidden, start, count):
        # weights are positions in the whole sequence, also when its first rows are left out (as in ST)
        weights = torch.arange(start + 1, start + 1 + hidden.shape[0], device=hidden.device, dtype=hidden.dtype)
        summed, total = (hidden * weights.unsqueeze(1)).sum(0), float(weights.sum())
        return (summed, total) if state is None else (state[0] + summed, state[1] + total)

    def finish(self, state, count):
        return state[0] / state[1]


class MaxPooling(SequencePooling):
    type = PoolingType.MAX

    def pool(self, hidden, meta):
        out = hidden.new_empty(meta.num_seqs, hidden.shape[1])
        index = meta.seq_ids.unsqueeze(1).expand_as(hidden)
        return out.scatter_reduce_(0, index, hidden, reduce="amax", include_self=False)

    def update(self, state, hidden, start, count):
        part = hidden.amax(0)
        return part if state is None else torch.maximum(state, part)


class TokenPooling:
    """Which of a request's token rows (and columns) it returns; the head has run on all of them."""

    type: PoolingType

    def select(
        self, rows: torch.Tensor, ids: torch.Tensor, returned_token_ids: tuple[int, ...] | None, step_tag_id: int | None
    ) -> torch.Tensor:
        return rows


class AllPooling(TokenPooling):
    type = PoolingType.ALL


class StepPooling(TokenPooling):
    """Process reward models: keep the step-tag tokens and the asked-for columns."""

    type = PoolingType.STEP

    def select(self, rows, ids, returned_token_ids, step_tag_id):
        if returned_token_ids is not None:
            rows = rows[:, list(returned_token_ids)]
        if step_tag_id is not None:
            rows = rows[ids == step_tag_id]
        return rows


SEQUENCE_METHODS: dict[str, SequencePooling] = {
    m.type.value: m
    for m in (ClsPooling(), LastPooling(), MeanPooling(), MaxPooling(), MeanSqrtLenPooling(), WeightedMeanPooling())
}
TOKEN_METHODS: dict[str, TokenPooling] = {m.type.value: m for m in (AllPooling(), StepPooling())}


def sequence_method(mode: str) -> SequencePooling:
    method = SEQUENCE_METHODS.get(mode)
    if method is None:
        raise ValueError(f"unknown sequence pooling type {mode!r}")
    return method
