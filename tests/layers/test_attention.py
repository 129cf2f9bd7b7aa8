"""Packed attention equals attention run on each sequence alone (no cross-sequence leakage)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from polyvec.layers.attention import AttentionMetadata, varlen_attention


@pytest.mark.parametrize("lens", [[7], [4, 4, 4], [3, 11, 1, 6]])
@pytest.mark.parametrize("with_bias", [False, True])
def test_varlen_equals_per_sequence(lens, with_bias):
    torch.manual_seed(1)
    heads, dim = 2, 8
    qkv = torch.randn(sum(lens), 3 * heads * dim)
    meta = AttentionMetadata.build(lens, torch.device("cpu"))
    bias = torch.randn(1, heads, max(lens), max(lens)) if with_bias else None
    out = varlen_attention(qkv, meta, heads, meta.attn_mask(bias))
    start = 0
    for n in lens:
        q, k, v = qkv[start:start + n].view(1, n, 3, heads, dim).permute(2, 0, 3, 1, 4)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=None if bias is None else bias[..., :n, :n])
        assert torch.allclose(out[start:start + n], ref.transpose(1, 2).reshape(n, heads * dim), atol=1e-5)
        start += n


def test_metadata_positions_and_offsets():
    meta = AttentionMetadata.build([2, 3], torch.device("cpu"))
    assert meta.cu_seqlens.tolist() == [0, 2, 5]
    assert meta.positions.tolist() == [0, 1, 0, 1, 2]
    assert meta.seq_ids.tolist() == [0, 0, 1, 1, 1]
    assert meta.key_mask[0, 0, 0].tolist() == [True, True, False]
    # Equal lengths need no mask; one sequence needs no grid at all.
    assert AttentionMetadata.build([4, 4], torch.device("cpu")).key_mask is None
    assert AttentionMetadata.build([4], torch.device("cpu")).scatter_index is None
