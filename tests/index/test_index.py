"""polyvec.index on Qdrant: embedded (Qdrant Edge) and through qdrant-client (its in-process mode standing in
for a server), against exact MaxSim computed here over the same vectors; the CLI end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from polyvec import PoolingParams
from polyvec.eval import document_text
from polyvec.index import Index
from polyvec.muvera import MuveraParams, muvera_for
from polyvec.scoring import iter_maxsim
from polyvec.token_pooling import hierarchical_pool

DATA = Path(__file__).resolve().parents[1] / "data" / "cranfield"
LOCATIONS = ["edge", ":memory:"]


@pytest.fixture(scope="module")
def corpus():
    rows = [json.loads(line) for line in (DATA / "corpus.jsonl").read_text().splitlines() if line.strip()]
    queries = [json.loads(line)["text"] for line in (DATA / "queries.jsonl").read_text().splitlines()[:12]]
    return [r["_id"] for r in rows], [document_text(r) for r in rows], queries


@pytest.fixture(scope="module")
def encoded(minilm_llm, corpus):
    ids, texts, queries = corpus
    docs = [o.outputs.data for o in minilm_llm.token_embed(texts, use_tqdm=False)]
    qs = [o.outputs.data for o in minilm_llm.token_embed(queries, PoolingParams(input_type="query"), use_tqdm=False)]
    return docs, qs


def exact(queries, docs, ids, k):
    scores = torch.empty(len(queries), len(docs))
    for j, s in iter_maxsim(queries, docs):
        scores[:, j] = s
    top = scores.topk(k, dim=1)
    return [[(ids[int(i)], float(v)) for v, i in zip(vals, idx)] for vals, idx in zip(top.values, top.indices)]


def where(location, tmp_path):
    return str(tmp_path / "idx") if location == "edge" else location


def assert_same(hits, want, atol=1e-4):
    for h, w in zip(hits, want, strict=True):
        assert [x.id for x in h] == [x[0] for x in w]
        assert np.allclose([x.score for x in h], [x[1] for x in w], rtol=0, atol=atol)


@pytest.mark.parametrize("location", LOCATIONS)
def test_full_scan_is_exact_maxsim(minilm_llm, corpus, encoded, tmp_path, location):
    ids, texts, queries = corpus
    docs, qs = encoded
    with Index.create(where(location, tmp_path), minilm_llm, first_stage="none") as index:
        assert index.add(texts, ids) == len(ids) and len(index) == len(ids)
        index.optimize()
        assert_same(index.search(queries, k=10), exact(qs, docs, ids, 10))
        index.add(texts[:5], ids[:5])  # the same ids again replace, not duplicate
        assert len(index) == len(ids)


@pytest.mark.parametrize("location", LOCATIONS)
def test_muvera_first_stage_then_maxsim(minilm_llm, corpus, encoded, tmp_path, location):
    ids, texts, queries = corpus
    docs, qs = encoded
    params = MuveraParams(k_sim=3, dim_proj=16, r_reps=8)
    with Index.create(where(location, tmp_path), minilm_llm, muvera=params) as index:
        index.add(texts, ids)
        index.optimize()
        # Every document a candidate: exact MaxSim.
        assert_same(index.search(queries, k=10, prefetch=len(ids), hnsw_ef=512), exact(qs, docs, ids, 10))
        # 20 candidates: those of the MUVERA encodings' dot products, re-ranked by MaxSim.
        m = muvera_for(384, params)
        first = m.encode(qs, query=True) @ m.encode(docs).T
        got = index.search(queries, k=5, prefetch=20, hnsw_ef=512)
        for qi, hits in enumerate(got):
            cand = np.argsort(-first[qi], kind="stable")[:20]
            want = exact([qs[qi]], [docs[c] for c in cand], [ids[c] for c in cand], 5)[0]
            assert [h.id for h in hits] == [w[0] for w in want]


def test_reopen_reads_the_recipe(minilm_llm, corpus, encoded, tmp_path):
    ids, texts, queries = corpus
    with Index.create(tmp_path / "idx", minilm_llm, first_stage="none", pool_factor=2) as index:
        index.add(texts, ids)
        # Flushed as added, no write-ahead log: the data is in the segments only (a log would be as large).
        log = sum(f.stat().st_size for f in (tmp_path / "idx" / "shard").glob("wal/**/*") if f.is_file())
        assert log < 1 << 20, log
    with pytest.raises(FileExistsError, match="already holds an index"):
        Index.create(tmp_path / "idx", minilm_llm)
    with Index.open(tmp_path / "idx", minilm_llm) as index:
        assert index.config.pool_factor == 2 and index.config.model == minilm_llm.model_config.model
        docs, qs = encoded
        pooled = [hierarchical_pool(d, 2) for d in docs]
        assert_same(index.search(queries[:4], k=5), exact(qs[:4], pooled, ids, 5))
    with pytest.raises(FileNotFoundError, match="holds no polyvec index"):
        Index.open(tmp_path / "nothing")


@pytest.mark.parametrize("location", LOCATIONS)
def test_dense_first_stage(minilm_llm, corpus, encoded, tmp_path, location):
    ids, texts, queries = corpus
    docs, qs = encoded
    with Index.create(where(location, tmp_path), minilm_llm, first_stage="dense") as index:
        index.add(texts, ids)
        index.optimize()
        got = index.search(queries, k=5, prefetch=15, hnsw_ef=512)
    dq = minilm_llm.embed(queries, PoolingParams(input_type="query"), use_tqdm=False)
    dd = minilm_llm.embed(texts, use_tqdm=False)
    first = torch.stack([o.outputs.data for o in dq]) @ torch.stack([o.outputs.data for o in dd]).T
    for qi, hits in enumerate(got):
        cand = first[qi].topk(15).indices.tolist()
        want = exact([qs[qi]], [docs[c] for c in cand], [ids[c] for c in cand], 5)[0]
        assert [h.id for h in hits] == [w[0] for w in want]


def sparse_candidates(sparse_llm, queries, texts, n):
    """The n documents of highest sparse dot product for each query (embed_sparse of both sides)."""
    q = torch.stack([o.outputs.data for o in sparse_llm.embed_sparse(queries, use_tqdm=False)])
    d = torch.stack([o.outputs.data for o in sparse_llm.embed_sparse(texts, use_tqdm=False)])
    top = (q @ d.T).topk(n)
    return [i[v > 0].tolist() for v, i in zip(top.values, top.indices)]  # a zero score is no match


@pytest.mark.parametrize("location", LOCATIONS)
def test_sparse_first_stage(minilm_llm, splade_path, corpus, encoded, tmp_path, location):
    """A learned sparse model's candidates (Qdrant's inverted index), re-ranked by the token model's MaxSim."""
    from polyvec import LLM

    ids, texts, queries = corpus
    docs, qs = encoded
    splade = LLM(str(splade_path), dtype="float32")
    with Index.create(where(location, tmp_path), minilm_llm, first_stage="sparse", sparse_model=splade) as index:
        assert index.config.sparse_model == splade.model_config.model
        index.add(texts, ids)
        index.optimize()
        got = index.search(queries, k=5, prefetch=15)
    for qi, (hits, cand) in enumerate(zip(got, sparse_candidates(splade, queries, texts, 15))):
        want = exact([qs[qi]], [docs[c] for c in cand], [ids[c] for c in cand], 5)[0]
        assert [h.id for h in hits] == [w[0] for w in want], qi
        assert np.allclose([h.score for h in hits], [w[1] for w in want], atol=1e-4)
    if location == "edge":  # reopened, the sparse model loaded from the recipe (dtype auto: ids compared)
        with Index.open(where(location, tmp_path), minilm_llm) as index:
            again = index.search(queries, k=5, prefetch=15)
            assert index.sparse_llm is not index.llm
        assert sum([h.id for h in a] == [h.id for h in g] for a, g in zip(again, got)) >= len(got) - 1
    with Index.create(tmp_path / "z", minilm_llm, first_stage="sparse", sparse_model=splade) as index:
        one = [docs[0]]
        for bad, message in [
            (([-1, 3], [0.5, 0.5]), "integers in"),
            (([1.5, 3.0], [0.5, 0.5]), "integers in"),
            (([3, 3], [0.5, 0.5]), "must not repeat"),
            (([3], [0.5, 0.5]), "of one length"),
        ]:
            with pytest.raises(ValueError, match=message):
                index.add_vectors(["d"], one, sparse=[bad])
        index.add_vectors(["d"], one, sparse=[(torch.tensor([3, 7]), torch.tensor([0.5, 1.0], dtype=torch.bfloat16))])
        with pytest.raises(ValueError, match="query 0 has an empty sparse vector"):
            index.search_vectors([qs[0]], sparse=[([], [])])
    with pytest.raises(ValueError, match="needs sparse_model"):
        Index.create(tmp_path / "x", minilm_llm, first_stage="sparse")
    with pytest.raises(ValueError, match="goes with first_stage 'sparse'"):
        Index.create(tmp_path / "w", minilm_llm, first_stage="dense", sparse_model=splade)
    with pytest.raises(ValueError, match="has no embed_sparse"):
        Index.create(tmp_path / "y", minilm_llm, first_stage="sparse", sparse_model=minilm_llm)


