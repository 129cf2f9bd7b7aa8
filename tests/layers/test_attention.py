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
        q, k, v = qkv[start : start + n].view(1, n, 3, heads, dim).permute(2, 0, 3, 1, 4)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=None if bias is None else bias[..., :n, :n])
        assert torch.allclose(out[start : start + n], ref.transpose(1, 2).reshape(n, heads * dim), atol=1e-5)
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


# ------------------------------------------------------------------------------------------ causal + KV cache


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_causal_attention_in_chunks_equals_one_pass(window, heads, kv_heads):
    """Three sequences prefilled in chunks (attending to their KV caches) give the same output as one
    causal pass with an explicit mask."""
    from polyvec.layers.attention import KVCache, causal_attention

    torch.manual_seed(0)
    dim, lens = 8, [37, 5, 20]
    qs = [torch.randn(n, heads, dim) for n in lens]
    ks = [torch.randn(n, kv_heads, dim) for n in lens]
    vs = [torch.randn(n, kv_heads, dim) for n in lens]
    expected = []
    for q, k, v in zip(qs, ks, vs):
        n = q.shape[0]
        i, j = torch.arange(n).unsqueeze(1), torch.arange(n).unsqueeze(0)
        mask = (j <= i) if window is None else (j <= i) & (j > i - window)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1).repeat_interleave(heads // kv_heads, 0),
            v.transpose(0, 1).repeat_interleave(heads // kv_heads, 0),
            attn_mask=mask,
        )
        expected.append(ref.transpose(0, 1))
    caches = [KVCache(1, n, kv_heads, dim, torch.float32, torch.device("cpu")) for n in lens]
    got = [[] for _ in lens]
    done = [0] * len(lens)
    while any(d < n for d, n in zip(done, lens)):
        active = [s for s in range(len(lens)) if done[s] < lens[s]]
        sizes = [min(16, lens[s] - done[s]) for s in active]
        meta = AttentionMetadata.build_causal(
            sizes, [done[s] for s in active], [caches[s] for s in active], torch.device("cpu")
        )

        def cat(xs, active=active, sizes=sizes):
            return torch.cat([xs[s][done[s] : done[s] + m] for s, m in zip(active, sizes)])

        out = causal_attention(cat(qs), cat(ks), cat(vs), meta, layer=0, sliding_window=window)
        for s, piece in zip(active, out.split(sizes)):
            got[s].append(piece)
            done[s] += piece.shape[0]
    for g, e in zip(got, expected):
        assert torch.allclose(torch.cat(g), e, atol=1e-5)
