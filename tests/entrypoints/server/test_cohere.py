"""Cohere embed v2 and v1 through Cohere's own Python client (`cohere`), against a real `polyvec serve`, checked
against the offline engine on the same weights: every embedding type, truncate END / START / NONE, text
`inputs`, the v1 response shapes, and images refused by name."""

from __future__ import annotations

import base64

import cohere
import httpx
import numpy as np
import pytest
import torch

from tests.helpers import cosine_rows

TEXTS = [
    "experimental investigation of the aerodynamics of a wing in a slipstream",
    "heat transfer to a blunt body",
    "flutter",
]
ALL_TYPES = ["float", "int8", "uint8", "binary", "ubinary", "base64"]
# Words that are one token each in MiniLM's vocabulary (checked by `_one_token_each`), so a cut at a token count
# is a cut at a word count: the kept part of a long text is known as text.
WORDS = "the cat sat on a mat and the dog ran to the park while a bird sang in the old tree by the red house".split()


@pytest.fixture(scope="module")
def co(server):
    with httpx.Client(timeout=120) as http:  # no retries: each call is one request
        yield cohere.ClientV2(base_url=server.url, api_key="unused", httpx_client=http, max_retries=0)


@pytest.fixture(scope="module")
def co_v1(server):
    with httpx.Client(timeout=120) as http:
        yield cohere.Client(base_url=server.url, api_key="unused", httpx_client=http, max_retries=0)


def offline(llm, texts: list[str]) -> torch.Tensor:
    return torch.stack([o.outputs.data for o in llm.embed(texts, use_tqdm=False)]).double()


def int8_rule(vectors: np.ndarray) -> np.ndarray:
    """polyvec's documented int8 rule, per vector: round(127 * x / max|x|)."""
    return np.rint(vectors * 127 / np.abs(vectors).max(axis=1, keepdims=True))


def test_v2_every_embedding_type(co, minilm_llm):
    ref = offline(minilm_llm, TEXTS)
    resp = co.embed(model="minilm", texts=TEXTS, input_type="search_document", embedding_types=ALL_TYPES)
    e = resp.embeddings
    floats = np.array(e.float_, dtype=np.float64)
    assert floats.shape == (3, 384) and cosine_rows(torch.tensor(floats), ref).min() >= 0.9999
    # base64: the same float32 values, little-endian
    decoded = np.stack([np.frombuffer(base64.b64decode(s), dtype="<f4") for s in e.base64]).astype(np.float64)
    assert np.array_equal(decoded, floats)
    # int8: the per-vector rule applied to the float vector the response carries, exactly; uint8 = int8 + 128
    int8 = np.array(e.int8)
    assert int8.shape == (3, 384) and int8.min() >= -127 and int8.max() <= 127
    assert np.abs(int8).max(axis=1).tolist() == [127, 127, 127]
    assert np.array_equal(int8, int8_rule(floats))
    assert cosine_rows(torch.tensor(int8, dtype=torch.float64), ref).min() >= 0.999
    assert np.array_equal(np.array(e.uint8), int8 + 128)
    # binary / ubinary: sign bits (x >= 0), most significant bit first, 48 bytes for 384 dimensions
    ubinary = np.array(e.ubinary, dtype=np.uint8)
    assert ubinary.shape == (3, 48)
    assert np.array_equal(np.unpackbits(ubinary, axis=1).astype(bool), floats >= 0)
    assert np.array_equal(np.array(e.binary), ubinary.astype(np.int16) - 128)
    # Cohere's docs: unpack, then 2b - 1 gives the +-1 vector, close in direction to the float one
    signs = torch.tensor(2.0 * np.unpackbits(ubinary, axis=1) - 1.0)
    assert cosine_rows(signs, ref).min() >= 0.7
    assert resp.texts == TEXTS
    assert resp.meta.api_version.version == "2"
    assert resp.meta.billed_units.input_tokens == sum(
        len(o.prompt_token_ids) for o in minilm_llm.embed(TEXTS, use_tqdm=False)
    )


def test_v2_default_type_is_float_and_codes_do_not_depend_on_the_batch(co, server, minilm_llm):
    alone = co.embed(model="minilm", texts=[TEXTS[1]], input_type="search_query", embedding_types=["int8", "binary"])
    batch = co.embed(model="minilm", texts=TEXTS, input_type="search_query", embedding_types=["int8", "binary"])
    assert batch.embeddings.int8[1] == alone.embeddings.int8[0]
    assert batch.embeddings.binary[1] == alone.embeddings.binary[0]
    body = server.post("/v2/embed", {"texts": TEXTS[:1]}).json()
    assert list(body["embeddings"]) == ["float"] and len(body["embeddings"]["float"][0]) == 384
    assert body["response_type"] == "embeddings_by_type" and body["texts"] == TEXTS[:1]
    tokens = len(minilm_llm.embed(TEXTS[:1], use_tqdm=False)[0].prompt_token_ids)
    billed = {"input_tokens": tokens, "image_tokens": 0}  # vLLM's: image_tokens always (a KeyError before)
    assert body["meta"] == {"api_version": {"version": "2"}, "billed_units": billed}
    assert body["id"].startswith("embd-")