def test_sparse_first_stage_from_the_token_model(minilm_path, corpus, tmp_path):
    """A model with both outputs (bge-m3's layout, seeded heads): token vectors and sparse vectors from one pass."""
    from polyvec import LLM
    from tests.helpers import save_tiny_m3

    folder = save_tiny_m3(tmp_path / "m3", minilm_path)
    ids, texts, queries = corpus
    m3 = LLM(str(folder), dtype="float32")
    assert all((o.outputs.data > 0).sum() > 3 for o in m3.embed_sparse(queries, use_tqdm=False))
    with Index.create(tmp_path / "idx", m3, first_stage="sparse") as index:
        assert index.config.sparse_model == index.config.model and index._tasks() == ["token_embed", "embed_sparse"]
        index.add(texts, ids)
        got = index.search(queries, k=5, prefetch=15)
    docs = [o.outputs.data for o in m3.token_embed(texts, use_tqdm=False)]
    qs = [o.outputs.data for o in m3.token_embed(queries, PoolingParams(input_type="query"), use_tqdm=False)]
    for qi, (hits, cand) in enumerate(zip(got, sparse_candidates(m3, queries, texts, 15))):
        want = exact([qs[qi]], [docs[c] for c in cand], [ids[c] for c in cand], 5)[0]
        assert [h.id for h in hits] == [w[0] for w in want], qi


