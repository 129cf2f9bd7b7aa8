"""MUVERA fixed-dimensional encodings against fastembed's `Muvera` (the same random draws for the same seed),
as an offline token_embed output, and what an encoding's dot product says about MaxSim."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fastembed.postprocess import muvera as fastembed_muvera

from polyvec import PoolingParams
from polyvec.muvera import Muvera, MuveraParams


@pytest.mark.parametrize(
    ("dim", "params"),
    [
        (64, MuveraParams()),  # fastembed's defaults
        (128, MuveraParams(k_sim=3, dim_proj=128, r_reps=4, seed=7)),  # no projection
        (32, MuveraParams(k_sim=6, dim_proj=8, r_reps=10, seed=0)),  # more partitions than vectors
        (16, MuveraParams(k_sim=10, dim_proj=1, r_reps=3, seed=3)),  # the most partitions, nearly all empty
    ],
)
def test_equals_fastembed(dim, params):
    ref = fastembed_muvera.Muvera(dim, params.k_sim, params.dim_proj, params.r_reps, params.seed)
    ours = Muvera(dim, params)
    assert ours.output_dim == ref.embedding_size == params.output_dim()
    rng = np.random.default_rng(dim)
    for n in (1, 3, 40, 300):
        x = rng.standard_normal((n, dim)).astype(np.float32)
        for query in (False, True):
            want = ref.process_query(x) if query else ref.process_document(x)
            got = ours(torch.from_numpy(x), query)
            assert got.dtype == np.float32 and got.shape == want.shape
            assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max(), (n, query)


def test_documents_fill_empty_partitions_queries_do_not():
    m = Muvera(16, MuveraParams(k_sim=4, dim_proj=16, r_reps=1, seed=3))
    x = np.random.default_rng(0).standard_normal((2, 16))
    doc, query = m(x).reshape(16, 16), m(x, query=True).reshape(16, 16)
    assert (np.abs(doc).sum(1) > 0).all()  # every partition holds a vector
    assert (np.abs(query).sum(1) > 0).sum() <= 2  # only the partitions the two vectors fell into
    assert np.allclose(query.sum(0), x.sum(0))  # a query's partitions sum to its vectors' sum
    assert np.array_equal(m(np.zeros((0, 16))), np.zeros(m.output_dim, dtype=np.float32))
    half = torch.from_numpy(x).bfloat16()  # what a bfloat16 engine hands over
    assert np.allclose(m(half), m(half.float().numpy()))


def test_dot_product_tracks_maxsim():
    """The point of the encoding: its dot products rank documents as MaxSim does, far better than chance."""
    rng = np.random.default_rng(1)
    centers = rng.standard_normal((20, 64))
    docs = [centers[rng.integers(0, 20, 30)] + 0.3 * rng.standard_normal((30, 64)) for _ in range(200)]
    docs = [d / np.linalg.norm(d, axis=1, keepdims=True) for d in docs]
    m = Muvera(64, MuveraParams(k_sim=4, dim_proj=32, r_reps=20))
    encoded = m.encode(docs)
    hits = 0
    for i in range(20):
        q = docs[i][:6]
        exact = np.array([(q @ d.T).max(1).sum() for d in docs])
        approx = encoded @ m(q, query=True)
        hits += len(set(np.argsort(-exact)[:10]) & set(np.argsort(-approx)[:20]))
    assert hits / 200 >= 0.4  # of the top 10 by MaxSim, in the top 20 by the encoding: 0.51 here, chance 0.1


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"k_sim": 11}, "muvera.k_sim must be at most 10"),
        ({"k_sim": 0}, "muvera.k_sim must be a positive integer"),
        ({"r_reps": True}, "muvera.r_reps must be a positive integer"),
        ({"seed": -1}, "muvera.seed must be a non-negative integer"),
        ({"k_sim": 10, "dim_proj": 64, "r_reps": 20}, "the limit is"),
        ({"r_reps": 257, "dim_proj": 1}, "muvera.r_reps must be at most 256"),
        ({"r_reps": 200, "dim_proj": 32, "k_sim": 1}, "r_reps · dim_proj = 6400 projected numbers; the limit is 4096"),
        ({"bits": 3}, "muvera has no field 'bits'"),
        ("yes", "muvera must be an object"),
    ],
)
def test_bad_params(value, message):
    with pytest.raises(ValueError, match=message):
        MuveraParams.coerce(value)


def test_the_largest_parameters_a_request_may_send_stay_small():
    """At the limits (1,024 partitions, or 4,096 projected numbers per token; 256 repetitions) a document's
    encoding needs tens of MB, also of 4,096 tokens: the nearest occupied partition was found in an [r, B, B]
    array, the sums through an [r, B, n] one-hot and the projections made for all repetitions at once (2 GB and
    more for one request), and projections wider than any output were allowed (hundreds of MB kept per seed)."""
    import tracemalloc

    rng = np.random.default_rng(0)
    for fields, n in (
        ({"k_sim": 10, "dim_proj": 1, "r_reps": 256}, 300),
        ({"k_sim": 4, "dim_proj": 16, "r_reps": 256}, 4096),
    ):
        params, x = MuveraParams.coerce(fields), rng.standard_normal((n, 384))
        tracemalloc.start()
        try:
            out = Muvera(384, params)(x)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert out.shape == (params.output_dim(),) and np.isfinite(out).all()
        assert peak < 64 * 2**20, (fields, peak)


def test_token_embed_output_offline(minilm_llm):
    texts = ["the boundary layer of a flat plate", "heat transfer", ""]
    tokens = [o.outputs.data.numpy() for o in minilm_llm.token_embed(texts, use_tqdm=False)]
    for spec, input_type in ((True, None), ({"k_sim": 4, "dim_proj": 8, "seed": 1}, "query")):
        params = MuveraParams.coerce(spec)
        ref = fastembed_muvera.Muvera(384, params.k_sim, params.dim_proj, params.r_reps, params.seed)
        outs = minilm_llm.token_embed(texts, PoolingParams(muvera=spec, input_type=input_type), use_tqdm=False)
        for o, t in zip(outs, tokens):
            want = ref.process_query(t) if input_type == "query" else ref.process_document(t)
            assert o.outputs.data.shape == (params.output_dim(),)
            assert np.abs(o.outputs.data.numpy() - want).max() <= 1e-6 * np.abs(want).max()
    for bad, message in (
        (
            PoolingParams(muvera={"dim_proj": 500, "r_reps": 2}),
            r"muvera.dim_proj \(500\) must not exceed the token vectors' width",
        ),
        (PoolingParams(muvera=True, token_encoding="int8"), "cannot be combined"),
    ):
        with pytest.raises(ValueError, match=message):
            minilm_llm.token_embed(texts, bad, use_tqdm=False)
    with pytest.raises(ValueError, match="muvera applies to token_embed"):
        minilm_llm.embed(texts, PoolingParams(muvera=True), use_tqdm=False)


def test_step_pooling_narrows_the_width_muvera_checks(minilm_llm):
    """returned_token_ids keep that many columns of each token vector: a dim_proj wider than them is a ValueError
    before any work (a 500 over HTTP, raised after the forward pass)."""
    before = minilm_llm.engine.stats.num_batched_tokens
    with pytest.raises(ValueError, match=r"muvera.dim_proj \(16\) must not exceed the token vectors' width \(2\)"):
        minilm_llm.token_embed(["a b"], PoolingParams(muvera={}, returned_token_ids=[0, 1]), use_tqdm=False)
    assert minilm_llm.engine.stats.num_batched_tokens == before and not minilm_llm.engine.has_unfinished_requests()
    narrow = PoolingParams(muvera={"dim_proj": 2, "k_sim": 2, "r_reps": 3}, returned_token_ids=[0, 1])
    assert minilm_llm.token_embed(["a b"], narrow, use_tqdm=False)[0].outputs.data.shape == (3 * 4 * 2,)
