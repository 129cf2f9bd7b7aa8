"""Packed pooling against sentence-transformers' Pooling module on the same (padded) token embeddings."""

from __future__ import annotations

import pytest
import torch

from polyvec.layers.attention import AttentionMetadata
from polyvec.layers.pooler import Pooler, PoolingSpec, seq_pool
from polyvec.loader import ST_POOLING_MODES

LENS = [5, 1, 9, 3]
HIDDEN = 16


@pytest.fixture(scope="module")
def packed():
    torch.manual_seed(0)
    flat = torch.randn(sum(LENS), HIDDEN)
    padded = torch.zeros(len(LENS), max(LENS), HIDDEN)
    mask = torch.zeros(len(LENS), max(LENS), dtype=torch.long)
    start = 0
    for i, n in enumerate(LENS):
        padded[i, :n] = flat[start : start + n]
        mask[i, :n] = 1
        start += n
    return flat, padded, mask, AttentionMetadata.build(LENS, torch.device("cpu"))


def _st_pool(mode, padded, mask):
    from sentence_transformers.sentence_transformer.modules import Pooling

    pooling = Pooling(embedding_dimension=HIDDEN, pooling_mode=mode)
    return pooling({"token_embeddings": padded, "attention_mask": mask})["sentence_embedding"]


@pytest.mark.parametrize("st_mode", list(ST_POOLING_MODES))
def test_every_sentence_transformers_mode(packed, st_mode):
    flat, padded, mask, meta = packed
    ours = seq_pool(ST_POOLING_MODES[st_mode], flat, meta)
    ref = _st_pool(st_mode, padded, mask)
    assert torch.allclose(ours, ref, atol=1e-6), st_mode


def test_concatenated_modes(packed):
    flat, padded, mask, meta = packed
    modes = ("cls", "max", "mean")
    ref = _st_pool(modes, padded, mask)
    pooler = Pooler()
    spec = PoolingSpec(task="embed", pooling=tuple(ST_POOLING_MODES[m] for m in modes), use_activation=False)
    out = pooler(flat, meta, torch.zeros(sum(LENS), dtype=torch.long), [spec] * len(LENS))
    assert torch.allclose(torch.stack(out), ref, atol=1e-6)


def test_mixed_tasks_in_one_batch_are_views_of_group_tensors(packed):
    flat, _, _, meta = packed
    specs = [
        PoolingSpec("embed", ("MEAN",)),
        PoolingSpec("token_embed", ("ALL",)),
        PoolingSpec("embed", ("MEAN",)),
        PoolingSpec("token_embed", ("ALL",), dimensions=4),
    ]
    out = Pooler()(flat, meta, torch.zeros(sum(LENS), dtype=torch.long), specs)
    assert out[0].shape == (HIDDEN,) and out[2].shape == (HIDDEN,)
    assert out[1].shape == (1, HIDDEN) and out[3].shape == (3, 4)
    assert out[0]._base is out[2]._base  # one result tensor per group
    mean2 = flat[6:15].mean(0)
    assert torch.allclose(out[2], torch.nn.functional.normalize(mean2, dim=-1), atol=1e-6)
    # Matryoshka: truncate, then normalize.
    assert torch.allclose(out[3], torch.nn.functional.normalize(flat[15:18, :4], dim=-1), atol=1e-6)


def test_step_pooling(packed):
    flat, _, _, meta = packed
    ids = torch.arange(sum(LENS)) % 3
    spec = PoolingSpec("token_embed", ("STEP",), use_activation=False, step_tag_id=2, returned_token_ids=(1, 5))
    out = Pooler()(flat, meta, ids, [spec] * len(LENS))
    start = 0
    for n, o in zip(LENS, out):
        sel = ids[start : start + n] == 2
        assert torch.equal(o, flat[start : start + n][sel][:, [1, 5]])
        start += n
