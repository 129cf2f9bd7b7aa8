"""Attention over packed (padding-free) sequences: bidirectional (encoders) and causal with a KV cache.

The model sees one flat `[num_tokens, hidden]` tensor for the whole batch; `cu_seqlens` marks where each
sequence starts (the FlashAttention varlen convention). On CPU, polyvec's native kernel (layers/kernels.py)
computes bidirectional attention straight from that flat layout. Elsewhere (CUDA, or where the kernel cannot
be built), for the attention product alone, the tokens are
scattered into a `[batch, max_len]` grid with a key mask so that no token attends across sequences, and
gathered back afterwards. The scheduler groups requests of similar length, so the grid wastes little; a
batch of one sequence, or of equal-length sequences, needs no mask at all and takes SDPA's fastest path.
Everything outside attention (projections, MLPs, norms) runs on the flat tensor with no padding.

Causal attention (decoders) runs per sequence: a chunk of a long prompt attends to the keys and values of
its earlier chunks, kept in the request's `KVCache` (chunked prefill), and to its own tokens causally
(the "bottom-right" causal mask of a query block that starts `context_len` tokens into the sequence).
Decoder matmuls dwarf the per-sequence loop's overhead, and each sequence's result cannot depend on the
rest of the batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from . import kernels


@dataclass
class AttentionMetadata:
    seq_lens: list[int]
    cu_seqlens: torch.Tensor  # [B + 1] int64
    positions: torch.Tensor  # [T] position of each token inside its sequence (0-based)
    seq_ids: torch.Tensor  # [T] which sequence each token belongs to
    max_seqlen: int
    scatter_index: torch.Tensor | None  # [T] row of each token in the [B * max_seqlen] grid; None: no grid
    key_mask: torch.Tensor | None  # [B, 1, 1, max_seqlen] True where a key is real; None: all real
    pad_index: torch.Tensor | None = None  # grid rows no token fills (zeroed, so masked keys stay finite)
    context_lens: list[int] | None = None  # causal: tokens of each sequence already in its KV cache
    kv_caches: list[KVCache | None] | None = None  # causal: where each sequence's keys/values go
    # Bidirectional attention by polyvec's native kernel straight on the packed batch (no grid, no mask);
    # then `key_lens` holds each sequence's attended keys when some are fewer than its tokens.
    packed: bool = False
    key_lens: torch.Tensor | None = None
    images: Any = None  # models.colqwen2.ImageBatch: a multimodal batch's images and rotary positions

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @classmethod
    def build_causal(
        cls, seq_lens: list[int], context_lens: list[int], kv_caches: list[KVCache | None], device: torch.device
    ) -> AttentionMetadata:
        """A batch of chunks: chunk i has `seq_lens[i]` new tokens after `context_lens[i]` cached ones, so its
        positions start at `context_lens[i]`."""
        lens = torch.tensor(seq_lens, dtype=torch.long)
        cu = torch.zeros(len(seq_lens) + 1, dtype=torch.long)
        torch.cumsum(lens, 0, out=cu[1:])
        offsets = torch.tensor(context_lens, dtype=torch.long) - cu[:-1]
        positions = torch.arange(int(cu[-1])) + offsets.repeat_interleave(lens)
        return cls(
            seq_lens=list(seq_lens),
            cu_seqlens=cu.to(device),
            positions=positions.to(device),
            seq_ids=torch.repeat_interleave(torch.arange(len(seq_lens)), lens).to(device),
            max_seqlen=max(seq_lens),
            scatter_index=None,
            key_mask=None,
            context_lens=list(context_lens),
            kv_caches=list(kv_caches),
        )

    @classmethod
    def build(
        cls, seq_lens: list[int], device: torch.device, key_lens: list[int] | None = None, packed: bool = False
    ) -> AttentionMetadata:
        """`key_lens[i]` < `seq_lens[i]`: the sequence's last tokens are computed but no token attends to them
        (ColBERT's query expansion [MASK]s when the checkpoint does not attend to them). `packed`: attention
        runs on the packed batch (layers/kernels.py), so no grid or mask is built."""
        lens = torch.tensor(seq_lens, dtype=torch.long)
        cu = torch.zeros(len(seq_lens) + 1, dtype=torch.long)
        torch.cumsum(lens, 0, out=cu[1:])
        total = int(cu[-1])
        seq_ids = torch.repeat_interleave(torch.arange(len(seq_lens)), lens)
        positions = torch.arange(total) - cu[:-1].repeat_interleave(lens)
        max_len = max(seq_lens)
        keys = lens if key_lens is None else torch.tensor(key_lens, dtype=torch.long)
        partial_keys = key_lens is not None and any(k < n for k, n in zip(key_lens, seq_lens))
        scatter = mask = pad = packed_keys = None
        if packed:
            packed_keys = keys.to(device) if partial_keys else None
        elif len(seq_lens) > 1 or partial_keys:
            rows = seq_ids * max_len + positions
            scatter = rows.to(device)
            if min(seq_lens) != max_len or partial_keys:
                mask = (torch.arange(max_len)[None, :] < keys[:, None]).view(len(seq_lens), 1, 1, max_len)
                mask = mask.to(device)
                filled = torch.zeros(len(seq_lens) * max_len, dtype=torch.bool)
                filled[rows] = True
                pad = (~filled).nonzero().squeeze(1).to(device)
        return cls(
            seq_lens=list(seq_lens),
            cu_seqlens=cu.to(device),
            positions=positions.to(device),
            seq_ids=seq_ids.to(device),
            max_seqlen=max_len,
            scatter_index=scatter,
            key_mask=mask,
            pad_index=pad,
            packed=packed,
            key_lens=packed_keys,
        )

    def first(self, num_seqs: int) -> AttentionMetadata:
        """The metadata of the batch's first `num_seqs` sequences (a packed batch without its dummy tail)."""
        assert self.packed and self.context_lens is None, "only a packed bidirectional batch can be cut"
        lens = self.seq_lens[:num_seqs]
        total = sum(lens)
        return AttentionMetadata(
            seq_lens=lens,
            cu_seqlens=self.cu_seqlens[: num_seqs + 1],
            positions=self.positions[:total],
            seq_ids=self.seq_ids[:total],
            max_seqlen=max(lens),
            scatter_index=None,
            key_mask=None,
            packed=True,
            key_lens=None if self.key_lens is None else self.key_lens[:num_seqs],
        )

    def attn_mask(self, bias: torch.Tensor | None = None) -> torch.Tensor | None:
        """The mask SDPA gets: the key mask, plus an additive `[1, heads, L, L]` bias when the model has one.
        The packed kernel takes the bias alone (it applies key lengths itself)."""
        if self.packed:
            return bias
        if bias is None:
            return self.key_mask
        if self.key_mask is None:
            return bias
        return bias.masked_fill(~self.key_mask, float("-inf"))


def varlen_attention(
    qkv: torch.Tensor,
    meta: AttentionMetadata,
    num_heads: int,
    attn_mask: torch.Tensor | None,
    window: int | None = None,
) -> torch.Tensor:
    """softmax(q kᵀ/√d + mask) v per sequence, for fused `qkv` of shape [T, 3 * hidden] → [T, hidden];
    `window`: each query attends only to keys at most this many positions away (bidirectional sliding window)."""
    if meta.packed:  # `attn_mask` is then the model's additive bias by position, or None
        return kernels.varlen_attention(qkv, meta.cu_seqlens, num_heads, meta.key_lens, attn_mask, window)
    total, three_h = qkv.shape
    hidden = three_h // 3
    head_dim = hidden // num_heads
    if window is not None and meta.max_seqlen > window + 1:
        attn_mask = _with_window(attn_mask, meta.max_seqlen, window, qkv.device)
    if meta.scatter_index is None:
        q, k, v = qkv.view(1, total, 3, num_heads, head_dim).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return out.transpose(1, 2).reshape(total, hidden)
    batch, max_len = meta.num_seqs, meta.max_seqlen
    # Only the padding rows need zeros (a masked key's weight is 0, but 0 * NaN garbage would not be).
    grid = qkv.new_empty(batch * max_len, three_h)
    grid.index_copy_(0, meta.scatter_index, qkv)
    if meta.pad_index is not None and meta.pad_index.numel():
        grid.index_fill_(0, meta.pad_index, 0)
    q, k, v = grid.view(batch, max_len, 3, num_heads, head_dim).permute(2, 0, 3, 1, 4)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    return out.transpose(1, 2).reshape(batch * max_len, hidden).index_select(0, meta.scatter_index)


def _with_window(mask: torch.Tensor | None, length: int, window: int, device: torch.device) -> torch.Tensor:
    """SDPA's mask with the sliding window added: [L, L] True where |query - key| <= window."""
    pos = torch.arange(length, device=device)
    near = (pos[:, None] - pos[None, :]).abs() <= window  # [L, L]
    if mask is None:
        return near
    if mask.dtype == torch.bool:
        return mask & near
    return mask.masked_fill(~near, float("-inf"))


class KVCache:
    """Keys and values of one request's tokens for every layer, kept across the chunks of its prefill.

    Allocated for the request's whole length when it starts (the scheduler reserved that many tokens of
    the engine's KV budget) and dropped when it finishes.
    """

    def __init__(
        self,
        num_layers: int,
        num_tokens: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.k = torch.empty(num_layers, num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)


# Query rows per SDPA call when a chunk attends to cached context: bounds the [rows, keys] mask and scores.
_QUERY_BLOCK = 1024


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
    layer: int,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention per sequence for q [T, Hq, d], k/v [T, Hkv, d] (grouped-query when Hkv < Hq).

    New keys/values are written into each sequence's KV cache (when it has one) at its context offset, and
    its queries attend to all cached keys before them plus its own tokens up to themselves.
    """
    out = torch.empty_like(q)
    starts = [0, *itertools.accumulate(meta.seq_lens)]
    contexts = meta.context_lens or [0] * meta.num_seqs
    caches = meta.kv_caches or [None] * meta.num_seqs
    for i, n in enumerate(meta.seq_lens):
        s, ctx, cache = starts[i], contexts[i], caches[i]
        ki, vi = k[s : s + n], v[s : s + n]
        if cache is not None:
            cache.k[layer, ctx : ctx + n] = ki
            cache.v[layer, ctx : ctx + n] = vi
            ki, vi = cache.k[layer, : ctx + n], cache.v[layer, : ctx + n]
        elif ctx:
            raise ValueError("a chunk with context needs its sequence's KV cache")
        qi = q[s : s + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, d]
        ki, vi = ki.transpose(0, 1).unsqueeze(0), vi.transpose(0, 1).unsqueeze(0)
        out[s : s + n] = _causal_sdpa(qi, ki, vi, ctx, sliding_window)[0].transpose(0, 1)
    return out


# The CPU flash-attention kernel behind SDPA; it also returns each row's log-sum-exp.
_FLASH_CPU: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = getattr(
    torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None
)


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: int, window: int | None) -> torch.Tensor:
    n = q.shape[2]
    if ctx == 0 and (window is None or n <= window):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    if window is None and q.device.type == "cpu" and _FLASH_CPU is not None:
        return _context_then_causal(q, k, v, ctx)
    parts = []
    for r0 in range(0, n, _QUERY_BLOCK):
        r1 = min(n, r0 + _QUERY_BLOCK)
        rows = torch.arange(ctx + r0, ctx + r1, device=q.device).unsqueeze(1)  # absolute query positions
        cols = torch.arange(ctx + r1, device=q.device).unsqueeze(0)
        mask = cols <= rows
        if window is not None:
            mask &= cols > rows - window
        parts.append(
            F.scaled_dot_product_attention(
                q[:, :, r0:r1], k[:, :, : ctx + r1], v[:, :, : ctx + r1], attn_mask=mask, enable_gqa=True
            )
        )
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def _context_then_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: int) -> torch.Tensor:
    """A chunk after `ctx` cached tokens, without a mask: every query sees all cached keys (one unmasked
    pass, the query heads of a KV group stacked as rows so keys are not repeated) and the chunk's own keys
    causally (a top-left causal pass); the two softmaxes are merged with their log-sum-exps. No [rows, keys]
    mask is built, and the result is exact to float rounding."""
    flash = _FLASH_CPU
    assert flash is not None  # the only caller checks
    _, heads, n, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    o1, l1 = flash(q.reshape(1, kv_heads, group * n, dim), k[:, :, :ctx], v[:, :, :ctx])
    k_new, v_new = k[:, :, ctx:], v[:, :, ctx:]
    if group > 1:
        k_new, v_new = k_new.repeat_interleave(group, 1), v_new.repeat_interleave(group, 1)
    o2, l2 = flash(q, k_new, v_new, is_causal=True)
    l1, l2 = l1.reshape(1, heads, n, 1).float(), l2.reshape(1, heads, n, 1).float()
    lse = torch.logaddexp(l1, l2)
    out = o1.reshape(1, heads, n, dim).float() * torch.exp(l1 - lse) + o2.float() * torch.exp(l2 - lse)
    return out.to(q.dtype)