def _one_token_each(server, words: list[str]) -> None:
    tok = server.post("/tokenize", {"prompt": " ".join(words), "add_special_tokens": False}).json()
    assert tok["count"] == len(words), "the test's words must be one token each"


def test_truncate_end_and_start(co, server, minilm_llm):
    words = ["alpha"] * 300 + (WORDS * 12)[:260]
    _one_token_each(server, words)
    text = " ".join(words)
    cases = [
        ("END", 16, words[:14]),  # [CLS] + the first 14 tokens + [SEP]
        ("START", 16, words[-14:]),  # [CLS] + the last 14 tokens + [SEP]
        ("START", None, words[-254:]),  # to max_model_len (256)
        ("END", None, words[:254]),
    ]
    for truncate, max_tokens, kept in cases:
        extra = {} if max_tokens is None else {"max_tokens": max_tokens}
        resp = co.embed(model="minilm", texts=[text], input_type="search_document", truncate=truncate, **extra)
        got = torch.tensor(resp.embeddings.float_, dtype=torch.float64)
        assert cosine_rows(got, offline(minilm_llm, [" ".join(kept)])).item() >= 0.9999, (truncate, max_tokens)
        assert resp.meta.billed_units.input_tokens == len(kept) + 2
    # A text within max_tokens is not cut, on either side.
    short = co.embed(model="minilm", texts=[TEXTS[1]], input_type="search_document", truncate="START", max_tokens=64)
    got = torch.tensor(short.embeddings.float_, dtype=torch.float64)
    assert cosine_rows(got, offline(minilm_llm, TEXTS[1:2])).item() >= 0.9999


def test_truncate_none_rejects_long_input(co, server):
    long = "word " * 300
    with pytest.raises(cohere.core.ApiError) as exc:
        co.embed(model="minilm", texts=["fine", long], input_type="search_document", truncate="NONE")
    assert exc.value.status_code == 400
    message = exc.value.body["error"]["message"]  # with what Cohere's body offers, not /v1/embeddings' fields
    assert (
        "'texts' item 1 has 302 tokens, more than the maximum input length of 256 tokens; shorten it, or send "
        "truncate END or START to cut it"
        in message
        and "truncate_prompt_tokens" not in message
    ), message
    twenty = "word " * 20
    with pytest.raises(cohere.core.ApiError) as exc:
        co.embed(model="minilm", texts=["fine", twenty], input_type="search_document", truncate="NONE", max_tokens=8)
    assert exc.value.status_code == 400
    error = exc.value.body["error"]
    assert "'texts' item 1 has 22 tokens, more than max_tokens=8" in error["message"] and error["param"] == "max_tokens"
    ok = co.embed(model="minilm", texts=["fine"], input_type="search_document", truncate="NONE", max_tokens=8)
    assert ok.meta.billed_units.input_tokens == 3


def test_v2_text_inputs(co, minilm_llm):
    inputs = [
        {"content": [{"type": "text", "text": TEXTS[0]}]},
        {"content": [{"type": "text", "text": "heat transfer"}, {"type": "text", "text": "to a blunt body"}]},
    ]
    resp = co.embed(model="minilm", inputs=inputs, input_type="search_document", embedding_types=["float", "int8"])
    ref = offline(minilm_llm, [TEXTS[0], "heat transfer\nto a blunt body"])  # text parts join with a newline
    assert cosine_rows(torch.tensor(resp.embeddings.float_, dtype=torch.float64), ref).min() >= 0.9999
    assert len(resp.embeddings.int8) == 2
    assert not resp.texts  # texts are echoed for `texts` only


