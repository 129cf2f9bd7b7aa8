"""From packed hidden states to each request's output, for all four pooling tasks in one pass.

Requests of one batch are grouped by what they ask for (task, pooling, dimensions, activation); each group
is pooled and run through its head with a few tensor operations over the whole group, never a Python loop
over tokens. Every output is a view into its group's result tensor.

Head order (as vLLM and sentence-transformers do it): cast to float32 → projection (Dense / classifier) →
Matryoshka truncation → activation (L2 normalize for embed tasks, softmax/sigmoid for classify tasks).
Pooling modes are the methods of `pooling_methods.py` (sentence-transformers' `Pooling` module modes and
vLLM's names); several sequence modes are concatenated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..config import SpladeSpec
from .activation import classifier_activation
from .attention import AttentionMetadata
from .pooling_methods import TOKEN_METHODS, PoolingTask, sequence_method

# embed_sparse: the most tokens whose vocabulary logits exist at once (512 x 30,522 float32: 62 MB).
SPARSE_CHUNK_TOKENS = 512


@dataclass(frozen=True)
class PoolingSpec:
    """What one request of a batch wants from the pooler."""

    task: str
    pooling: tuple[str, ...]  # sequence modes to concatenate, or ("ALL",) / ("STEP",)
    dimensions: int | None = None
    use_activation: bool = True
    step_tag_id: int | None = None
    returned_token_ids: tuple[int, ...] | None = None
    raw: bool = False  # return the pooled vector without the head (a long input's window; see engine/long_input.py)
    skip_first: int = 0  # sequence pooling leaves out the first tokens (include_prompt: false: the prompt's)
    sparse_top_k: int | None = None
    sparse_threshold: float | None = None
    chunk_size: int | None = None  # late chunking: every row (special tokens too) averaged per chunk, then the head
    first_kept: bool = False  # a window inside a text: bge-m3 keeps its first row, whatever token it is
    splade_ends: tuple[int | None, int | None] | None = None  # vLLM's SPLADE embed: first / last ids left out


def seq_pool(mode: str, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """One vector per sequence from float32 packed `hidden` [T, H] → [B, H]."""
    return sequence_method(mode).pool(hidden, meta)


class Pooler(nn.Module):
    """Pools packed hidden states and applies each task's head.

    `embed_projection`: sentence-transformers Dense stack applied to pooled vectors (embed).
    `token_projection`: projection applied to every token (token_embed; ColBERT's linear layer).
    `sequence_head` / `token_head`: the model's classifier for classify / token_classify.
    """

    def __init__(
        self,
        *,
        embed_projection: nn.Module | None = None,
        token_projection: nn.Module | None = None,
        sequence_head: nn.Module | None = None,
        token_head: nn.Module | None = None,
        classifier_activation_name: str = "softmax",
        splade: SpladeSpec | None = None,
        sparse_head: nn.Module | None = None,
        sparse_skip_ids: tuple[int, ...] = (),
        token_drop_first: int | None = None,
        sparse_filter_ids: tuple[int | None, int | None] = (None, None),
        vocab_size: int | None = None,
        logit_mean: float | None = None,
        logit_sigma: float | None = None,
        device: torch.device | None = None,
    ):
        super().__init__()
        self.device = device or torch.device("cpu")  # where the heads' weights are
        self.embed_projection = embed_projection
        self.token_projection = token_projection
        self.sequence_head = sequence_head
        self.token_head = token_head
        self.classifier_activation_name = classifier_activation_name
        self.classifier_act = classifier_activation(classifier_activation_name)
        self.splade = splade or SpladeSpec()
        self.sparse_head = sparse_head  # bge-m3: one weight per token, [T, H] → [T, 1]
        self.sparse_skip_ids = sparse_skip_ids
        self.token_drop_first = token_drop_first  # bge-m3's token vectors leave out a first token of this id
        # bge-m3's token_classify (vLLM's BOSEOSFilter): a leading BOS and a trailing EOS row left out
        self.sparse_filter_ids = sparse_filter_ids
        self.vocab_size: int | None = vocab_size
        self.logit_mean = logit_mean  # classifier calibration (vLLM's PoolerConfig): (logit - mean) / sigma
        self.logit_sigma = logit_sigma

    def apply_head(self, spec: PoolingSpec, pooled: torch.Tensor) -> torch.Tensor:
        """The head of a sequence task on one pooled vector [H] (combined long-input windows, which come back
        from the device): run on the heads' device, where the result stays."""
        return self._head(spec, pooled.to(self.device).unsqueeze(0)).squeeze(0)

    def _head(self, spec: PoolingSpec, x: torch.Tensor) -> torch.Tensor:
        if spec.raw:
            return x
        task = spec.task
        if task == "embed" or task == "token_embed":
            proj = self.embed_projection if task == "embed" else self.token_projection
            if proj is not None:
                x = proj(x)
            if spec.dimensions is not None:
                x = x[..., : spec.dimensions]
            return F.normalize(x, p=2, dim=-1) if spec.use_activation else x
        head = self.sequence_head if task == "classify" else self.token_head
        if head is None and task == "token_classify" and self.sparse_head is not None:
            x = self.sparse_head(x).squeeze(-1)  # bge-m3: [T, H] → [T], a lexical weight per token
            return torch.relu(x) if spec.use_activation else x
        assert head is not None  # verified params name a task the model supports, so it has the head
        x = head(x)
        if self.logit_mean is not None:
            x = x - self.logit_mean
        if self.logit_sigma is not None:
            x = x / self.logit_sigma
        return self.classifier_act(x) if spec.use_activation else x

    def forward(
        self,
        hidden: torch.Tensor,
        meta: AttentionMetadata,
        input_ids: torch.Tensor,
        specs: list[PoolingSpec | None],
        keep: list[list[int] | None] | None = None,
    ) -> list[torch.Tensor | None]:
        """`keep[i]`: positions of request i's token outputs to return (ColBERT drops skiplist tokens).
        A `None` spec skips that sequence (a chunk whose pooling is carried in a `PoolingState`)."""
        results: list[torch.Tensor | None] = [None] * len(specs)
        groups: dict[PoolingSpec, list[int]] = {}
        for i, spec in enumerate(specs):
            if spec is not None:
                groups.setdefault(spec, []).append(i)
        if not groups:  # every sequence is a chunk pooled through its PoolingState
            return results
        hidden = hidden.float()
        pooled_cache: dict[str, torch.Tensor] = {}

        for spec, members in groups.items():
            if spec.task == "embed_sparse" or spec.splade_ends is not None:
                out = self._sparse(spec, hidden, meta, members, input_ids)
                for row, i in enumerate(members):
                    results[i] = out[row]
                continue
            if spec.task in ("embed", "classify") and spec.skip_first:
                starts = meta.cu_seqlens.tolist()
                pooled = torch.stack([pool_rows(spec, hidden[starts[i] : starts[i + 1]]) for i in members])
            elif spec.task in ("embed", "classify"):
                parts = []
                for mode in spec.pooling:
                    if mode not in pooled_cache:
                        pooled_cache[mode] = seq_pool(mode, hidden, meta)
                    parts.append(pooled_cache[mode])
                pooled = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
                if len(members) != meta.num_seqs:
                    pooled = pooled.index_select(0, torch.tensor(members, device=pooled.device))
            if spec.task in ("embed", "classify"):
                out = self._head(spec, pooled)
                for row, i in enumerate(members):
                    results[i] = out[row]
                continue

            starts = meta.cu_seqlens.tolist()
            if spec.chunk_size is not None:  # one head call on the chunk means of the group, as on its tokens
                means = [chunk_means(hidden[starts[i] : starts[i + 1]], spec.chunk_size) for i in members]
                out = self._head(spec, torch.cat(means))
                for i, piece in zip(members, out.split([len(m) for m in means])):
                    results[i] = piece
                continue
            if len(members) == meta.num_seqs:
                tokens = hidden
            else:
                tokens = torch.cat([hidden[starts[i] : starts[i + 1]] for i in members])
            out = self._head(_logits_first(spec), tokens)
            lens = [meta.seq_lens[i] for i in members]
            filtered = spec.task == "token_classify" and self.sparse_head is not None and self.token_head is None
            for i, piece in zip(members, out.split(lens)):
                ids = input_ids[starts[i] : starts[i + 1]]
                drop = self.drops_first(spec, ids)
                ids, piece = ids[drop:], piece[drop:]
                if filtered:
                    piece, ids = self._filter_bos_eos(piece, ids)
                results[i] = self._select(piece, ids, spec, keep[i] if keep is not None else None)
        return results

    def _after_select(self, spec: PoolingSpec, rows: torch.Tensor) -> torch.Tensor:
        """The activation of asked-for columns (returned_token_ids), over those columns only, as vLLM applies it:
        softmax, or a sigmoid where one column is left."""
        if _logits_first(spec) is spec:
            return rows
        if self.classifier_activation_name == "softmax" and rows.shape[-1] == 1:
            return torch.sigmoid(rows)
        return self.classifier_act(rows)

    def drops_first(self, spec: PoolingSpec, ids: Sequence[int] | torch.Tensor) -> int:
        """1 where a token task's output leaves out the input's first row (bge-m3's leading <s>), else 0."""
        first = self.token_drop_first
        if first is None or spec.task != "token_embed" or spec.first_kept or not len(ids):
            return 0
        return int(int(ids[0]) == first)

    def _filter_bos_eos(self, piece: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bos, eos = self.sparse_filter_ids
        if len(ids) and bos is not None and int(ids[0]) == bos:
            piece, ids = piece[1:], ids[1:]
        if len(ids) and eos is not None and int(ids[-1]) == eos:
            piece, ids = piece[:-1], ids[:-1]
        return piece, ids

    def _sparse(
        self, spec: PoolingSpec, hidden: torch.Tensor, meta: AttentionMetadata, members: list[int], input_ids
    ) -> torch.Tensor:
        """SPLADE: act(token_head(h)) pooled (max or sum) over each request's tokens → [len(members), vocab].
        The vocabulary logits are made for at most SPARSE_CHUNK_TOKENS tokens at a time, never for the batch."""
        if self.sparse_head is not None:
            return self._token_weights(spec, hidden, meta, members, input_ids)
        head = self.token_head
        assert head is not None  # embed_sparse is a masked-LM task
        starts = meta.cu_seqlens.tolist()
        amax = self.splade.pooling == "max"
        rows: list[torch.Tensor] = []
        pending: list[tuple[int, int]] = []  # (start, end) of whole sequences gathered into one chunk

        def flush() -> None:
            if not pending:
                return
            gaps = any(a[1] != b[0] for a, b in zip(pending, pending[1:]))  # vLLM's SPLADE leaves tokens out
            rows_in = torch.cat([hidden[b:e] for b, e in pending]) if gaps else hidden[pending[0][0] : pending[-1][1]]
            logits = head(rows_in).float()  # [chunk, V]
            lens = [e - b for b, e in pending]
            if amax:  # the activation is monotone: act(max) = max(act), on [B, V] instead of [chunk, V]
                # (amax per sequence slice: torch.segment_reduce is far slower on CPU, see RESULTS.md, SPLADE)
                rows.extend(self._splade_act(torch.stack([p.amax(0) for p in logits.split(lens)])).unbind(0))
            else:
                rows.extend(p.sum(0) for p in self._splade_act(logits).split(lens))
            pending.clear()

        for i in members:
            begin, end = starts[i], starts[i + 1]
            if spec.splade_ends is not None:  # vLLM's: [CLS] and [SEP] (by config.json's ids) left out
                first, last = spec.splade_ends
                begin += int(first is not None and int(input_ids[begin]) == first)
                end -= int(last is not None and end > begin and int(input_ids[end - 1]) == last)
            if end <= begin:  # nothing left: zeros, as vLLM gives
                flush()
                assert self.vocab_size is not None  # a masked LM's config names its vocabulary
                rows.append(hidden.new_zeros(self.vocab_size))
                continue
            if end - begin > SPARSE_CHUNK_TOKENS:  # one long sequence: its own chunks, reduced as they come
                flush()
                acc = None
                for b in range(begin, end, SPARSE_CHUNK_TOKENS):
                    logits = head(hidden[b : min(end, b + SPARSE_CHUNK_TOKENS)]).float()
                    part = logits.amax(0) if amax else self._splade_act(logits).sum(0)
                    acc = part if acc is None else (torch.maximum(acc, part) if amax else acc + part)
                assert acc is not None
                rows.append(self._splade_act(acc) if amax else acc)
                continue
            if pending and end - pending[0][0] > SPARSE_CHUNK_TOKENS:
                flush()
            pending.append((begin, end))
        flush()
        return self._prune(spec, torch.stack(rows))

    def _token_weights(
        self, spec: PoolingSpec, hidden: torch.Tensor, meta: AttentionMetadata, members: list[int], input_ids
    ) -> torch.Tensor:
        """bge-m3: relu(sparse_head(h)) per token, special tokens left out, the largest weight per vocabulary id."""
        assert self.sparse_head is not None and self.token_head is None
        vocab = int(input_ids.max()) + 1 if self.vocab_size is None else self.vocab_size
        weights = torch.relu(self.sparse_head(hidden)).squeeze(-1)  # [T]
        if self.sparse_skip_ids:
            skip = torch.tensor(self.sparse_skip_ids, device=input_ids.device)
            weights = weights.masked_fill(torch.isin(input_ids, skip), 0.0)
        out = hidden.new_zeros(meta.num_seqs * vocab)  # weights are >= 0: a zero start keeps the maxima
        out.scatter_reduce_(0, meta.seq_ids * vocab + input_ids, weights, "amax")
        out = out.view(meta.num_seqs, vocab)
        if len(members) != meta.num_seqs:
            out = out.index_select(0, torch.tensor(members, device=out.device))
        return self._prune(spec, out)

    def _prune(self, spec: PoolingSpec, out: torch.Tensor) -> torch.Tensor:
        return prune_sparse(spec, out)

    def _splade_act(self, logits: torch.Tensor) -> torch.Tensor:
        x = logits.float().relu().log1p_()
        return x.log1p_() if self.splade.activation == "log1p_relu" else x

    def finish(self, state: PoolingState, keep: list[int] | None = None) -> torch.Tensor:
        """The output of a request whose chunks went through `state`: equal to pooling it in one piece."""
        spec = state.spec
        if spec.task in ("embed", "classify"):
            return self.apply_head(spec, state.vector())
        if spec.chunk_size is not None:
            return self._head(spec, chunk_means(torch.cat(state.tokens), spec.chunk_size))
        return self._select(self._head(_logits_first(spec), torch.cat(state.tokens)), torch.cat(state.ids), spec, keep)

    def _select(
        self, piece: torch.Tensor, ids: torch.Tensor, spec: PoolingSpec, keep: list[int] | None
    ) -> torch.Tensor:
        """A token task's rows to return: its token method's selection (then the activation of the asked-for
        columns), then the ColBERT skiplist's `keep`."""
        piece = TOKEN_METHODS[spec.pooling[0]].select(piece, ids, spec.returned_token_ids, spec.step_tag_id)
        piece = self._after_select(spec, piece)
        return piece[keep] if keep is not None else piece


class PoolingState:
    """A request's pooling carried across the chunks of a chunked prefill (float32).

    Sequence tasks keep one small state per pooling method (`SequencePooling.update`); token tasks (ALL,
    STEP) keep every chunk's rows, and the head runs once on all of them at the end (`Pooler.finish`).
    """

    def __init__(self, spec: PoolingSpec):
        self.spec = spec
        self.count = 0
        self.end = 0  # rows [0, end) of the request are in
        self.states: dict[str, Any] = (
            {mode: sequence_method(mode).start() for mode in spec.pooling} if PoolingTask(spec.task).is_sequence else {}
        )
        self.tokens: list[torch.Tensor] = []
        self.ids: list[torch.Tensor] = []

    def update(self, hidden: torch.Tensor, ids: torch.Tensor, start: int) -> None:
        """Add rows [start, start + len(hidden)) of the request (float32 hidden states), unless they are in
        already: a batch that failed after pooling runs again, one request at a time."""
        if start < self.end:
            return
        self.end = start + hidden.shape[0]
        if not PoolingTask(self.spec.task).is_sequence:
            self.tokens.append(hidden)
            self.ids.append(ids)
            return
        if start < self.spec.skip_first:  # rows of the instruction prompt (include_prompt: false)
            hidden, start = hidden[self.spec.skip_first - start :], self.spec.skip_first
            if not len(hidden):
                return
        for mode, state in self.states.items():
            self.states[mode] = sequence_method(mode).update(state, hidden, start, self.count)
        self.count += hidden.shape[0]

    def pooled(self, mode: str) -> torch.Tensor:
        return sequence_method(mode).finish(self.states[mode], self.count)

    def vector(self) -> torch.Tensor:
        """The sequence task's pooled vector: its modes' vectors, concatenated."""
        parts = [self.pooled(mode) for mode in self.spec.pooling]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def chunk_means(rows: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[T, H] float32 rows → [ceil(T / chunk_size), H]: the mean of each run of chunk_size rows (the last may be
    shorter)."""
    return torch.stack([part.mean(0) for part in rows.split(chunk_size)])


def pool_rows(spec: PoolingSpec, rows: torch.Tensor) -> torch.Tensor:
    """A sequence task's pooled vector of one request's float32 rows [L, H], from row `spec.skip_first` on."""
    state = PoolingState(spec)
    state.update(rows, rows.new_empty(0), 0)
    return state.vector()


def prune_sparse(spec: PoolingSpec, out: torch.Tensor) -> torch.Tensor:
    """embed_sparse's per-request pruning of [N, vocab] weights: the threshold, then the top k."""
    if spec.sparse_threshold is not None:
        out = torch.where(out >= spec.sparse_threshold, out, torch.zeros_like(out))
    if spec.sparse_top_k is not None and spec.sparse_top_k < out.shape[1]:
        kth = out.topk(spec.sparse_top_k, dim=1).values[:, -1:]
        out = torch.where(out >= kth, out, torch.zeros_like(out))
    return out


def _logits_first(spec: PoolingSpec) -> PoolingSpec:
    """The spec a token head runs with: without its activation where columns are picked after it (token_classify
    with returned_token_ids), which then runs over the picked columns."""
    if spec.task == "token_classify" and spec.returned_token_ids is not None and spec.use_activation:
        return dataclasses.replace(spec, use_activation=False)
    return spec
