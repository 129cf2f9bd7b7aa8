"""Hugging Face text-embeddings-inference (TEI) routes: bodies, defaults and results checked against the offline
engine on the same weights, and TEI's error body and statuses."""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from polyvec import LLM, PoolingParams, __version__
from tests.entrypoints.server.conftest import in_process_server
from tests.helpers import TINY, save_tiny_model

TEXTS = ["experimental investigation of the aerodynamics of a wing in a slipstream", "heat transfer", "flutter"]
LONG = " ".join(f"word{i}" for i in range(60))  # far over 32 tokens
INFO_FIELDS = {
    "model_id",
    "model_sha",
    "model_dtype",
    "served_model_name",
    "model_type",
    "max_concurrent_requests",
    "max_input_length",
    "max_batch_tokens",
    "max_batch_requests",
    "max_client_batch_size",
    "auto_truncate",
    "tokenization_workers",
    "version",
    "sha",
    "docker_label",
}


def embed_ref(llm, prompts, **params) -> torch.Tensor:
    return torch.stack([o.outputs.data for o in llm.embed(prompts, PoolingParams(**params), use_tqdm=False)])


def tei_error(r: httpx.Response, status: int, kind: str) -> str:
    """The message of TEI's error body, after checking the status and the body's shape."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error", "error_type"} and body["error_type"] == kind, body
    return body["error"]


def left_ids(llm, text: str, most: int) -> list[int]:
    """`text` cut to its last tokens by `tokenizers` itself (TEI's Left truncation), special tokens kept."""
    tok = Tokenizer.from_str(llm.engine.tokenizer._base.to_str())
    tok.enable_truncation(most, direction="left")
    return tok.encode(text).ids


# ---------------------------------------------------------------------------------------------- /embed


def test_embed_matches_offline(server, minilm_llm):
    ref = embed_ref(minilm_llm, TEXTS)
    r = server.post("/embed", {"inputs": TEXTS[0]})
    assert r.status_code == 200, r.text
    assert len(r.json()) == 1 and torch.allclose(torch.tensor(r.json()), ref[:1], atol=1e-6)
    tokens = sum(len(o.prompt_token_ids) for o in minilm_llm.embed(TEXTS[:1], use_tqdm=False))
    assert r.headers["x-compute-tokens"] == str(tokens) and r.headers["x-compute-characters"] == str(len(TEXTS[0]))
    # TEI's stage times (ms): tokenization, the wait for a forward pass, the passes; within the request's total
    stages = [int(r.headers[f"x-{name}-time"]) for name in ("tokenization", "queue", "inference")]
    assert min(stages) >= 0 and sum(stages) <= int(r.headers["x-total-time"]) + 2, (stages, r.headers)
    batch = server.post("/embed", {"inputs": TEXTS}).json()
    assert torch.allclose(torch.tensor(batch), ref, atol=1e-6)
    assert abs(float(torch.tensor(batch[0]).norm()) - 1) < 1e-5  # normalize defaults to true
    # Token ids: one input, a batch of them, and a batch mixing texts and ids (as TEI's Input allows).
    ids = minilm_llm.embed(TEXTS[1], use_tqdm=False)[0].prompt_token_ids
    for inputs, want in ((ids, ref[1:2]), ([ids, ids], ref[[1, 1]]), ([TEXTS[0], ids], ref[[0, 1]])):
        got = server.post("/embed", {"inputs": inputs}).json()
        assert torch.allclose(torch.tensor(got), want, atol=1e-5), inputs


def test_embed_normalize_and_dimensions(server, minilm_llm):
    raw = embed_ref(minilm_llm, TEXTS[:2], use_activation=False)
    got = torch.tensor(server.post("/embed", {"inputs": TEXTS[:2], "normalize": False}).json())
    assert torch.allclose(got, raw, atol=1e-5) and (got.norm(dim=-1) - 1).abs().min() > 0.1
    # TEI's Matryoshka: the first values, then normalized (any model, as TEI; MiniLM declares no Matryoshka sizes)
    cut = torch.tensor(server.post("/embed", {"inputs": TEXTS[:2], "dimensions": 128}).json(), dtype=torch.float64)
    assert cut.shape == (2, 128) and torch.allclose(cut, F.normalize(raw[:, :128].double(), dim=-1), atol=1e-6)
    bare = torch.tensor(server.post("/embed", {"inputs": TEXTS[:2], "dimensions": 128, "normalize": False}).json())
    assert torch.allclose(bare, raw[:, :128], atol=1e-5)
    full = server.post("/embed", {"inputs": TEXTS[:2], "dimensions": 384}).json()
    assert torch.allclose(torch.tensor(full), embed_ref(minilm_llm, TEXTS[:2]), atol=1e-6)
    r = server.post("/embed", {"inputs": "x", "dimensions": 0})
    assert tei_error(r, 422, "Validation") == "Input validation error: `dimensions` should be positive"
    r = server.post("/embed", {"inputs": "x", "dimensions": 385})
    msg = "Input validation error: `dimensions` should be smaller than the maximum embedding dimension."
    assert tei_error(r, 422, "Validation") == msg


def test_embed_all_matches_token_embed(server, minilm_llm):
    r = server.post("/embed_all", {"inputs": TEXTS[:2]})
    assert r.status_code == 200, r.text
    ref = [
        o.outputs.data for o in minilm_llm.token_embed(TEXTS[:2], PoolingParams(use_activation=False), use_tqdm=False)
    ]
    for got, want in zip(r.json(), ref):
        got = torch.tensor(got)
        assert got.shape == want.shape and want.shape[1] == 384
        assert torch.allclose(got, want, atol=1e-5)
    assert (torch.tensor(r.json()[1]).norm(dim=-1) - 1).abs().max() > 0.1  # TEI's raw token states


def test_similarity(server, minilm_llm):
    source, sentences = TEXTS[0], TEXTS[1:]
    r = server.post("/similarity", {"inputs": {"source_sentence": source, "sentences": sentences}})
    assert r.status_code == 200, r.text
    vecs = embed_ref(minilm_llm, [source, *sentences])
    want = F.cosine_similarity(vecs[:1], vecs[1:], dim=-1)
    assert np.allclose(r.json(), want.tolist(), atol=1e-6)
    r = server.post("/similarity", {"inputs": {"source_sentence": source, "sentences": []}})
    assert tei_error(r, 400, "Empty") == "`inputs.sentences` cannot be empty"


# ---------------------------------------------------------------------------------------------- truncation, prompts


@pytest.fixture(scope="module")
def prompted(tmp_path_factory, minilm_path):
    """MiniLM with instruction prompts (default "passage"), truncation=error, 32 tokens, at most 3 inputs."""
    folder = tmp_path_factory.mktemp("prompted")
    for entry in minilm_path.iterdir():
        if entry.name != "config_sentence_transformers.json":
            (folder / entry.name).symlink_to(entry.resolve())
    prompts = {"query": "query: ", "passage": "passage: "}
    (folder / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": prompts, "default_prompt_name": "passage"})
    )
    llm = LLM(str(folder), dtype="float32", truncation="error", max_model_len=32)
    with in_process_server(llm.engine, max_inputs_per_request=3, served_model_names=["prompted"]) as url:
        yield url


def test_truncation_and_direction(prompted, minilm_llm):
    def post(body: dict[str, Any]) -> httpx.Response:
        return httpx.post(prompted + "/embed", json=body, timeout=60)

    # truncate null: the server's truncation=error; TEI's words
    given = len(minilm_llm.engine.tokenizer.encode_prompts(["passage: " + LONG], 1 << 62, False)[0].input_ids)
    msg = tei_error(post({"inputs": LONG}), 422, "Validation")
    assert msg == f"Input validation error: `inputs` must have less than 32 tokens. Given: {given} ('inputs' item 0)"
    assert tei_error(post({"inputs": LONG, "truncate": False}), 422, "Validation") == msg
    msg = tei_error(post({"inputs": ["short", LONG]}), 422, "Validation")  # which item, beside TEI's words
    assert msg.endswith(f"Given: {given} ('inputs' item 1)")
    right = torch.tensor(post({"inputs": LONG, "truncate": True}).json())
    want = embed_ref(minilm_llm, ["passage: " + LONG], truncate_prompt_tokens=32)
    assert torch.allclose(right, want, atol=1e-5)
    ids = left_ids(minilm_llm, "passage: " + LONG, 32)
    assert len(ids) == 32 and minilm_llm.engine.tokenizer.decode(ids, skip_special_tokens=True).endswith("word59")
    for direction in ("Left", "left"):
        left = torch.tensor(post({"inputs": LONG, "truncate": True, "truncation_direction": direction}).json())
        assert torch.allclose(left, embed_ref(minilm_llm, [ids]), atol=1e-5), direction
        assert not torch.allclose(left, right, atol=1e-3)
    # /embed_all keeps the last tokens too: 32 vectors
    r = httpx.post(prompted + "/embed_all", json={"inputs": LONG, "truncate": True, "truncation_direction": "Left"})
    assert r.status_code == 200 and len(r.json()[0]) == 32
    r = post({"inputs": ["a", "b", "c", "d"]})
    assert tei_error(r, 422, "Validation") == "batch size 4 > maximum allowed batch size 3"


def test_prompt_name(prompted, minilm_llm):
    def embed(body: dict[str, Any]) -> torch.Tensor:
        r = httpx.post(prompted + "/embed", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return torch.tensor(r.json())

    text = TEXTS[1]
    # The model's default prompt, then a named one instead of it (not both); "passage" is no input_type.
    assert torch.allclose(embed({"inputs": text}), embed_ref(minilm_llm, ["passage: " + text]), atol=1e-5)
    assert torch.allclose(
        embed({"inputs": text, "prompt_name": "query"}), embed_ref(minilm_llm, ["query: " + text]), atol=1e-5
    )
    # Token ids are decoded, prompted and encoded again, as in TEI.
    ids = minilm_llm.embed(text, use_tqdm=False)[0].prompt_token_ids
    got = embed({"inputs": [ids], "prompt_name": "query"})
    assert torch.allclose(got, embed_ref(minilm_llm, ["query: " + text]), atol=1e-5)
    r = httpx.post(prompted + "/embed", json={"inputs": text, "prompt_name": "nope"})
    assert tei_error(r, 422, "Validation") == (
        "Input validation error: `default-prompt-name` is set to `nope` but it was not found in the Sentence "
        'Transformers prompts. Available prompts: ["query", "passage"]'
    )
    tokens = httpx.post(prompted + "/tokenize", json={"inputs": "flutter", "prompt_name": "query"}).json()[0]
    assert [t["text"] for t in tokens] == ["[CLS]", "query", ":", "flutter", "[SEP]"]
    assert (tokens[3]["start"], tokens[3]["stop"]) == (7, 14)
    default = httpx.post(prompted + "/tokenize", json={"inputs": "flutter"}).json()[0]
    assert [t["text"] for t in default][1] == "passage"
    info = httpx.get(prompted + "/info").json()
    assert info["auto_truncate"] is False and info["max_input_length"] == 32
    assert info["max_client_batch_size"] == 3 and info["served_model_name"] == "prompted"


def test_prompt_name_without_prompts(server):
    r = server.post("/embed", {"inputs": "x", "prompt_name": "query"})
    assert tei_error(r, 422, "Validation") == (
        "Input validation error: `default-prompt-name` is set to `query` but no prompts were found in the "
        "Sentence Transformers configuration"
    )


# ---------------------------------------------------------------------------------------------- classifiers


@pytest.fixture(scope="module")
def classifier(tmp_path_factory, minilm_path):
    folder = save_tiny_model(
        "BertForSequenceClassification",
        "BertConfig",
        tmp_path_factory.mktemp("tei-clf"),
        minilm_path,
        num_labels=3,
        id2label={0: "neg", 1: "neu", 2: "pos"},
        label2id={"neg": 0, "neu": 1, "pos": 2},
        **TINY,
    )
    llm = LLM(str(folder), dtype="float32")
    texts = ["great wing", "terrible drag"]
    pair = ("great wing", "terrible drag")
    ref = {
        "probs": [o.outputs.data for o in llm.classify([*texts, pair], use_tqdm=False)],
        "logits": [o.outputs.data for o in llm.classify(texts, PoolingParams(use_activation=False), use_tqdm=False)],
    }
    with in_process_server(llm.engine) as url:
        yield url, texts, ref


def test_per_input_metrics_by_kind(classifier):
    """TEI's te_embed_* and te_predict_* count and time each input (a batch of three is three), classify and
    scores under predict, vectors under embed; TEI's counters are typed counter under their names (no _total)."""
    url = classifier[0]

    def read() -> tuple[str, dict[str, float]]:
        text = httpx.get(url + "/metrics").text
        values = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name.startswith(("te_predict_", "te_embed_")) and name.endswith(("count", "success")):
                values[name] = float(value)
        return text, values

    _, before = read()
    assert httpx.post(url + "/predict", json={"inputs": [["a"], ["b"], ["c", "d"]]}).status_code == 200
    assert httpx.post(url + "/pooling", json={"input": ["a", "b"], "task": "token_classify"}).status_code == 200
    text, after = read()
    moved = {k: v - before.get(k, 0.0) for k, v in after.items()}
    assert moved == {
        "te_predict_count": 3, "te_predict_success": 3, "te_predict_duration_count": 3,
        "te_predict_tokenization_duration_count": 3, "te_predict_queue_duration_count": 3,
        "te_predict_inference_duration_count": 3,
        "te_embed_count": 2, "te_embed_success": 2, "te_embed_duration_count": 2,
        "te_embed_tokenization_duration_count": 2, "te_embed_queue_duration_count": 2,
        "te_embed_inference_duration_count": 2,
    }, moved  # fmt: skip
    for name in ("te_request_count", "te_request_success", "te_request_failure", "te_predict_count"):
        assert f"# TYPE {name} counter\n" in text, name


def _ranked(probs: torch.Tensor) -> list[tuple[str, float]]:
    labels = ["neg", "neu", "pos"]
    return sorted(((labels[i], float(p)) for i, p in enumerate(probs)), key=lambda x: -x[1])


def test_predict(classifier):
    url, texts, ref = classifier

    def predict(body: dict[str, Any]) -> Any:
        r = httpx.post(url + "/predict", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    def check(got: list[dict[str, Any]], probs: torch.Tensor) -> None:
        want = _ranked(probs)
        assert [p["label"] for p in got] == [w[0] for w in want]
        assert np.allclose([p["score"] for p in got], [w[1] for w in want], atol=1e-6)

    check(predict({"inputs": texts[0]}), ref["probs"][0])
    check(predict({"inputs": [texts[0]]}), ref["probs"][0])  # a one-string list is one input
    check(predict({"inputs": list(texts)}), ref["probs"][2])  # two strings: one pair
    batch = predict({"inputs": [[texts[0]], [texts[1]], list(texts)]})
    assert len(batch) == 3
    for got, probs in zip(batch, ref["probs"]):
        check(got, probs)
    check(predict({"inputs": texts[1], "raw_scores": True}), ref["logits"][1])
    info = httpx.get(url + "/info").json()
    classes = {"id2label": {"0": "neg", "1": "neu", "2": "pos"}, "label2id": {"neg": 0, "neu": 1, "pos": 2}}
    assert info["model_type"] == {"classifier": classes}
    r = httpx.post(url + "/embed", json={"inputs": "x"})
    assert tei_error(r, 424, "Backend") == "Backend error: Model is not an embedding model"
    r = httpx.post(url + "/rerank", json={"query": "q", "texts": ["a"]})
    assert tei_error(r, 424, "Backend") == "Backend error: model is not a re-ranker model"


def test_predict_on_an_embedding_model(server):
    r = server.post("/predict", {"inputs": "x"})
    assert tei_error(r, 424, "Backend") == "Backend error: Model is not a classifier model"


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory, minilm_path):
    folder = save_tiny_model(
        "BertForSequenceClassification",
        "BertConfig",
        tmp_path_factory.mktemp("tei-ce"),
        minilm_path,
        num_labels=1,
        **TINY,
    )
    llm = LLM(str(folder), dtype="float32")
    query, texts = "wing flutter", ["flutter of a swept wing", "heat transfer", "wings"]
    raw = PoolingParams(use_activation=False)
    logits = [float(o.outputs.data[0]) for o in llm.classify([(query, t) for t in texts], raw, use_tqdm=False)]
    long_doc = "flutter of a swept wing " * 30 + "heat transfer to a blunt body " * 30  # over 128 tokens
    sides = {
        side: float(llm.classify([(query, long_doc)], raw, use_tqdm=False, tokenization_kwargs=kw)[0].outputs.data[0])
        for side, kw in (("Left", {"truncation_side": "left"}), ("Right", None))
    }
    with in_process_server(llm.engine) as url:
        yield url, query, texts, logits, long_doc, sides


def test_rerank_cross_encoder(cross_encoder):
    url, query, texts, logits, long_doc, sides = cross_encoder
    r = httpx.post(url + "/rerank", json={"query": query, "texts": texts, "return_text": True})
    assert r.status_code == 200, r.text
    sigmoid = torch.sigmoid(torch.tensor(logits)).tolist()
    order = list(np.argsort(sigmoid)[::-1])
    assert [x["index"] for x in r.json()] == order
    assert [x["text"] for x in r.json()] == [texts[i] for i in order]
    assert np.allclose([x["score"] for x in r.json()], [sigmoid[i] for i in order], atol=1e-6)
    raw = httpx.post(url + "/rerank", json={"query": query, "texts": texts, "raw_scores": True}).json()
    assert all(set(x) == {"index", "score"} for x in raw)  # no text unless return_text
    assert np.allclose([x["score"] for x in raw], [logits[x["index"]] for x in raw], atol=1e-5)
    pair = httpx.post(url + "/predict", json={"inputs": [query, texts[0]]}).json()
    assert pair == [{"score": pytest.approx(sigmoid[0], abs=1e-6), "label": "LABEL_0"}]
    model_type = httpx.get(url + "/info").json()["model_type"]
    assert model_type == {"reranker": {"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}}
    # A pair over the maximum: its longest side is cut at the requested end (with its segment ids), as in TEI.
    gap = abs(sides["Left"] - sides["Right"])  # small: the tiny random model hardly tells texts apart
    assert gap > 0
    for direction, want in sides.items():
        body = {"query": query, "texts": [long_doc], "raw_scores": True, "truncation_direction": direction}
        got = httpx.post(url + "/rerank", json=body).json()[0]["score"]
        assert abs(got - want) < gap / 10, (direction, got, sides)
    # Jina / Cohere's body on the same path is unchanged.
    jina = httpx.post(url + "/rerank", json={"query": query, "documents": texts}).json()
    assert [x["index"] for x in jina["results"]] == order
    # an empty pair is TEI's Empty, as on /predict (it was scored); one empty side is a pair TEI scores
    r = httpx.post(url + "/rerank", json={"query": "", "texts": ["a", ""]})
    assert r.status_code == 400 and r.json() == {
        "error": "Input validation error: `texts` cannot be empty ('texts' item 1)",
        "error_type": "Empty",
    }, r.text
    assert httpx.post(url + "/rerank", json={"query": "", "texts": ["a"]}).status_code == 200


def test_rerank_bi_encoder(server, minilm_llm):
    """An embedding model ranks by cosine, as polyvec's own /rerank (TEI would refuse it)."""
    query, texts = "wing in a slipstream", TEXTS
    r = server.post("/rerank", {"query": query, "texts": texts})
    assert r.status_code == 200, r.text
    ref = [o.outputs.score for o in minilm_llm.score(query, texts, use_tqdm=False)]
    assert [x["index"] for x in r.json()] == list(np.argsort(ref)[::-1])
    assert np.allclose([x["score"] for x in r.json()], sorted(ref, reverse=True), atol=1e-6)
    assert "results" in server.post("/rerank", {"query": query, "documents": texts}).json()
    for body, name in (({"query": "", "texts": ["a"]}, "query"), ({"query": "q", "texts": ["a", ""]}, "texts")):
        r = server.post("/rerank", body)  # an empty text, refused as /embed refuses it (it was embedded)
        assert r.status_code == 400 and r.json()["error_type"] == "Empty", r.text
        assert f"`{name}` cannot be empty" in r.json()["error"], r.text


# ---------------------------------------------------------------------------------------------- tokenizer, info


def test_tokenize_and_decode(server):
    r = server.post("/tokenize", {"inputs": "Hello world"})
    assert r.status_code == 200, r.text
    assert r.json() == [
        [
            {"id": 101, "text": "[CLS]", "special": True, "start": None, "stop": None},
            {"id": 7592, "text": "Hello", "special": False, "start": 0, "stop": 5},
            {"id": 2088, "text": "world", "special": False, "start": 6, "stop": 11},
            {"id": 102, "text": "[SEP]", "special": True, "start": None, "stop": None},
        ]
    ]
    text = "héllo wörld ✈"  # byte offsets, as TEI's
    (tokens,) = server.post("/tokenize", {"inputs": [text], "add_special_tokens": False}).json()
    assert tokens and not any(t["special"] for t in tokens)
    for t in tokens:
        assert text.encode()[t["start"] : t["stop"]].decode() == t["text"]
    assert tokens[-1]["stop"] == len(text.encode())
    assert len(server.post("/tokenize", {"inputs": ["a", "b c"]}).json()) == 2
    vllm = server.post("/tokenize", {"prompt": "Hello world"}).json()  # vLLM's body on the same path
    assert vllm["tokens"] == [101, 7592, 2088, 102]
    assert server.post("/decode", {"ids": [101, 7592, 2088, 102]}).json() == ["hello world"]
    kept = server.post("/decode", {"ids": [[101, 7592, 102], [2088]], "skip_special_tokens": False}).json()
    assert kept == ["[CLS] hello [SEP]", "world"]


def test_info(server, minilm_llm):
    r = server.get("/info")
    assert r.status_code == 200, r.text
    info = r.json()
    assert set(info) == INFO_FIELDS
    engine_config = minilm_llm.engine.engine_config
    assert info["served_model_name"] == "minilm" and info["model_dtype"] == "float32"
    assert info["model_type"] == {"embedding": {"pooling": "mean"}}
    assert info["max_input_length"] == 256 and info["auto_truncate"] is True
    assert info["max_batch_tokens"] == engine_config.max_num_batched_tokens
    assert info["max_batch_requests"] == engine_config.max_num_seqs
    assert info["max_client_batch_size"] == 4096 and info["max_concurrent_requests"] == 512
    assert info["version"] == __version__ and info["tokenization_workers"] >= 1
    assert info["model_sha"] is None and info["sha"] is None and info["docker_label"] is None


def test_openapi_documents_tei(server):
    doc = server.get("/openapi.json").json()
    for path in ("/embed", "/embed_all", "/predict", "/similarity", "/decode"):
        responses = doc["paths"][path]["post"]["responses"]
        assert {"200", "400", "422"} <= set(responses), path
        assert responses["422"]["content"]["application/json"]["schema"]["$ref"].endswith("/TEIErrorResponse")
    body = doc["paths"]["/rerank"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {s["$ref"].rsplit("/", 1)[1] for s in body["oneOf"]} == {"RerankRequest", "TEIRerankRequest"}
    assert "422" not in doc["paths"]["/v1/embeddings"]["post"]["responses"]  # polyvec's own routes answer 400
    assert "TEIInfo" in json.dumps(doc["paths"]["/info"]["get"]["responses"]["200"])


# ---------------------------------------------------------------------------------------------- errors


class Bad(NamedTuple):
    path: str
    body: Any
    """A JSON value, or raw bytes."""
    status: int
    kind: str
    words: str


NESTED = b"[" * 10_000 + b"]" * 10_000
BAD = [
    Bad("/embed", {"inputs": []}, 400, "Empty", "Input validation error: `inputs` cannot be empty"),
    Bad("/embed", {"inputs": ""}, 400, "Empty", "`inputs` cannot be empty"),
    Bad("/embed", {"inputs": ["a", ""]}, 400, "Empty", "`inputs` cannot be empty ('inputs' item 1)"),
    Bad("/embed", {"inputs": 5}, 422, "Validation", "`inputs` must be a string, a list of token ids, or a list"),
    Bad("/embed", {"inputs": ["a", 5]}, 422, "Validation", "`inputs` item 1 is a number, not a string or a list"),
    Bad("/embed", {"inputs": [101, -1]}, 422, "Validation", "`inputs` item 1 is a negative number, not a token id"),
    Bad("/embed", {"inputs": [[101, True]]}, 422, "Validation", "`inputs` item 0 position 1 is a boolean"),
    Bad("/embed", {"inputs": "\ud800"}, 422, "Validation", "`inputs` is not valid UTF-8 text (lone surrogate)"),
    Bad("/embed", {"inputs": ["a", "b\udfff"]}, 422, "Validation", "`inputs` item 1 is not valid UTF-8 text"),
    Bad("/embed", {"inputs": [101, 99999999]}, 422, "Validation", "token ids must be integers in 0..30521"),
    Bad("/embed", {"inputs": "x", "colour": 1}, 422, "Validation", "unknown field 'colour'"),
    Bad("/embed", {}, 422, "Validation", "field 'inputs' is required"),
    Bad("/embed", {"inputs": "x", "truncation_direction": "up"}, 422, "Validation", "'truncation_direction'"),
    Bad("/embed", {"inputs": "x", "normalize": "yes"}, 422, "Validation", "'normalize'"),
    Bad("/embed", {"inputs": "x", "dimensions": -1}, 422, "Validation", "'dimensions'"),
    Bad("/embed", b"", 400, "Validation", "the request body is empty; send a JSON object"),
    Bad("/embed", b"null", 422, "Validation", "the request body must be a JSON object, not null"),
    Bad("/embed", b"[1]", 422, "Validation", "the request body must be a JSON object, not an array"),
    Bad("/embed", b'{"inputs": ', 400, "Validation", "not valid JSON"),
    Bad("/embed", b'{"inputs": "\xff"}', 400, "Validation", "not valid JSON"),
    Bad("/embed", NESTED, 400, "Validation", "nested too deeply"),
    Bad("/embed_all", {"inputs": [[]]}, 400, "Empty", "`inputs` cannot be empty"),
    Bad("/embed_all", {"inputs": "x", "normalize": True}, 422, "Validation", "unknown field 'normalize'"),
    Bad("/predict", {"inputs": ["a", "b", "c"]}, 422, "Validation", "`inputs` has 3 strings; a pair has 2"),
    Bad("/predict", {"inputs": [["a"], "b"]}, 422, "Validation", "`inputs` item 1 is a string, not a list of 1 or 2"),
    Bad("/predict", {"inputs": [["a", "b", "c"]]}, 422, "Validation", "`inputs` item 0 has 3 strings"),
    Bad("/predict", {"inputs": []}, 422, "Validation", "`inputs` must not be empty"),
    Bad("/predict", {"inputs": [["a", 1]]}, 422, "Validation", "`inputs` item 0 position 1 is a number"),
    Bad("/rerank", {"query": "q", "texts": []}, 400, "Empty", "`texts` cannot be empty"),
    Bad("/rerank", {"query": "q", "texts": ["a", 1]}, 422, "Validation", "`texts` item 1 is a number, not a string"),
    Bad("/rerank", {"query": ["q"], "texts": ["a"]}, 422, "Validation", "`query` must be a string, not an array"),
    Bad("/rerank", {"texts": ["a"]}, 422, "Validation", "field 'query' is required"),
    Bad("/rerank", {"query": "q", "texts": ["a"], "top_n": 1}, 422, "Validation", "unknown field 'top_n'"),
    Bad("/tokenize", {"inputs": []}, 400, "Empty", "`inputs` cannot be empty"),
    Bad("/tokenize", {"inputs": ""}, 400, "Empty", "Input validation error: `inputs` cannot be empty"),
    Bad("/tokenize", {"inputs": 5}, 422, "Validation", "`inputs` must be a string or a list of strings, not a number"),
    Bad("/tokenize", {"inputs": "x", "prompt_name": "q"}, 422, "Validation", "no prompts were found"),
    Bad("/decode", {"ids": []}, 400, "Empty", "Input validation error: `input_ids` cannot be empty"),
    Bad("/decode", {"ids": [[101], []]}, 400, "Empty", "`input_ids` cannot be empty"),
    Bad(
        "/decode",
        {"ids": [99999999]},
        422,
        "Validation",
        "`ids` item 0 is 99999999, outside the vocabulary (size 30522)",
    ),
    Bad("/decode", {"ids": [[101], [7592, 99999]]}, 422, "Validation", "`ids` item 1 position 1 is 99999, outside the"),
    Bad("/decode", {"ids": "101"}, 422, "Validation", "`ids` must be a list of token ids or a list of token-id"),
    Bad("/decode", {"ids": [101, True]}, 422, "Validation", "`ids` item 1 is a boolean, not a token id"),
    Bad(
        "/similarity",
        {"inputs": {"source_sentence": "", "sentences": ["a"]}},
        400,
        "Empty",
        "`inputs.source_sentence` cannot be empty",
    ),
    Bad(
        "/similarity",
        {"inputs": {"source_sentence": "a", "sentences": ["b", ""]}},
        400,
        "Empty",
        "`inputs.sentences` cannot be empty ('inputs.sentences' item 1)",
    ),
    Bad(
        "/similarity",
        {"inputs": {"source_sentence": "a", "sentences": ["b", "x " * 600]}, "parameters": {"truncate": False}},
        422,
        "Validation",
        "tokens. Given: 602 ('inputs.sentences' item 1)",
    ),
    Bad(
        "/similarity",
        {"inputs": {"source_sentence": "x " * 600, "sentences": ["b"]}, "parameters": {"truncate": False}},
        422,
        "Validation",
        "tokens. Given: 602 ('inputs.source_sentence')",
    ),
    Bad("/similarity", {"inputs": {"source_sentence": "a"}}, 422, "Validation", "'inputs.sentences' is required"),
]


@pytest.mark.parametrize("case", BAD, ids=[f"{c.path}-{i}" for i, c in enumerate(BAD)])
def test_tei_errors(server, case: Bad):
    content = case.body if isinstance(case.body, bytes) else json.dumps(case.body).encode()
    r = httpx.post(server.url + case.path, content=content, headers={"content-type": "application/json"}, timeout=60)
    message = tei_error(r, case.status, case.kind)
    assert case.words in message and "Traceback" not in message, message
    assert server.post("/embed", {"inputs": "still serving"}).status_code == 200


def test_shared_routes_keep_polyvec_errors_for_their_bodies(server):
    """A body that is not TEI's on /rerank and /tokenize gets polyvec's error body, as before."""
    for path, body, words in (
        ("/rerank", {"query": "q", "documents": []}, "'documents' must not be empty"),
        ("/rerank", {"query": "q", "documents": ["a"], "texts": ["b"]}, "unknown field 'texts'"),
        ("/rerank", {"query": "q"}, "field 'documents' is required"),
        ("/tokenize", {"prompt": 5}, "'prompt' must be a string, not a number"),
        ("/tokenize", {"inputs": "x", "prompt": "x"}, "unknown field 'inputs'"),
    ):
        r = server.post(path, body)
        assert r.status_code == 400 and words in r.json()["error"]["message"], (path, r.text)


def test_post_root_is_the_models_own_route(server, classifier, cross_encoder):
    """TEI binds `/` by the model's kind; huggingface_hub's InferenceClient posts there."""
    body = {"inputs": ["a wing", "heat transfer"]}
    assert server.post("/", body).json() == server.post("/embed", body).json()
    url, texts, _ = classifier
    assert (
        httpx.post(url + "/", json={"inputs": texts[0]}).json()
        == httpx.post(url + "/predict", json={"inputs": texts[0]}).json()
    )
    url, query, docs, *_ = cross_encoder
    rerank = {"query": query, "texts": docs}
    assert httpx.post(url + "/", json=rerank).json() == httpx.post(url + "/rerank", json=rerank).json()
    r = server.post("/", {"query": "x", "texts": ["y"]})  # an embedding model's / takes /embed's body
    assert tei_error(r, 422, "Validation")
    for bad in (b"{", b"", b"\xff\xfe{}"):  # as /embed answers the same bodies (/ gave 422)
        r = httpx.post(server.url + "/", content=bad, headers={"Content-Type": "application/json"})
        same = httpx.post(server.url + "/embed", content=bad, headers={"Content-Type": "application/json"})
        assert r.status_code == same.status_code == 400 and r.json()["error_type"] == "Validation", r.text


def test_input_type_names_a_prompt_the_model_declares(prompted, minilm_llm):
    """input_type picks the model's instruction prompt of that name (the README's word): "passage" was refused
    though the model declares it, and a declared "classification" prompt was never applied."""
    text = "wing flutter"

    def vector(input_type: str) -> torch.Tensor:
        r = httpx.post(prompted + "/v1/embeddings", json={"input": text, "input_type": input_type})
        assert r.status_code == 200, r.text
        return torch.tensor(r.json()["data"][0]["embedding"])

    want = minilm_llm.embed(["passage: " + text, "query: " + text], use_tqdm=False)
    assert torch.allclose(vector("passage"), want[0].outputs.data, atol=1e-5)
    assert torch.allclose(vector("search_query"), want[1].outputs.data, atol=1e-5)  # Cohere's name of the mode
    r = httpx.post(prompted + "/v1/embeddings", json={"input": text, "input_type": "nope"})
    assert r.status_code == 400 and r.json()["error"]["message"].endswith("clustering, passage")


def test_huggingface_hub_inference_client(server, classifier, minilm_llm, monkeypatch):
    """huggingface_hub's InferenceClient pointed at the server, as at TEI: feature extraction, sentence
    similarity, and text classification, which sends its options in `parameters` (TEI ignores them; it was a 422)."""
    from huggingface_hub import InferenceClient, constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the tests' offline mode also blocks loopback URLs
    client = InferenceClient(base_url=server.url)
    got = torch.tensor(client.feature_extraction("a swept wing"))
    assert F.cosine_similarity(got.reshape(1, -1), embed_ref(minilm_llm, ["a swept wing"])).item() >= 0.9999
    for encoding in ("float", "base64"):  # the client's option, which TEI's /embed ignores (it was a 422)
        again = torch.tensor(client.feature_extraction("a swept wing", encoding_format=encoding))
        assert torch.equal(again, got), encoding
    sims = client.sentence_similarity("a swept wing", other_sentences=["a delta wing", "heat transfer"])
    assert len(sims) == 2 and sims[0] > sims[1]
    url, texts, ref = classifier
    client = InferenceClient(base_url=url)
    want = _ranked(ref["probs"][0])
    for kwargs in ({}, {"top_k": 2}):
        top = client.text_classification(texts[0], **kwargs)  # the client keeps the first of TEI's list
        assert top.label == want[0][0] and abs(top.score - want[0][1]) < 1e-5


def test_tei_paths_for_health_embeddings_and_invocations(server, classifier):
    """TEI's other paths: GET / (health), POST /embeddings (its OpenAI route), and SageMaker's /invocations with
    TEI's bodies (the model's own route); the vLLM bodies of /invocations keep their handlers."""
    r = server.get("/")
    assert r.status_code == 200
    r = httpx.request("OPTIONS", server.url + "/")  # 405 names both routes' methods (it said GET only)
    assert r.status_code == 405 and {"GET", "POST"} <= set(r.headers["allow"].split(", "))
    body = {"input": ["a wing", "heat transfer"], "model": "minilm"}
    a, b = server.post("/embeddings", body).json(), server.post("/v1/embeddings", body).json()
    assert [d["embedding"] for d in a["data"]] == [d["embedding"] for d in b["data"]]
    tei_body = {"inputs": ["a wing", "heat transfer"]}
    assert server.post("/invocations", tei_body).json() == server.post("/embed", tei_body).json()
    assert server.post("/invocations", body).json()["data"][0]["embedding"] == b["data"][0]["embedding"]
    r = server.post("/invocations", {"inputs": ""})
    assert tei_error(r, 400, "Empty") == server.post("/embed", {"inputs": ""}).json()["error"]
    r = server.post("/invocations", {"inputs": 5})
    assert tei_error(r, 422, "Validation")
    url, texts, _ = classifier
    r = httpx.post(url + "/invocations", json={"inputs": texts[0], "parameters": {"top_k": 1}})
    assert r.status_code == 200 and r.json() == httpx.post(url + "/predict", json={"inputs": texts[0]}).json()


def _copy_minilm(minilm_path, folder, **tokenizer_config):
    import shutil

    shutil.copytree(minilm_path, folder, ignore=shutil.ignore_patterns("model.safetensors"))
    (folder / "model.safetensors").symlink_to(minilm_path / "model.safetensors")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, **tokenizer_config}))
    return folder


def test_requested_directions_cut_whatever_the_tokenizers_side(tmp_path, minilm_path):
    """A tokenizer whose config says truncation_side "left": TEI's truncation_direction Right (its default) and
    Cohere's truncate END still cut the end, as their APIs say; they followed the tokenizer's side."""
    folder = _copy_minilm(minilm_path, tmp_path / "left", truncation_side="left")
    llm = LLM(str(folder), dtype="float32", max_model_len=16)
    text = " ".join(f"word{i} wing" for i in range(20))
    right, left = (
        llm.embed(text, truncate_prompt_tokens=16, tokenization_kwargs={"truncation_side": side}, use_tqdm=False)[0]
        for side in ("right", "left")
    )
    assert not torch.allclose(right.outputs.data, left.outputs.data, atol=1e-3)
    with in_process_server(llm.engine) as url:
        for body, want in (
            ({}, right),
            ({"truncation_direction": "Right"}, right),
            ({"truncation_direction": "Left"}, left),
        ):
            got = httpx.post(url + "/embed", json={"inputs": text, "truncate": True, **body}).json()[0]
            assert np.allclose(got, want.outputs.data.numpy(), atol=1e-5), body
        for truncate, want in (("END", right), ("START", left)):
            body = {"texts": [text], "input_type": "search_document", "truncate": truncate}
            got = httpx.post(url + "/v2/embed", json=body).json()["embeddings"]["float"][0]
            assert np.allclose(got, want.outputs.data.numpy(), atol=1e-5), truncate


def test_a_token_beyond_the_models_embeddings_is_refused_by_item(tmp_path, minilm_path):
    """A special token only the tokenizer's config declares gets an id past config.json's vocab_size: a text
    holding it (and such an id sent as a token) is a 400 naming the item, not an IndexError (500)."""
    folder = _copy_minilm(minilm_path, tmp_path / "declared", additional_special_tokens=["<XQ>"])
    llm = LLM(str(folder), dtype="float32")
    with pytest.raises(ValueError, match=r"prompt 1: its token '<XQ>' has id 30522, beyond the model's 30522"):
        llm.embed(["fine", "hello <XQ> world"], use_tqdm=False)
    with in_process_server(llm.engine) as url:
        for body, words in (
            ({"input": ["fine", "hello <XQ> world"]}, "'input' item 1: its token '<XQ>' has id 30522"),
            ({"input": [101, 30522, 102]}, "token id 30522 is out of vocabulary"),
        ):
            r = httpx.post(url + "/v1/embeddings", json=body)
            assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
        assert httpx.post(url + "/v1/embeddings", json={"input": "hello world"}).status_code == 200
    # a pad token only the configs declare: padding="max_length" refused by item, not an IndexError
    padx = _copy_minilm(minilm_path, tmp_path / "padx", pad_token="<PADX>")
    (padx / "special_tokens_map.json").unlink()
    padded = LLM(str(padx), dtype="float32", max_model_len=16)
    with pytest.raises(ValueError, match="prompt 0: padding='max_length' pads with token id 30522, beyond the model's"):
        padded.embed(["hi"], tokenization_kwargs={"padding": "max_length", "max_length": 16}, use_tqdm=False)


def test_info_of_a_token_classifier_names_its_labels(tmp_path, minilm_path):
    """TEI serves no token classifier; /info called a NER model an embedding model with CLS pooling."""
    labels = {0: "O", 1: "B-PER", 2: "I-PER"}
    save_tiny_model("BertForTokenClassification", "BertConfig", tmp_path, minilm_path, num_labels=3, id2label=labels,
                    label2id={v: k for k, v in labels.items()}, **TINY)  # fmt: skip
    llm = LLM(str(tmp_path), dtype="float32")
    assert llm.supported_tasks == ("token_classify",)
    with in_process_server(llm.engine) as url:
        model_type = httpx.get(url + "/info").json()["model_type"]
    assert model_type == {"classifier": {"id2label": {"0": "O", "1": "B-PER", "2": "I-PER"},
                                         "label2id": {"O": 0, "B-PER": 1, "I-PER": 2}}}  # fmt: skip
