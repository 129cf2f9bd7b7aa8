"""Token pooling (pool_factor) against PyLate's hierarchical pooling, offline and over HTTP."""

from __future__ import annotations

import pytest
import torch

from polyvec import LLM, PoolingParams
from polyvec.token_pooling import hierarchical_pool, ward_labels
from tests.helpers import cosine_rows

DOCS = [
    "The boundary layer on a flat plate in supersonic flow was measured at several Mach numbers and compared "
    "with theory; the agreement is good near the leading edge and poorer downstream where transition occurs.",
    "flutter of wings",
    "Heat transfer, skin friction and pressure distributions on blunt bodies at hypersonic speeds.",
]


@pytest.mark.parametrize("factor", [2, 3])
def test_same_clusters_as_pylate(pylate_model, factor):
    model, folder = pylate_model
    llm = LLM(str(folder), dtype="float32")
    got = llm.token_embed(DOCS, PoolingParams(input_type="document", pool_factor=factor), use_tqdm=False)
    full = llm.token_embed(DOCS, PoolingParams(input_type="document"), use_tqdm=False)
    want = model.encode(DOCS, is_query=False, pool_factor=factor)
    for g, f, w in zip(got, full, want):
        w = torch.as_tensor(w)
        n = f.outputs.data.shape[0]
        assert g.outputs.data.shape == w.shape  # the same clusters, in the same order
        assert g.outputs.data.shape[0] <= 1 + max((n - 1) // factor, 1)
        assert cosine_rows(g.outputs.data, w).min() >= 0.9999
    # the function alone, on polyvec's own vectors, and queries left as they are
    assert torch.equal(hierarchical_pool(full[0].outputs.data, factor), got[0].outputs.data)
    q = llm.token_embed(DOCS[1], PoolingParams(input_type="query", pool_factor=factor), use_tqdm=False)[0]
    assert q.outputs.data.shape[0] == model.query_length


def test_ward_labels_as_scipy_public_calls(monkeypatch):
    """The direct calls into scipy's compiled routines give fcluster(linkage(...))'s labels, and the public
    calls stand in where those internals are missing."""
    from scipy.cluster import hierarchy
    from scipy.spatial.distance import squareform

    g = torch.Generator().manual_seed(0)
    cases = []
    for n in (2, 3, 5, 17, 50, 187, 300):
        x = torch.nn.functional.normalize(torch.randn(n, 32, generator=g), dim=-1)
        if n > 5:  # repeated vectors: ties in the merge distances
            x[n // 2 :: 4] = x[1]
        cases.append(x)
    compared = 0
    for x in cases:
        distance = 1 - torch.mm(x, x.t()).numpy()
        for clusters in {1, max(x.shape[0] // 2, 1), max(x.shape[0] // 3, 1)}:
            condensed = squareform(distance, checks=False).astype("float64")
            got = ward_labels(distance, clusters)
            assert got.min() == 1 and got.max() <= clusters
            z = hierarchy.linkage(condensed, method="ward")
            if (z[:, 2] < 0).any():  # a rounding-negative distance between repeated vectors: fcluster refuses it
                continue
            assert (got == hierarchy.fcluster(z, t=clusters, criterion="maxclust")).all()
            compared += 1
    assert compared >= 12  # of 16
    import scipy.cluster

    x = torch.nn.functional.normalize(torch.randn(60, 32, generator=g), dim=-1)
    fast = hierarchical_pool(x, 2)
    monkeypatch.setattr(scipy.cluster, "_hierarchy", object())  # what ward_labels imports; hierarchy keeps its own
    assert torch.equal(hierarchical_pool(x, 2), fast)  # the public calls, the same clusters
    bad = x.clone()
    bad[3, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        hierarchical_pool(bad, 2)


def test_pool_factor_checks(minilm_llm):
    for bad, message in [
        (PoolingParams(pool_factor=0), "pool_factor must be a positive integer"),
        (PoolingParams(pool_factor=True), "pool_factor must be a positive integer"),
    ]:
        with pytest.raises(ValueError, match=message):
            minilm_llm.token_embed("x", bad, use_tqdm=False)
    with pytest.raises(ValueError, match="pool_factor applies to token_embed, not 'embed'"):
        minilm_llm.embed("x", PoolingParams(pool_factor=2), use_tqdm=False)
    one = minilm_llm.token_embed(DOCS[0], PoolingParams(pool_factor=1), use_tqdm=False)[0].outputs.data
    assert torch.equal(one, minilm_llm.token_embed(DOCS[0], use_tqdm=False)[0].outputs.data)
    two = minilm_llm.token_embed(DOCS[0], PoolingParams(pool_factor=2), use_tqdm=False)[0].outputs.data
    assert two.shape[0] < one.shape[0]


def test_pool_factor_over_http(pylate_model):
    from tests.entrypoints.server.conftest import Server

    _, folder = pylate_model
    llm = LLM(str(folder), dtype="float32")
    s = Server(str(folder))
    try:
        body = s.post("/pooling", {"input": DOCS, "task": "token_embed", "pool_factor": 2}).json()
        want = llm.token_embed(DOCS, PoolingParams(pool_factor=2), use_tqdm=False)
        for item, w in zip(body["data"], want):
            assert item["shape"] == list(w.outputs.data.shape)
            assert cosine_rows(torch.tensor(item["data"]), w.outputs.data).min() >= 0.99999
        r = s.post("/pooling", {"input": DOCS[0], "task": "token_embed", "pool_factor": 0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "pool_factor"
    finally:
        s.stop()


def test_a_windowed_input_pools_window_by_window(minilm_path, monkeypatch):
    """A long input split into windows was clustered whole after its windows were joined: n² distances over
    every token (n² memory and time for a small request). Pooling now
    clusters blocks of at most max_model_len vectors, the first keeping [CLS]; an input that fits is one block."""
    from polyvec import token_pooling
    from polyvec.token_pooling import pool_in_blocks

    sizes: list[int] = []
    pool = token_pooling.hierarchical_pool
    monkeypatch.setattr(token_pooling, "hierarchical_pool", lambda v, *a: sizes.append(v.shape[0]) or pool(v, *a))
    llm = LLM(str(minilm_path), dtype="float32", max_model_len=64, long_input="window")
    text = " ".join(DOCS * 12)
    whole = llm.token_embed(text, use_tqdm=False)[0].outputs.data  # [n, 384], n > 64
    got = llm.token_embed(text, PoolingParams(pool_factor=2), use_tqdm=False)[0].outputs.data
    n = whole.shape[0]
    assert n > 3 * 64 and max(sizes) == 64 and sum(sizes) == n
    want = torch.cat([pool(whole[:64], 2), *[pool(whole[i : i + 64], 2, 0) for i in range(64, n, 64)]])
    assert torch.allclose(got, want, atol=1e-6) and got.shape[0] < n * 0.6
    short = torch.randn(30, 8)
    assert torch.equal(pool_in_blocks(short, 2, 64), pool(short, 2))