@pytest.mark.parametrize("quantization", ["int8", "binary"])
def test_quantized_vectors_rescored(minilm_llm, corpus, encoded, tmp_path, quantization):
    """Codes in RAM pick the candidates and the float32 originals re-score them (rescore=True; Qdrant's default
    is on for binary, off for int8): with 4x oversampling the top 10 and its scores are the exact ones."""
    ids, texts, queries = corpus
    docs, qs = encoded
    with Index.create(tmp_path / "idx", minilm_llm, first_stage="none", quantization=quantization) as index:
        index.add(texts, ids)
        index.optimize()
        want = exact(qs, docs, ids, 10)
        assert_same(index.search(queries, k=10, rescore=True, oversampling=4.0), want)


def test_bad_arguments(minilm_llm, tmp_path):
    with pytest.raises(ValueError, match="first_stage must be one of"):
        Index.create(tmp_path / "a", minilm_llm, first_stage="bm25")
    with pytest.raises(ValueError, match="quantization must be one of"):
        Index.create(tmp_path / "a", minilm_llm, quantization="int4")
    with pytest.raises(ValueError, match=r"muvera.dim_proj \(500\) must not exceed"):
        Index.create(tmp_path / "a", minilm_llm, muvera={"dim_proj": 500, "r_reps": 1})
    with pytest.raises(ValueError, match="shards and replicas apply to a Qdrant server"):
        Index.create(tmp_path / "a", minilm_llm, shards=2)
    with Index.create(":memory:", minilm_llm, first_stage="none", shards=2, replicas=2) as index:
        assert len(index) == 0
    with Index.create(tmp_path / "b", minilm_llm, first_stage="none") as index:
        with pytest.raises(ValueError, match=r"document 'x': expected token vectors of shape \(n >= 1, 384\)"):
            index.add_vectors(["x"], [np.zeros((3, 128), dtype=np.float32)])
        with pytest.raises(ValueError, match="k must be a positive integer, got 0"):
            index.search_vectors([np.ones((2, 384), dtype=np.float32)], k=0)
        # Qdrant's own options: a negative hnsw_ef overflowed in the embedded index, was taken by a server
        for option, message in (({"hnsw_ef": -5}, "hnsw_ef must be a positive integer"),
                                ({"oversampling": 0}, "oversampling must be a number of at least 1")):  # fmt: skip
            with pytest.raises(ValueError, match=message):
                index.search("wing", **option)


