"""Retrieval evaluation: exact search against brute force, metrics against a hand computation, the CLI."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from polyvec.eval.retrieval import (
    BeirData,
    BM25System,
    DenseSystem,
    MultivectorSystem,
    SparseSystem,
    candidate_union,
    dense_search,
    encode_system,
    evaluate,
    fuse,
    load_beir,
    maxsim_search,
    rrf_fuse,
    sparse_matrix,
    sparse_search,
    weighted_fuse,
)
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


def _edited_vaswani(tmp_path, name: str, edit) -> str:
    """A copy of the vaswani slice with one file's lines changed by `edit`."""
    import shutil

    folder = tmp_path / "v"
    shutil.copytree(DATA / "vaswani", folder)
    path = folder / name
    path.write_text("".join(line + "\n" for line in edit(path.read_text().splitlines())))
    return str(folder)


@pytest.mark.parametrize(
    ("name", "edit", "message"),
    [
        ("corpus.jsonl", lambda ls: ls[:3] + ['{"text": "no id"}'] + ls[3:], "corpus.jsonl line 4 has no '_id'"),
        ("corpus.jsonl", lambda ls: ls[:1] + ["{broken"], "corpus.jsonl line 2 is not valid JSON"),
        ("corpus.jsonl", lambda ls: ls[:1] + ['{"_id": "x", "text": 5}'], "line 2 has a number in field 'text'"),
        ("corpus.jsonl", lambda ls: [], "no documents in corpus.jsonl"),
        ("qrels.tsv", lambda ls: ls[:2] + ["1\t2"], "qrels.tsv line 3 has 2 columns, not 3"),
        ("qrels.tsv", lambda ls: ls[:2] + ["1\t2\thigh"], "qrels.tsv line 3: the score 'high' is not an integer"),
        ("qrels.tsv", lambda ls: [], "no judged queries"),
        ("queries.jsonl", lambda ls: ['{"_id": "1", "text": 5}'] + ls, "line 1 has a number in field 'text'"),
        # a ranking could not tell two documents (queries) under one id apart: one overwrote the other's results
        ("corpus.jsonl", lambda ls: ls + [ls[0]], "corpus.jsonl line {n} repeats the id"),
        ("queries.jsonl", lambda ls: ls + [ls[0]], "queries.jsonl line {n} repeats the id"),
        # TREC's layout (query, iteration, document, score) read as BEIR's: every score 0.0000, silently
        ("qrels.tsv", lambda ls: [f"{q}\t0\t{d}\t{s}" for q, d, s in (ln.split("\t")[:3] for ln in ls[1:])],
         "none of the relevant documents of qrels.tsv is in corpus.jsonl"),
    ],
)  # fmt: skip
def test_cli_names_what_is_wrong_in_a_collection(tmp_path, capsys, name, edit, message):
    from polyvec.entrypoints.cli import main

    folder = _edited_vaswani(tmp_path, name, edit)
    assert main(["eval-retrieval", "--data", folder, "--mode", "bm25", "--quiet"]) == 2
    err = capsys.readouterr().err
    lines = (DATA / "vaswani" / name).read_text().splitlines()
    message = message.replace("{n}", str(len([ln for ln in lines if ln.strip()]) + 1))
    assert message in err and err.count("\n") == 1, err


def test_judged_queries_without_a_text_are_left_out_of_the_average(tmp_path, caplog):
    """A query of qrels.tsv missing from queries.jsonl was averaged in as 0 while the header counted the queries
    read (one perfect query among three judged scored a third); the metrics are over the queries evaluated, as
    BEIR's, and the others are named in a warning. Weights that cannot weigh are refused."""
    folder = tmp_path / "u"
    folder.mkdir()
    (folder / "corpus.jsonl").write_text('{"_id": "1", "text": "apple"}\n{"_id": "2", "text": "pear"}\n')
    (folder / "queries.jsonl").write_text('{"_id": "1", "text": "apple"}\n')
    (folder / "qrels.tsv").write_text("q\td\ts\n1\t1\t1\n2\t2\t1\n3\t2\t1\n")
    data = load_beir(folder)
    assert data.query_ids == ["1"] and list(data.qrels) == ["1"]
    assert "2 judged queries of qrels.tsv are not in queries.jsonl" in caplog.text
    cand, s = torch.tensor([[0, 1]]), [torch.tensor([[0.9, 0.5]]), torch.tensor([[1.0, 2.0]])]
    for weights in ([0.0, 0.0], [1.0, -1.0], [float("nan"), 1.0]):
        with pytest.raises(ValueError, match="weights must be finite, at least 0 and not all 0"):
            weighted_fuse(cand, s, weights, 2)