def test_images_are_refused_by_name(co, server):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    with pytest.raises(cohere.core.ApiError) as exc:
        co.embed(
            model="minilm",
            inputs=[{"content": [{"type": "text", "text": "a cat"}, image]}],
            input_type="search_document",
            embedding_types=["float"],
        )
    assert exc.value.status_code == 400
    assert exc.value.body["error"]["message"] == (
        "'inputs' item 0 content 1 is an image_url part; images are not supported yet; this server embeds text"
    )
    for path in ("/v2/embed", "/v1/embed"):
        r = server.post(path, {"images": ["data:image/png;base64,iVBORw0KGgo="], "input_type": "image"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "images", r.text


def test_v1_floats_and_by_type(co_v1, server, minilm_llm):
    ref = offline(minilm_llm, TEXTS)
    floats = co_v1.embed(texts=TEXTS, model="minilm", input_type="search_query")
    assert floats.response_type == "embeddings_floats"
    assert cosine_rows(torch.tensor(floats.embeddings, dtype=torch.float64), ref).min() >= 0.9999
    assert floats.texts == TEXTS and floats.meta.api_version.version == "1"
    typed = co_v1.embed(texts=TEXTS, model="minilm", input_type="search_query", embedding_types=["float", "ubinary"])
    assert typed.response_type == "embeddings_by_type"
    assert cosine_rows(torch.tensor(typed.embeddings.float_, dtype=torch.float64), ref).min() >= 0.9999
    assert len(typed.embeddings.ubinary[0]) == 48
    # The raw bodies, key by key.
    body = server.post("/v1/embed", {"texts": TEXTS[:2]}).json()
    assert set(body) == {"response_type", "id", "embeddings", "texts", "meta"}
    assert body["response_type"] == "embeddings_floats" and len(body["embeddings"]) == 2
    assert body["meta"]["api_version"] == {"version": "1"} and body["meta"]["billed_units"]["input_tokens"] > 0
    body = server.post("/v1/embed", {"texts": TEXTS[:2], "embedding_types": ["int8"]}).json()
    assert body["response_type"] == "embeddings_by_type" and list(body["embeddings"]) == ["int8"]


def test_rerank_with_both_clients(co, co_v1, minilm_llm):
    """Cohere's clients rerank as with Cohere: v2 with texts, v1 with texts or its `{"text": ...}` documents."""
    query, docs = "a dog in the park", ["the cat sat on a mat", "the dog ran to the park", "a bird sang"]
    want = [o.outputs.score for o in minilm_llm.score(query, docs, use_tqdm=False)]
    order = sorted(range(3), key=lambda i: -want[i])
    for response in (
        co.rerank(model="minilm", query=query, documents=docs, top_n=2),
        co_v1.rerank(query=query, documents=docs, top_n=2),
        co_v1.rerank(query=query, documents=[{"text": d} for d in docs], top_n=2, return_documents=True),
    ):
        assert [r.index for r in response.results] == order[:2]
        assert all(abs(r.relevance_score - want[r.index]) < 1e-5 for r in response.results)
    assert response.results[0].document is not None and response.results[0].document.text == docs[order[0]]


def test_cohere_rank_fields_and_null_options(co_v1, server, minilm_llm):
    """Cohere v1's rank_fields pick the fields of object documents (one alone, several as "field: value" lines)
    and max_chunks_per_doc is accepted (both were 400 "unknown field"); an option sent as null is its default, as
    the Cohere SDK sends an explicit None (a 400 before)."""
    query = "a dog in the park"
    docs = [{"title": "Parks", "text": "the dog ran to the park"}, {"title": "Cats", "text": "the cat sat on a mat"}]
    joined = [f"title: {d['title']}\ntext: {d['text']}" for d in docs]
    want = [o.outputs.score for o in minilm_llm.score(query, joined, use_tqdm=False)]
    got = co_v1.rerank(query=query, documents=docs, rank_fields=["title", "text"], max_chunks_per_doc=4)
    assert sorted((r.index, round(r.relevance_score, 5)) for r in got.results) == [
        (i, round(w, 5)) for i, w in enumerate(want)
    ]
    titles = [o.outputs.score for o in minilm_llm.score(query, [d["title"] for d in docs], use_tqdm=False)]
    got = co_v1.rerank(query=query, documents=docs, rank_fields=["title"], return_documents=True)
    assert {r.index: r.relevance_score for r in got.results} == pytest.approx(dict(enumerate(titles)), abs=1e-5)
    # the documents come back as sent, all their fields (not the text they were ranked by)
    assert {r.index: r.document.text for r in got.results} == {0: docs[0]["text"], 1: docs[1]["text"]}
    r = server.post("/v1/rerank", {"query": query, "documents": docs[0], "rank_fields": ["title"]}).json()
    assert r["results"][0]["document"] == docs[0]  # one object alone, read through rank_fields too
    assert r["results"][0]["relevance_score"] == pytest.approx(titles[0], abs=1e-5)
    numbers = [{"text": "the dog ran", "year": 2020}]
    want_year = minilm_llm.score(query, ["text: the dog ran\nyear: 2020"], use_tqdm=False)[0].outputs.score
    r = server.post("/v1/rerank", {"query": query, "documents": numbers, "rank_fields": ["text", "year"]}).json()
    assert r["results"][0]["relevance_score"] == pytest.approx(want_year, abs=1e-5)  # a number was dropped
    nulls = {"truncate": None, "priority": None}
    r = server.post("/v2/embed", {"texts": ["wing"], "input_type": "search_document", **nulls})
    assert r.status_code == 200, r.text
    r = server.post("/v2/embed", {"texts": ["wing"], "input_type": "search_document", "priority": 2**64})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text  # vLLM's 64-bit bound
    body = {"query": query, "documents": ["a", "b"], "top_n": None, "return_documents": None, "priority": None}
    r = server.post("/v2/rerank", {**body, "max_tokens_per_doc": None, "max_tokens_per_query": None})
    assert r.status_code == 200 and len(r.json()["results"]) == 2 and "document" in r.json()["results"][0], r.text