@pytest.mark.parametrize("first_stage", ["dense", "muvera"])
def test_no_query_finds_nothing(minilm_llm, tmp_path, first_stage):
    """An empty list of queries: no results (a dense first stage stacked no embeddings: RuntimeError)."""
    with Index.create(tmp_path / "e", minilm_llm, first_stage=first_stage) as index:
        index.add(["a wing", "a flap"])
        assert index.search([]) == [] and index.search_vectors([]) == []


def test_one_call_repeating_an_id_is_refused(minilm_llm, tmp_path):
    """Two documents under one id in one call: the second replaced the first, and add said two were added."""
    with Index.create(tmp_path / "r", minilm_llm, first_stage="none") as index:
        with pytest.raises(ValueError, match="id 2 repeats 'x', the id of document 0"):
            index.add(["aaa", "bbb", "ccc"], ["x", "y", "x"])
        assert len(index) == 0
        with pytest.raises(ValueError, match="id 1 repeats 'x'"):
            index.add(["aaa", "bbb"], ["x", "x"], batch_size=1)  # across batches too


def test_the_recipe_keeps_the_models_options(minilm_path, corpus, tmp_path, capsys):
    """A model loaded with options that shape its vectors (a Matryoshka override and a pooler_config's
    dimensions cut token vectors to 128): the index took the config's 384 and refused every document; and
    `Index.open` / `polyvec search` loaded the model without them, so queries did not fit. The recipe now keeps
    the width the model gives and its loading options."""
    from polyvec import LLM

    options = {"hf_overrides": {"is_matryoshka": True}, "pooler_config": {"dimensions": 128}}
    llm = LLM(str(minilm_path), dtype="float32", **options)
    ids, texts, queries = corpus
    path = tmp_path / "m"
    with Index.create(path, llm, first_stage="none") as index:
        assert index.config.dim == 128 and index.config.engine == {**options, "dtype": "float32"}
        index.add(texts[:20], ids[:20])
        want = index.search(queries[:2], k=3)
    with Index.create(tmp_path / "d", llm, first_stage="dense") as dense:  # the embedding is cut to 128 too
        assert dense.config.dense_dim == 128 and dense.add(texts[:4], ids[:4]) == 4
    with Index.open(path) as reopened:  # the model loaded again with the options, its dtype included
        assert_same(reopened.search(queries[:2], k=3), [[(h.id, h.score) for h in hits] for hits in want])
    corpus_file = tmp_path / "c.jsonl"
    corpus_file.write_text("".join(json.dumps({"_id": i, "text": t}) + "\n" for i, t in zip(ids[:20], texts[:20])))
    idx = str(tmp_path / "cli")
    code, err = _main(capsys, "index", str(corpus_file), "--index", idx, "--model", str(minilm_path), "--quiet",
                      "--first-stage", "none", "--dtype", "float32", "--hf-overrides", '{"is_matryoshka": true}',
                      "--pooler-config", '{"dimensions": 128}')  # fmt: skip
    assert code == 0, err
    code, err = _main(capsys, "search", "--index", idx, "--dtype", "float32", "-k", "3", queries[0])
    assert code == 0, err


