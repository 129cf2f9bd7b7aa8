"""Bidirectional attention over packed (padding-free) sequences.

The model sees one flat `[num_tokens, hidden]` tensor for the whole batch; `cu_seqlens` marks where each
sequence starts (the FlashAttention varlen convention). For the attention product alone, the tokens are
scattered into a `[batch, max_len]` grid with a key mask so that no token attends across sequences, and
gathered back afterwards. The scheduler groups requests of similar length, so the grid wastes little; a
batch of one sequence, or of equal-length sequences, needs no mask at all and takes SDPA's fastest path.
Everything outside attention (projections, MLPs, norms) runs on the flat tensor with no padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    seq_lens: list[int]
    cu_seqlens: torch.Tensor  # [B + 1] int64
    positions: torch.Tensor  # [T] position of each token inside its sequence (0-based)
    seq_ids: torch.Tensor  # [T] which sequence each token belongs to
    max_seqlen: int
    scatter_index: torch.Tensor | None  # [T] row of each token in the [B * max_seqlen] grid; None: no grid
    key_mask: torch.Tensor | None  # [B, 1, 1, max_seqlen] True where a key is real; None: all real

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @classmethod
    def build(cls, seq_lens: list[int], device: torch.device,
              key_lens: list[int] | None = None) -> "AttentionMetadata":
        """`key_lens[i]` < `seq_lens[i]`: the sequence's last tokens are computed but no token attends to them
        (ColBERT's query expansion [MASK]s when the checkpoint does not attend to them)."""
        lens = torch.tensor(seq_lens, dtype=torch.long)
        cu = torch.zeros(len(seq_lens) + 1, dtype=torch.long)
        torch.cumsum(lens, 0, out=cu[1:])
        total = int(cu[-1])
        seq_ids = torch.repeat_interleave(torch.arange(len(seq_lens)), lens)
        positions = torch.arange(total) - cu[:-1].repeat_interleave(lens)
        max_len = max(seq_lens)
        keys = lens if key_lens is None else torch.tensor(key_lens, dtype=torch.long)
        partial_keys = key_lens is not None and any(k < n for k, n in zip(key_lens, seq_lens))
        scatter = mask = None
        if len(seq_lens) > 1 or partial_keys:
            scatter = (seq_ids * max_len + positions).to(device)
            if min(seq_lens) != max_len or partial_keys:
                mask = (torch.arange(max_len)[None, :] < keys[:, None]).view(len(seq_lens), 1, 1, max_len)
                mask = mask.to(device)
        return cls(seq_lens=list(seq_lens), cu_seqlens=cu.to(device), positions=positions.to(device),
                   seq_ids=seq_ids.to(device), max_seqlen=max_len, scatter_index=scatter, key_mask=mask)

    def attn_mask(self, bias: torch.Tensor | None = None) -> torch.Tensor | None:
        """The mask SDPA gets: the key mask, plus an additive `[1, heads, L, L]` bias when the model has one."""
        if bias is None:
            return self.key_mask
        if self.key_mask is None:
            return bias
        return bias.masked_fill(~self.key_mask, float("-inf"))


def varlen_attention(qkv: torch.Tensor, meta: AttentionMetadata, num_heads: int,
                     attn_mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(q kᵀ/√d + mask) v per sequence, for fused `qkv` of shape [T, 3 * hidden] → [T, hidden]."""
    total, three_h = qkv.shape
    hidden = three_h // 3
    head_dim = hidden // num_heads
    if meta.scatter_index is None:
        q, k, v = qkv.view(1, total, 3, num_heads, head_dim).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return out.transpose(1, 2).reshape(total, hidden)
    batch, max_len = meta.num_seqs, meta.max_seqlen
    grid = qkv.new_zeros(batch * max_len, three_h)
    grid.index_copy_(0, meta.scatter_index, qkv)
    q, k, v = grid.view(batch, max_len, 3, num_heads, head_dim).permute(2, 0, 3, 1, 4)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    return out.transpose(1, 2).reshape(batch * max_len, hidden).index_select(0, meta.scatter_index)