def test_cli_names_a_missing_eval_extra_before_any_work(tmp_path, capsys, monkeypatch):
    """Without the eval extra's libraries, one line naming them and the extra (a traceback after encoding the
    whole corpus before)."""
    import importlib.util

    from polyvec.entrypoints.cli import main

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ir_measures" else find(name, *a))
    assert main(["eval-retrieval", "--data", str(DATA / "cranfield"), "--mode", "bm25", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "eval-retrieval needs ir_measures: pip install 'polyvec[eval]'" in err and err.count("\n") == 1, err


def test_blank_lines_and_ids_named_id_are_read(tmp_path):
    folder = _edited_vaswani(tmp_path, "corpus.jsonl", lambda ls: [ls[0].replace('"_id"', '"id"'), "", *ls[1:], ""])
    assert load_beir(folder).doc_ids == load_beir(DATA / "vaswani").doc_ids


def test_depth_is_a_positive_count(capsys):
    from polyvec.entrypoints.cli import build_parser

    for value in ("0", "-5"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["eval-retrieval", "--data", "d", "--mode", "hybrid", "--depth", value])
        assert "--depth" in capsys.readouterr().err


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


# Sparse (SPLADE) search, BM25 and hybrids.


def _random_csr(rows: int, dim: int, density: float, seed: int):
    import numpy as np
    import scipy.sparse as sp

    m = sp.random(rows, dim, density=density, format="csr", dtype=np.float32, random_state=seed)
    m.data += 0.01  # strictly positive weights, as SPLADE's
    return m


def test_sparse_search_is_exact():
    import numpy as np

    q, d = _random_csr(23, 80, 0.06, 1), _random_csr(400, 80, 0.05, 2)
    keep = np.ones((23, 1), dtype=np.float32)
    keep[5] = 0  # a query with no term: nothing retrieved
    q = q.multiply(keep).tocsr()
    q.eliminate_zeros()
    scores, idx = sparse_search(q, d, top_k=30, budget=1000)  # several blocks of queries
    # Brute force: dense dot products; a document sharing no term with the query is not retrieved.
    qd, dd = q.toarray().astype(np.float64), d.toarray().astype(np.float64)
    brute = torch.from_numpy(qd @ dd.T)
    brute[torch.from_numpy((qd > 0).astype(float) @ (dd > 0).T.astype(float)) == 0] = -torch.inf
    top = brute.topk(30, dim=1)
    finite = top.values > -torch.inf
    assert 0 < int((~finite).sum()) and bool((~finite[5]).all())  # some queries match fewer than 30 documents
    assert torch.equal(scores > -torch.inf, finite) and torch.equal(idx, top.indices.masked_fill(~finite, -1))
    assert torch.allclose(scores[finite], top.values[finite].float(), rtol=1e-5)
    # The same scores, rescored pair by pair for fusion.
    assert torch.allclose(SparseSystem(q, d).fusion_scores(idx)[finite], scores[finite], rtol=1e-5)


def test_sparse_matrix_of_sparse_vectors():
    from types import SimpleNamespace

    vecs = [SimpleNamespace(indices=[1, 4], values=[0.5, 2.0], dim=6), SimpleNamespace(indices=[], values=[], dim=6)]
    vecs.append(SimpleNamespace(indices=[0, 5], values=[1.0, 3.0], dim=6))
    m = sparse_matrix(vecs)
    assert m.shape == (3, 6) and m.toarray().tolist() == [[0, 0.5, 0, 0, 2, 0], [0] * 6, [1, 0, 0, 0, 0, 3]]


def test_candidate_union():
    a = torch.tensor([[3, 1, -1], [9, -1, -1]])
    b = torch.tensor([[1, 5], [-1, -1]])
    assert candidate_union([a, b]).tolist() == [[1, 3, 5], [-1, -1, 9]]  # each document once, ascending


def test_rrf_on_hand_made_rankings():
    a, b = torch.tensor([[0, 1, 2]]), torch.tensor([[2, 0, 3]])
    # 0: 1/61 + 1/62, 2: 1/63 + 1/61, 1: 1/62, 3: 1/63.
    scores, idx = rrf_fuse([(torch.zeros(1, 3), a), (torch.zeros(1, 3), b)], top_k=10)
    assert idx.tolist() == [[0, 2, 1, 3]]
    assert scores[0].tolist() == pytest.approx([1 / 61 + 1 / 62, 1 / 61 + 1 / 63, 1 / 62, 1 / 63])
    # k sets how much agreement beats one top rank: document 2 is third in both lists, 0 and 3 first in one.
    rankings = [(torch.zeros(1, 3), torch.tensor([[0, 1, 2]])), (torch.zeros(1, 3), torch.tensor([[3, 4, 2]]))]
    assert rrf_fuse(rankings, top_k=10)[1].tolist() == [[2, 0, 3, 1, 4]]  # 2/63 > 1/61; ties: lower index first
    assert rrf_fuse(rankings, top_k=4, k=0)[1].tolist() == [[0, 3, 2, 1]]  # 1 > 2/3 > 1/2
    # Ties go to the lower corpus position; empty slots (-1) are ignored; queries are independent.
    a, b = torch.tensor([[7, 3, -1], [4, -1, -1]]), torch.tensor([[3, 7, 9], [-1, -1, -1]])
    scores, idx = rrf_fuse([(torch.zeros(2, 3), a), (torch.zeros(2, 3), b)], top_k=3)
    assert idx.tolist() == [[3, 7, 9], [4, -1, -1]] and scores[1, 1] == -torch.inf


def test_weighted_fusion_on_hand_made_scores():
    cand = torch.tensor([[0, 1, 2, 3], [5, 6, -1, -1]])
    dense = torch.tensor([[0.9, 0.5, 0.1, 0.3], [0.2, 0.4, 9.0, 9.0]])
    sparse = torch.tensor([[1.0, 10.0, 30.0, 0.0], [3.0, 1.0, 9.0, 9.0]])
    # Raw (bge-m3): (0.4 * dense + 0.2 * sparse) / 0.6; sparse's larger scale dominates.
    scores, idx = weighted_fuse(cand, [dense, sparse], [0.4, 0.2], top_k=3)
    assert idx.tolist() == [[2, 1, 0], [5, 6, -1]]
    assert scores[0].tolist() == pytest.approx([(0.04 + 6) / 0.6, (0.2 + 2) / 0.6, (0.36 + 0.2) / 0.6])
    # Min-max per query and system: dense [1, .5, 0, .25], sparse [1/30, 1/3, 1, 0].
    scores, idx = weighted_fuse(cand, [dense, sparse], [0.4, 0.2], top_k=4, normalize="minmax")
    assert idx.tolist() == [[0, 1, 2, 3], [6, 5, -1, -1]]  # second query: 5 = (0 + .2)/.6, 6 = (.4 + 0)/.6
    assert scores[0].tolist() == pytest.approx([(0.4 + 0.2 / 30) / 0.6, (0.2 + 0.2 / 3) / 0.6, 0.2 / 0.6, 0.1 / 0.6])


def test_weighted_fusion_uses_exact_scores_of_missing_documents():
    torch.manual_seed(0)
    q, d = F.normalize(torch.randn(5, 16), dim=-1), F.normalize(torch.randn(40, 16), dim=-1).half()
    qs, ds = _random_csr(5, 30, 0.3, 3), _random_csr(40, 30, 0.3, 4)
    systems = [DenseSystem(q, d), SparseSystem(qs, ds)]
    rankings = [s.search(3) for s in systems]  # short lists: most candidates are missing from one of them
    scores, idx = fuse(systems, rankings, "weighted", top_k=6, weights=[0.7, 0.3])
    full = 0.7 * (q @ d.float().T) + 0.3 * torch.from_numpy((qs @ ds.T).toarray())  # every pair, exactly
    cand = candidate_union([i for _, i in rankings])
    for row in range(5):
        c = cand[row][cand[row] >= 0]
        expected = full[row, c].sort(descending=True)
        n = min(6, len(c))
        assert idx[row, :n].tolist() == c[expected.indices[:n]].tolist()
        assert torch.allclose(scores[row, :n].float(), expected.values[:n], atol=1e-5)
    # The default weights are bge-m3's (dense 0.4, sparse 0.2).
    assert torch.equal(fuse(systems, rankings, "weighted", 6)[1], fuse(systems, rankings, "weighted", 6, [2, 1])[1])
    with pytest.raises(ValueError, match="weights"):
        fuse(systems, rankings, "rrf", 6, weights=[1, 1])


def test_fusion_scores_are_the_search_scores():
    """Each system rescoring arbitrary (query, document) pairs gives what its exhaustive search gives."""
    torch.manual_seed(0)
    qs = [F.normalize(torch.randn(int(torch.randint(3, 30, ())), 32), dim=-1) for _ in range(70)]
    ds = [F.normalize(torch.randn(int(torch.randint(1, 60, ())), 32), dim=-1).half() for _ in range(120)]
    q, d = F.normalize(torch.randn(70, 32), dim=-1), F.normalize(torch.randn(120, 32), dim=-1).half()
    lengths = torch.tensor([x.shape[0] for x in qs], dtype=torch.float32)[:, None]
    for system, scale in ((MultivectorSystem(qs, ds), lengths), (DenseSystem(q, d), 1.0)):
        scores, idx = system.search(120)  # every document, so any candidate's score is known
        cand = candidate_union([torch.randint(0, 120, (70, 25)), torch.full((70, 3), -1)])
        expected = scores.gather(1, idx.argsort(dim=1).gather(1, cand.clamp(min=0)))
        got = system.fusion_scores(cand, block=16) * scale  # multivector: MaxSim / query length, as bge-m3
        assert torch.allclose(got[cand >= 0], expected[cand >= 0], atol=1e-4)


@pytest.fixture(scope="module")
def splade_llm(splade_path):
    from polyvec import LLM

    return LLM(str(splade_path), dtype="float32")


@pytest.fixture(scope="module")
def cranfield_systems(splade_llm, minilm_llm):
    data = load_beir(DATA / "cranfield")
    return (
        data,
        encode_system("dense", minilm_llm, data, use_tqdm=False),
        encode_system("sparse", splade_llm, data, use_tqdm=False),
    )


def test_sparse_retrieval_with_splade_tiny(cranfield_systems):
    data, _, sparse = cranfield_systems
    scores, idx = sparse.search(100)
    m = evaluate(data, scores, idx)
    assert 0.3 < m["nDCG@10"] <= 1.0 and 0.7 < m["R@100"] <= 1.0, m  # far above random on 107 documents


def test_hybrid_dense_sparse_on_cranfield(cranfield_systems):
    data, dense, sparse = cranfield_systems
    rankings = [dense.search(100), sparse.search(100)]
    alone = [evaluate(data, *r)["nDCG@10"] for r in rankings]
    for fusion, normalize in (("rrf", "none"), ("weighted", "minmax")):
        m = evaluate(data, *fuse([dense, sparse], rankings, fusion, 100, normalize=normalize))
        assert min(alone) - 0.05 < m["nDCG@10"] <= 1.0, (fusion, m, alone)
    # All the weight on dense: the fused ranking is dense's own.
    _, idx = fuse([dense, sparse], rankings, "weighted", 100, weights=[1.0, 0.0])
    assert torch.equal(idx, rankings[0][1])


@pytest.mark.parametrize("name", ["cranfield", "vaswani"])
def test_bm25_agrees_with_bm25s(name):
    import bm25s

    data = load_beir(DATA / name)
    system = BM25System(data.docs, data.queries)
    scores, idx = system.search(10)
    m = evaluate(data, *system.search(100))
    assert 0.3 < m["nDCG@10"] <= 1.0, m
    # bm25s's own retrieval, same defaults: the same documents wherever a query term matches.
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize(data.docs, stopwords="en", show_progress=False), show_progress=False)
    ref_i, ref_s = retriever.retrieve(
        bm25s.tokenize(data.queries, stopwords="en", show_progress=False), k=10, show_progress=False
    )
    ref_s, ref_i = torch.from_numpy(ref_s), torch.from_numpy(ref_i).long()
    found = idx >= 0
    assert torch.allclose(scores[found], ref_s[found], rtol=1e-5) and bool((ref_s[~found] == 0).all())
    assert torch.allclose(system.fusion_scores(idx.clamp(min=0))[found], scores[found])


def test_cli_sparse_bm25_and_hybrid(splade_path):
    def cli(*extra):
        out = subprocess.run(
            [sys.executable, "-m", "polyvec", "eval-retrieval", "--data", str(DATA / "cranfield"), "--quiet", *extra],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=300,
        )
        return out

    out = cli("--mode", "hybrid", "--hybrid", "dense", f"sparse:{splade_path}", "bm25", "--fusion", "weighted")
    assert out.returncode == 0, out.stderr
    assert "hybrid weighted sum, default weights, raw scores of dense:" in out.stdout, out.stdout
    ndcg = [float(x.split()[0]) for x in out.stdout.split("nDCG@10 ")[1:]]
    assert len(ndcg) == 4 and all(0.3 < x <= 1.0 for x in ndcg), out.stdout  # the hybrid, then each system
    out = cli("--mode", "bm25")
    assert out.returncode == 0 and "bm25s bm25" in out.stdout and "107 docs, 94 queries" in out.stdout, out.stderr
    out = cli("--mode", "sparse")  # the default model, MiniLM, has no sparse output
    assert out.returncode == 2 and "embed_sparse" in out.stderr, out.stderr
    out = cli("--mode", "hybrid", "--hybrid", "dense")
    assert out.returncode == 2 and "two systems" in out.stderr, out.stderr
