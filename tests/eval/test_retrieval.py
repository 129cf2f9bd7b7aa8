"""Retrieval evaluation: exact search against brute force, metrics against a hand computation, the CLI."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from polyvec.eval.retrieval import BeirData, dense_search, evaluate, load_beir, maxsim_search
from tests.conftest import DATA, REPO


def test_maxsim_search_is_exact():
    torch.manual_seed(0)
    qs = [F.normalize(torch.randn(int(torch.randint(3, 30, ())), 64), dim=-1) for _ in range(20)]
    ds = [F.normalize(torch.randn(int(torch.randint(1, 90, ())), 64), dim=-1).half() for _ in range(300)]
    scores, idx = maxsim_search(qs, ds, top_k=10, chunk=37, budget=5000)  # many chunks and query blocks
    # Brute force, one pair at a time: best document token per query token, summed.
    brute = torch.tensor([[float((q @ d.float().T).amax(dim=1).sum()) for d in ds] for q in qs])
    top = brute.topk(10, dim=1)
    assert torch.allclose(scores, top.values, atol=1e-5) and torch.equal(idx, top.indices)


def test_dense_search_is_exact():
    torch.manual_seed(0)
    q, d = F.normalize(torch.randn(7, 32), dim=-1), F.normalize(torch.randn(500, 32), dim=-1).half()
    scores, idx = dense_search(q, d, top_k=5, chunk=64)
    top = (q @ d.float().T).topk(5, dim=1)
    assert torch.allclose(scores, top.values, atol=1e-6) and torch.equal(idx, top.indices)


def test_metrics_match_hand_computation():
    data = BeirData(
        doc_ids=["a", "b", "c"], docs=["", "", ""], query_ids=["q"], queries=[""], qrels={"q": {"b": 2, "c": 1}}
    )
    # Ranking: a (irrelevant), b (gain 2), c (gain 1).
    m = evaluate(data, torch.tensor([[3.0, 2.0, 1.0]]), torch.tensor([[0, 1, 2]]))
    dcg = 2 / math.log2(3) + 1 / math.log2(4)
    idcg = 2 / math.log2(2) + 1 / math.log2(3)
    assert m["nDCG@10"] == pytest.approx(dcg / idcg, rel=1e-6)
    assert m["MRR@10"] == pytest.approx(0.5) and m["R@100"] == pytest.approx(1.0)


def test_load_beir_reads_the_test_slices():
    cran = load_beir(DATA / "cranfield")
    assert len(cran.docs) == 107 and len(cran.queries) == 94 and sum(map(len, cran.qrels.values())) == 162
    vas = load_beir(DATA / "vaswani")
    assert len(vas.docs) == 100 and len(vas.queries) == 16 and sum(map(len, vas.qrels.values())) == 25


@pytest.mark.parametrize("name", ["cranfield", "vaswani"])
def test_cli_on_a_small_collection(name):
    data = load_beir(DATA / name)
    for mode in ("dense", "multivector"):
        out = subprocess.run(
            [sys.executable, "-m", "polyvec", "eval-retrieval", "--data", str(DATA / name), "--mode", mode, "--quiet"],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr
        ndcg = float(out.stdout.split("nDCG@10 ")[1].split()[0])
        assert 0.3 < ndcg <= 1.0, out.stdout  # far above random on ~100 documents
        assert f"{len(data.docs)} docs, {len(data.queries)} queries" in out.stdout and "search" in out.stdout
