"""embed_sparse over HTTP: vLLM-style /pooling (indices and values, as Qdrant's sparse vectors take them) and
TEI's /embed_sparse, against the offline results of the same SPLADE-tiny weights."""

from __future__ import annotations

import httpx
import pytest
import torch

from polyvec import LLM, PoolingParams
from tests.entrypoints.server.conftest import Server
from tests.helpers import save_inference_free_splade

TEXTS = ["the wing stalls at high angle of attack", "heat transfer in laminar boundary layers"]


@pytest.fixture(scope="module")
def splade(splade_path):
    s = Server(str(splade_path))
    yield s, LLM(str(splade_path), dtype="float32")
    s.stop()


def test_pooling_embed_sparse(splade):
    server, llm = splade
    body = server.post("/pooling", {"input": TEXTS, "task": "embed_sparse", "return_tokens": True}).json()
    want = llm.embed_sparse(TEXTS, PoolingParams(return_tokens=True), use_tqdm=False)
    for item, w in zip(body["data"], want):
        assert item["shape"] == [30522] and item["data"]["indices"] == w.outputs.indices
        assert item["data"]["tokens"] == w.outputs.tokens
        assert item["data"]["values"] == pytest.approx(w.outputs.values, rel=1e-6, abs=1e-7)
    top = server.post("/pooling", {"input": TEXTS[0], "task": "embed_sparse", "sparse_top_k": 3}).json()
    assert len(top["data"][0]["data"]["indices"]) == 3 and "tokens" not in top["data"][0]["data"]
    r = server.post("/pooling", {"input": TEXTS[0], "task": "embed_sparse", "encoding_format": "base64"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "encoding_format"
    r = server.post("/pooling", {"input": TEXTS[0], "task": "token_classify", "sparse_top_k": 3})
    assert r.status_code == 400 and "sparse_top_k applies to embed_sparse" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "sparse_top_k"
    for name in ("normalize", "use_activation"):  # the field named in `param` too, not only in the message
        r = server.post("/pooling", {"input": TEXTS[0], "task": "embed_sparse", name: False})
        assert r.status_code == 400 and f"{name}=False is not valid" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == name, r.text


def test_tei_embed_sparse(splade, server):
    s, llm = splade
    assert s.get("/info").json()["model_type"] == {"embedding": {"pooling": "splade"}}  # TEI's name (was "cls")
    body = s.post("/embed_sparse", {"inputs": TEXTS}).json()
    for entries, w in zip(body, llm.embed_sparse(TEXTS, use_tqdm=False)):
        assert [e["index"] for e in entries] == w.outputs.indices
        assert [e["value"] for e in entries] == pytest.approx(w.outputs.values, rel=1e-6, abs=1e-7)
    r = server.post("/embed_sparse", {"inputs": "x"})  # MiniLM: dense only
    assert r.status_code == 424 and "SPLADE" in r.json()["error"]
    r = server.post("/pooling", {"input": "x", "task": "embed_sparse"})
    assert r.status_code == 400 and "Unsupported task" in r.json()["error"]["message"]


def test_tei_embed_of_a_splade_model(splade):
    """TEI's /embed on a SPLADE model: with normalize false its pooled vector over the vocabulary, dense (and
    `dimensions` cut it); with normalize true TEI's refusal (infer.rs `embed_pooled`)."""
    s, llm = splade
    body = s.post("/embed", {"inputs": TEXTS, "normalize": False}).json()
    for dense, w in zip(body, llm.embed_sparse(TEXTS, use_tqdm=False)):
        assert len(dense) == 30522
        assert [i for i, v in enumerate(dense) if v] == w.outputs.indices
        assert [dense[i] for i in w.outputs.indices] == pytest.approx(w.outputs.values, rel=1e-6, abs=1e-7)
    cut = s.post("/embed", {"inputs": TEXTS[0], "normalize": False, "dimensions": 2000}).json()
    assert cut == [body[0][:2000]]
    r = s.post("/embed", {"inputs": TEXTS[0]})
    assert r.status_code == 424 and r.json() == {
        "error": "Backend error: `normalize` is not available for SPLADE models",
        "error_type": "Backend",
    }
    r = s.post("/embed", {"inputs": TEXTS[0], "normalize": False, "dimensions": 40000})
    assert r.status_code == 422 and "smaller than the maximum" in r.json()["error"]
    # /similarity embeds as /embed with normalize false (TEI's server.rs): the cosine of those vectors (was 424)
    r = s.post("/similarity", {"inputs": {"source_sentence": TEXTS[0], "sentences": TEXTS[1:]}})
    assert r.status_code == 200, r.text
    vectors = torch.tensor(body, dtype=torch.float64)
    want = torch.nn.functional.cosine_similarity(vectors[:1], vectors[1:], dim=-1)
    assert r.json() == pytest.approx(want.tolist(), rel=1e-5)


def test_post_root_of_a_splade_model(splade):
    server, _ = splade
    body = {"inputs": TEXTS}
    assert server.post("/", body).json() == server.post("/embed_sparse", body).json()


def test_several_tasks_in_one_request(splade, server, minilm_llm):
    s, llm = splade
    body = s.post("/pooling", {"input": TEXTS, "task": ["embed_sparse", "token_classify"], "sparse_top_k": 4}).json()
    sparse = llm.embed_sparse(TEXTS, PoolingParams(sparse_top_k=4), use_tqdm=False)
    logits = llm.token_classify(TEXTS, use_tqdm=False)
    for item, sp, lg in zip(body["data"], sparse, logits):
        assert set(item["data"]) == {"embed_sparse", "token_classify"}
        assert item["data"]["embed_sparse"]["indices"] == sp.outputs.indices
        assert item["shape"]["token_classify"] == list(lg.outputs.data.shape)
    dense = server.post("/pooling", {"input": TEXTS[0], "task": ["embed", "token_embed"]}).json()["data"][0]
    assert dense["data"]["embed"] == pytest.approx(minilm_llm.embed(TEXTS[0], use_tqdm=False)[0].outputs.embedding)
    assert dense["shape"]["token_embed"][1] == 384
    r = server.post("/pooling", {"input": "x", "task": ["embed", "token_embed"], "encoding_format": "base64"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "encoding_format"
    r = server.post("/pooling", {"input": "x", "task": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "task"


def test_inference_free_queries(splade_path, tmp_path):
    """/pooling with input_type query on inference-free SPLADE: the static query weights, no forward pass."""
    folder = save_inference_free_splade(splade_path, tmp_path / "inference-free")
    llm = LLM(str(folder), dtype="float32")
    s = Server(str(folder))
    try:
        for input_type in ("query", "search_query", "document", None):
            body = {"input": TEXTS, "task": "embed_sparse", "sparse_top_k": 40}
            if input_type is not None:
                body["input_type"] = input_type
            got = s.post("/pooling", body).json()["data"]
            want = llm.embed_sparse(TEXTS, PoolingParams(input_type=input_type, sparse_top_k=40), use_tqdm=False)
            for item, w in zip(got, want):
                assert item["data"]["indices"] == w.outputs.indices
                assert item["data"]["values"] == pytest.approx(w.outputs.values, rel=1e-5, abs=1e-6)
        q = s.post("/pooling", {"input": TEXTS[0], "task": "embed_sparse", "input_type": "query"}).json()["data"][0]
        d = s.post("/pooling", {"input": TEXTS[0], "task": "embed_sparse"}).json()["data"][0]
        assert len(q["data"]["indices"]) < 12 < len(d["data"]["indices"])  # query: its own tokens only
    finally:
        s.stop()


def test_bge_m3_embed_all_gives_its_colbert_vectors(tmp_path, minilm_path):
    """TEI's /embed_all on bge-m3: FlagEmbedding's normalized ColBERT vectors, as /pooling token_embed gives
    (they came projected and without [CLS] yet not normalized: neither raw states nor bge-m3's vectors)."""
    from tests.helpers import save_tiny_m3

    folder = save_tiny_m3(tmp_path / "m3", minilm_path)
    llm = LLM(str(folder), dtype="float32")
    want = llm.token_embed(["the the wing"], use_tqdm=False)[0].outputs.data
    weights = llm.token_classify(["the the wing"], use_tqdm=False)[0].outputs.data
    s = Server(str(folder))
    try:
        got = torch.tensor(httpx.post(s.url + "/embed_all", json={"inputs": "the the wing"}).json()[0])
        pooled = httpx.post(s.url + "/pooling", json={"input": "the the wing", "task": "token_embed"}).json()
        # vLLM's bge-m3 sparse request: /pooling token_classify, one weight per token
        sparse = httpx.post(s.url + "/pooling", json={"input": "the the wing", "task": "token_classify"})
    finally:
        s.stop()
    assert sparse.status_code == 200, sparse.text
    assert torch.allclose(torch.tensor(sparse.json()["data"][0]["data"]), weights, atol=1e-6) and weights.shape == (5,)
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-6)
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(got)), atol=1e-5)
    assert torch.allclose(torch.tensor(pooled["data"][0]["data"]), want, atol=1e-6)


def test_detokenize_cleans_up_spaces_as_the_tokenizer_config_asks(splade, splade_path):
    """vLLM's /detokenize decodes with transformers: SPLADE-tiny's clean_up_tokenization_spaces joins "don ' t"."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(splade_path))("Don't stop, it's fine.")["input_ids"]
    assert splade[0].post("/detokenize", {"tokens": ids}).json() == {"prompt": "[CLS] don't stop, it's fine. [SEP]"}