def test_cli_index_and_search(minilm_path, corpus, tmp_path):
    ids, texts, queries = corpus
    env_cmd = [sys.executable, "-m", "polyvec"]
    idx = str(tmp_path / "cli.idx")
    common = ["--model", str(minilm_path), "--dtype", "float32"]
    r = subprocess.run([*env_cmd, "index", str(DATA / "corpus.jsonl"), "--index", idx, *common, "--quiet",
                        "--index-quantization", "int8"], capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert f"indexed {len(ids)} documents" in r.stdout and "quantization int8" in r.stdout
    r = subprocess.run([*env_cmd, "search", "--index", idx, "--dtype", "float32", "-k", "3", queries[0], queries[1]],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["query"] for row in rows] == queries[:2] and all(len(row["hits"]) == 3 for row in rows)
    assert all(h["id"] in ids for row in rows for h in row["hits"])
    run = tmp_path / "run.trec"
    r = subprocess.run([*env_cmd, "search", "--index", idx, "--queries", str(DATA / "queries.jsonl"), "-k", "2",
                        "--format", "trec", "--output", str(run), "--dtype", "float32"],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
    lines = run.read_text().splitlines()
    assert len(lines) == 2 * len((DATA / "queries.jsonl").read_text().splitlines())
    assert lines[0].split()[1] == "Q0" and lines[0].split()[3] == "1"
    r = subprocess.run([*env_cmd, "index", str(DATA / "corpus.jsonl"), "--index", idx, *common, "--quiet"],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 2 and "already holds an index" in r.stderr


def test_cli_sparse_first_stage(minilm_path, splade_path, corpus, tmp_path):
    ids, texts, queries = corpus
    idx = str(tmp_path / "sparse.idx")
    cmd = [sys.executable, "-m", "polyvec", "index", str(DATA / "corpus.jsonl"), "--index", idx, "--model",
           str(minilm_path), "--dtype", "float32", "--quiet", "--first-stage", "sparse"]  # fmt: skip
    r = subprocess.run([*cmd, "--sparse-model", str(splade_path)], capture_output=True, text=True)
    assert r.returncode == 0 and "first stage sparse" in r.stdout, r.stderr
    r = subprocess.run([sys.executable, "-m", "polyvec", "search", "--index", idx, "--dtype", "float32", "-k", "3",
                        queries[0]], capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
    hits = json.loads(r.stdout)["hits"]
    assert len(hits) == 3 and all(h["id"] in ids for h in hits)
    r = subprocess.run([*cmd, "--overwrite"], capture_output=True, text=True)  # MiniLM has no sparse output
    assert r.returncode == 2 and "needs sparse_model" in r.stderr


def test_add_checks_texts_and_ids(minilm_llm, tmp_path):
    with Index.create(tmp_path / "ids", minilm_llm, first_stage="none") as index:
        assert index.add("one text, one document") == 1 and len(index) == 1  # not one per character
        assert index.add(["a second"], [7]) == 1  # an integer id is its decimal string
        hits = index.search("a second", k=2)[0]
        assert {h.id for h in hits} == {"0", "7"}
        with pytest.raises(ValueError, match="^1 ids for 2 documents$"):
            index.add(["x", "y"], ["x"])
        with pytest.raises(ValueError, match="^3 ids for 2 documents$"):
            index.add(["x", "y"], ["x", "y", "z"])
        with pytest.raises(ValueError, match="fewer ids than documents: document 1 has no id"):
            index.add(iter(["x", "y"]), iter(["x"]))
        with pytest.raises(ValueError, match="more ids than documents"):
            index.add(iter(["x"]), iter(["x2", "y2"]))
        with pytest.raises(ValueError, match=r"id 0 is float 1\.5, not a string"):
            index.add(["x"], [1.5])
        index.add(["explicit"], ["5"])
        count = len(index)
        with pytest.raises(ValueError, match="'5' is a document's id already: give ids"):
            index.add(["would replace it"] * 3)  # positions 4, 5, 6 from the index's size
        assert len(index) == count and index.search("explicit", k=1)[0][0].id == "5"


def _main(capsys, *argv: str) -> tuple[int, str]:
    from polyvec.entrypoints.cli import main

    code = main(list(argv))
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"_id": "a", "text": "x"}', '{"_id": "a", "text": "y"}'], "line 2 repeats the id 'a' of line 1"),
        (['{"_id": "1", "text": "x"}', '{"text": "y"}'], "line 2 has no '_id' or 'id', and line 1 has one"),
        (['{"text": "y"}', "", '{"id": 4, "text": "x"}'], "line 1 has no '_id' or 'id', and line 3 has one"),
        (['{"_id": null, "text": "x"}'], "line 1 has null in field '_id', not a string"),
        (['{"_id": "a", "text": "x"}', "not json"], "line 2 is not valid JSON (Expecting value, column 1)"),
    ],
)
def test_cli_index_refuses_ambiguous_corpus_ids(capsys, tmp_path, minilm_path, lines, message):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join(lines) + "\n")
    code, err = _main(capsys, "index", str(corpus), "--index", str(tmp_path / "i"), "--model", str(minilm_path))
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_cli_index_and_search_refusals(capsys, tmp_path, minilm_path, splade_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"_id": "a", "text": "flutter of wings"}\n{"_id": "b", "text": "heat transfer"}\n')
    idx = str(tmp_path / "i")
    code, err = _main(capsys, "index", str(corpus), "--index", idx, "--model", str(minilm_path), "--first-stage",
                      "none", "--muvera", '{"k_sim": 3}')  # fmt: skip
    assert code == 2 and "--muvera goes with --first-stage muvera" in err
    # an --index path that cannot be made (through a file here; a folder this user may not write alike): one
    # line, not PermissionError's traceback
    code, err = _main(capsys, "index", str(corpus), "--index", str(corpus / "i"), "--model", str(minilm_path),
                      "--first-stage", "none")  # fmt: skip
    assert code == 2 and f"cannot write --index {corpus / 'i'}: Not a directory" in err and err.count("\n") == 1
    code, err = _main(capsys, "index", str(corpus), "--index", idx, "--model", str(minilm_path), "--quiet",
                      "--first-stage", "none", "--dtype", "float32")  # fmt: skip
    assert code == 0, err
    queries = tmp_path / "q.txt"
    queries.write_text("flutter\n\nheat\n")
    code, err = _main(capsys, "search", "--index", idx, "wings", "--queries", str(queries))
    assert code == 2 and "give queries as arguments or with --queries FILE, not both" in err
    code, err = _main(capsys, "search", "--index", idx, "wings", "--output", str(tmp_path / "no" / "such" / "f"))
    assert code == 2 and "cannot write" in err and "No such file or directory" in err
    code, err = _main(capsys, "search", "--index", idx, "wings", "--model", str(splade_path))
    assert code == 2 and f"--model {splade_path} does not fit the index" in err and err.count("\n") == 1, err


def test_cli_search_skips_blank_query_lines(capsys, tmp_path, minilm_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"_id": "a", "text": "flutter of wings"}\n{"_id": "b", "text": "heat transfer"}\n')
    idx = str(tmp_path / "i")
    assert _main(capsys, "index", str(corpus), "--index", idx, "--model", str(minilm_path), "--quiet",
                 "--first-stage", "none")[0] == 0  # fmt: skip
    capsys.readouterr()
    queries = tmp_path / "q.txt"
    queries.write_text("flutter\n\nheat\n")
    from polyvec.entrypoints.cli import main

    assert main(["search", "--index", idx, "--queries", str(queries), "-k", "1", "--format", "trec"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["0", "2"]  # line numbers as ids; the blank line is no query
    assert [line.split()[2] for line in lines] == ["a", "b"]


def test_one_handle_at_a_time_on_an_embedded_index(minilm_llm, tmp_path):
    """A second handle on an open embedded index (another process, or this one) is refused: two writers each
    kept their own view, and the last to close dropped the other's documents."""
    idx = tmp_path / "locked"
    first = Index.create(idx, minilm_llm, first_stage="none")
    first.add(["a wing"], ["a"])
    for attempt in (lambda: Index.open(idx, minilm_llm), lambda: Index.create(idx, minilm_llm, overwrite=True)):
        with pytest.raises(ValueError, match="is open elsewhere .*close it first"):
            attempt()
    code = "from polyvec.index import Index; Index.open(__import__('sys').argv[1])"
    r = subprocess.run([sys.executable, "-c", code, str(idx)], capture_output=True, text=True)
    assert r.returncode != 0 and "is open elsewhere" in r.stderr, r.stderr[-500:]
    first.close()
    with Index.open(idx, minilm_llm) as again:
        again.add(["a flap"], ["b"])
    with Index.open(idx, minilm_llm) as again:
        assert len(again) == 2
    # closing twice (a `with` block, then close()) does nothing; using a closed index says so (both were Qdrant's
    # bare "Shard is not initialized")
    again.close()
    for use in (lambda: len(again), lambda: again.add(["a slat"], ["c"]), lambda: again.search(["wing"])):
        with pytest.raises(ValueError, match="this index is closed"):
            use()
    with Index.open(idx, minilm_llm) as again:
        assert len(again) == 2


def test_damaged_index_folders_are_named(minilm_llm, tmp_path):
    """A recipe that is not an index's, or a shard gone: a ValueError naming the folder (were a TypeError, an
    AttributeError and Qdrant's own exception, tracebacks from the CLI)."""
    import shutil

    good = tmp_path / "good"
    with Index.create(good, minilm_llm, first_stage="none") as index:
        index.add(["a wing"])
    recipe = json.loads((good / "polyvec-index.json").read_text())
    for name, damage in (
        ("no-dim", lambda d: (d / "polyvec-index.json").write_text(json.dumps({k: v for k, v in recipe.items()
                                                                                if k != "dim"}))),
        ("list", lambda d: (d / "polyvec-index.json").write_text("[]")),
        ("not-json", lambda d: (d / "polyvec-index.json").write_text("{")),
        ("no-shard", lambda d: shutil.rmtree(d / "shard")),
    ):  # fmt: skip
        folder = tmp_path / name
        shutil.copytree(good, folder)
        damage(folder)
        with pytest.raises(ValueError, match=f"{folder} is not a readable polyvec index: "):
            Index.open(folder)
    with Index.open(good, minilm_llm) as index:  # a refused open left no lock behind
        assert len(index) == 1


def test_the_recipe_names_a_local_model_by_its_whole_path(tmp_path, monkeypatch):
    """A model folder given relative to the working directory is kept absolute: `polyvec search` from another
    directory could not find it, or loaded another folder or a hub model of that name."""
    (tmp_path / "colbert").mkdir()
    monkeypatch.chdir(tmp_path)
    with Index.create(tmp_path / "rel", model="colbert", dim=4, first_stage="none") as index:
        assert index.config.model == str(tmp_path / "colbert")
    with Index.create(tmp_path / "hub", model="org/not-a-folder", dim=4, first_stage="none") as index:
        assert index.config.model == "org/not-a-folder"  # a hub id as given
    from polyvec.index.index import stored_name

    # polyvec search --model compares by it: the recipe's folder by any spelling is the recipe's model
    assert stored_name("./colbert") == stored_name(str(tmp_path / "." / "colbert")) == str(tmp_path / "colbert")


def test_blank_texts_ids_and_huge_k_are_refused(minilm_llm, tmp_path):
    """Empty or blank documents were indexed and ranked first for any query (their marker tokens alone), an empty
    query was searched, an empty id was stored, k past 64 bits was an OverflowError from Qdrant, and a prompt
    dict as the query searched its keys."""
    with Index.create(tmp_path / "blank", minilm_llm, first_stage="none") as index:
        index.add(["cone flow over a body", "heat transfer"], ["a", "b"])
        for docs, message in ((["x", ""], "document 1 is empty"), (["   "], "document 0 is blank")):
            with pytest.raises(ValueError, match=message):
                index.add(docs, [f"n{i}" for i in range(len(docs))])
        with pytest.raises(ValueError, match="id 0 is empty"):
            index.add(["y"], [""])
        assert len(index) == 2
        for query, message in (("", "query 0 is empty"), (["x", " \n"], "query 1 is blank")):
            with pytest.raises(ValueError, match=message):
                index.search(query)
        for option in ("k", "prefetch", "hnsw_ef"):
            with pytest.raises(ValueError, match=f"{option} must be at most 1,000,000, got {2**70}"):
                index.search("cone", **{option: 2**70})
        assert index.search({"prompt": "cone flow"}, k=1) == index.search("cone flow", k=1)
        for blank in ({"prompt": ""}, {"prompt": " \t"}):  # a prompt dict's text likewise
            with pytest.raises(ValueError, match="document 0 is"):
                index.add([blank], ["d"])
            with pytest.raises(ValueError, match="query 0 is"):
                index.search(blank)
        with pytest.raises(ValueError, match="document 5 is blank"):  # refused before a batch is written
            index.add(["a", "b", "c", "d", "e", " "], [f"x{i}" for i in range(6)], batch_size=2)
        assert len(index) == 2


def test_cli_names_the_query_and_writes_nothing_on_an_error(capsys, tmp_path, minilm_path):
    """A refused query past the first 64 was named by its place among its 64 (the 70th as "query 5"), after
    the runs of the first 64 had been written; ids with whitespace broke a TREC run's columns; a blank line of a
    plain-text corpus was indexed."""
    lines = tmp_path / "lines.txt"
    lines.write_text("wing flutter\n\nheat transfer\n")
    idx = str(tmp_path / "i")
    code, err = _main(capsys, "index", str(lines), "--index", idx, "--model", str(minilm_path), "--quiet",
                      "--first-stage", "none")  # fmt: skip
    assert code == 2 and "document '1' has no text" in err and not Path(idx).exists(), err
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"_id": "doc 1", "text": "flutter of wings"}\n{"_id": "b", "text": "heat transfer"}\n')
    assert _main(capsys, "index", str(corpus), "--index", idx, "--model", str(minilm_path), "--quiet",
                 "--first-stage", "none")[0] == 0  # fmt: skip
    capsys.readouterr()
    from polyvec.entrypoints.cli import main

    assert main(["search", "--index", idx, *(["flutter"] * 69), ""]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "query '69' is empty" in out.err, out.err
    assert main(["search", "--index", idx, "flutter", "--format", "trec"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "the id 'doc 1' has whitespace" in out.err, out.err
    assert main(["search", "--index", idx, "flutter", "-k", "1"]) == 0  # JSON lines hold any id
    assert json.loads(capsys.readouterr().out)["hits"][0]["id"] == "doc 1"
    run = tmp_path / "run.trec"
    assert main(["search", "--index", idx, "flutter", "--format", "trec", "--output", str(run)]) == 2
    assert not run.exists() and not Path(f"{run}.partial").exists()  # nothing half-written left behind
