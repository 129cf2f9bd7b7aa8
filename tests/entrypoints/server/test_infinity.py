"""Infinity's REST API through its own client (`infinity_client`): a user of Infinity points it at polyvec and
gets Infinity's answers, the model it names or its "default/not-specified", `modality` and `dimensions: 0` on
/embeddings, `raw_scores` and string documents on /rerank, per-input label lists on /classify, and /models."""

from __future__ import annotations

import json
import time

import pytest
import torch
from infinity_client import Client
from infinity_client.api.default import classify, embeddings, health, models, rerank
from infinity_client.models import ClassifyInput, OpenAIEmbeddingInputText, RerankInput

from polyvec import LLM, PoolingParams
from tests.entrypoints.server.conftest import MINILM, in_process_server
from tests.helpers import TINY, save_tiny_model

TEXTS = ["the wing stalls at high angle of attack", "heat transfer in laminar boundary layers"]


def test_embeddings_and_models(server, minilm_llm):
    client = Client(base_url=server.url)
    got = embeddings.sync_detailed(client=client, body=OpenAIEmbeddingInputText(input_=TEXTS))  # its defaults
    assert got.status_code == 200, got.content
    want = minilm_llm.embed(TEXTS, use_tqdm=False)
    for item, out in zip(got.parsed.data, want):
        assert torch.allclose(torch.tensor(item.embedding), out.outputs.data, atol=1e-5)
    assert got.parsed.model == "minilm" and got.parsed.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in want)
    named = OpenAIEmbeddingInputText(input_=TEXTS[:1], model="minilm", dimensions=0)
    assert embeddings.sync_detailed(client=client, body=named).status_code == 200
    # Infinity's dimensions: the normalized vector's first values, of any model (400 on MiniLM before)
    cut = embeddings.sync_detailed(client=client, body=OpenAIEmbeddingInputText(input_=TEXTS, dimensions=4))
    assert cut.status_code == 200, cut.content
    for item, out in zip(cut.parsed.data, want):
        assert item.embedding == pytest.approx(out.outputs.data[:4].tolist(), abs=1e-6)
    wide = embeddings.sync_detailed(client=client, body=OpenAIEmbeddingInputText(input_=TEXTS, dimensions=385))
    assert wide.status_code == 400 and json.loads(wide.content)["error"]["param"] == "dimensions"
    for path, extra in (
        ("/pooling", {}),
        ("/v1/embeddings", {}),
        ("/v1/embeddings", {"late_chunking_params": {"chunk_size": 2}}),
    ):  # not Infinity's route: vLLM's dimensions, refused on a model not trained for Matryoshka
        r = server.post(path, {"input": TEXTS[0], "modality": "text", "dimensions": 4, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions", (path, r.text)
    for body in ({"modality": "text"}, {"model": "default/not-specified"}):  # Infinity's 0 is not vLLM's
        r = server.post("/v1/embeddings", {"input": TEXTS[0], "dimensions": 0, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions", r.text
        full = server.post("/embeddings", {"input": TEXTS[0], "dimensions": 0, **body})
        assert full.status_code == 200 and len(full.json()["data"][0]["embedding"]) == 384
    raw = server.post("/embeddings", {"input": TEXTS, "model": "default/not-specified", "dimensions": 4})
    assert raw.status_code == 200 and len(raw.json()["data"][0]["embedding"]) == 4  # a raw Infinity body
    wrong = embeddings.sync_detailed(client=client, body=OpenAIEmbeddingInputText(input_=TEXTS, model="other"))
    assert wrong.status_code == 404
    for path, extra in (
        ("/embeddings", {}),
        ("/pooling", {}),
        ("/v1/embeddings", {"late_chunking_params": {"chunk_size": 2}}),
    ):
        image = server.post(path, {"input": ["data:image/png;base64,AAAA"], "modality": "image", **extra})
        assert image.status_code == 400 and image.json()["error"]["param"] == "modality", (path, image.text)
    listed = models.sync_detailed(client=client)
    assert listed.status_code == 200, listed.content
    assert [m.id for m in listed.parsed.data] == ["minilm", MINILM]
    assert listed.parsed.data[0].capabilities == ["embed", "rerank"]
    alive = health.sync_detailed(client=client)  # Infinity's {"unix"} (an empty body failed its parser)
    assert alive.status_code == 200 and abs(alive.parsed["unix"] - time.time()) < 60


@pytest.fixture(scope="module")
def classifier(tmp_path_factory, minilm_path):
    labels = {0: "neg", 1: "neu", 2: "pos"}
    folder = save_tiny_model(
        "BertForSequenceClassification", "BertConfig", tmp_path_factory.mktemp("clf"), minilm_path,
        num_labels=3, id2label=labels, label2id={v: k for k, v in labels.items()}, **TINY,
    )  # fmt: skip
    return LLM(str(folder), dtype="float32")


def test_classify_answers_per_input_label_lists(classifier):
    """Per input, every label by probability: Infinity's text-classification pipeline applies the model's
    activation whatever raw_scores says (true returned logits here before)."""
    want = classifier.classify(TEXTS, use_tqdm=False)
    with in_process_server(classifier.engine, warmup=False) as url:
        client = Client(base_url=url)
        assert models.sync_detailed(client=client).parsed.data[0].capabilities == ["classify"]  # no rerank
        for raw_scores in (False, True):
            got = classify.sync_detailed(client=client, body=ClassifyInput(input_=TEXTS, raw_scores=raw_scores))
            assert got.status_code == 200, got.content
            for scores, out in zip(got.parsed.data, want):
                probs = out.outputs.data.tolist()
                order = sorted(range(3), key=lambda j: -probs[j])
                assert [s.label for s in scores] == [["neg", "neu", "pos"][j] for j in order]
                assert [s.score for s in scores] == pytest.approx([probs[j] for j in order], abs=1e-5)


@pytest.mark.parametrize("labels", [1, 3])
def test_classify_of_a_regression_model_gives_its_logits(tmp_path, minilm_path, labels):
    """problem_type regression: transformers' text-classification pipeline (Infinity's) applies nothing; a
    sigmoid (one label) or softmax (three) squashed the logits."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

    folder = save_tiny_model("BertForSequenceClassification", "BertConfig", tmp_path, minilm_path,
                             num_labels=labels, problem_type="regression", **TINY)  # fmt: skip
    model = AutoModelForSequenceClassification.from_pretrained(str(folder)).eval()
    ref = pipeline("text-classification", model=model, tokenizer=AutoTokenizer.from_pretrained(str(folder)))
    llm = LLM(str(folder), dtype="float32")
    with in_process_server(llm.engine, warmup=False) as url:
        got = classify.sync_detailed(client=Client(base_url=url), body=ClassifyInput(input_=TEXTS[:2]))
        assert got.status_code == 200, got.content
    for scores, text in zip(got.parsed.data, TEXTS[:2]):
        want = ref(text, top_k=None)
        assert [s.label for s in scores] == [w["label"] for w in want]
        assert [s.score for s in scores] == pytest.approx([w["score"] for w in want], abs=1e-5)


@pytest.mark.parametrize("activation", [None, "torch.nn.modules.linear.Identity"])
def test_rerank_with_raw_scores_and_string_documents(tmp_path, minilm_path, activation):
    """Infinity's rerank scores are the sigmoid of a cross-encoder's logit (raw_scores: the logit), whatever
    activation the model declares (with sentence-transformers' Identity, the logit came back for both)."""
    folder = save_tiny_model("BertForSequenceClassification", "BertConfig", tmp_path, minilm_path, num_labels=1, **TINY)
    if activation is not None:
        config = json.loads((folder / "config.json").read_text())
        config["sentence_transformers"] = {"activation_fn": activation}
        (folder / "config.json").write_text(json.dumps(config))
    llm = LLM(str(folder), dtype="float32")
    docs = ["a wing in a propeller slipstream", "heat transfer", "flutter of a swept wing"]
    logit = PoolingParams(use_activation=False)
    want = [
        torch.sigmoid(torch.tensor(o.outputs.score)).item()
        for o in llm.score("wing flutter", docs, pooling_params=logit)
    ]
    with in_process_server(llm.engine, warmup=False) as url:
        client = Client(base_url=url)
        got = rerank.sync_detailed(client=client, body=RerankInput(query="wing flutter", documents=docs))
        assert got.status_code == 200, got.content
        order = sorted(range(3), key=lambda i: -want[i])
        assert [r.index for r in got.parsed.results] == order
        assert [r.relevance_score for r in got.parsed.results] == pytest.approx([want[i] for i in order], abs=1e-5)
        assert all("document" not in r for r in json.loads(got.content)["results"])  # Infinity's default
        body = RerankInput(query="wing flutter", documents=docs, return_documents=True, raw_scores=True, top_n=2)
        got = rerank.sync_detailed(client=client, body=body)
        assert [r.document for r in got.parsed.results] == [docs[i] for i in order[:2]]
        logits = torch.logit(torch.tensor([want[i] for i in order[:2]]))
        assert [r.relevance_score for r in got.parsed.results] == pytest.approx(logits.tolist(), abs=1e-4)


def test_scores_as_infinity_computes_them_from_the_logits(tmp_path, minilm_path):
    """A one-label model declaring sentence-transformers' Identity, its logits near -1000: Infinity's /classify
    (transformers' pipeline) and /rerank give the sigmoid, 0.0 (polyvec gave the logit on /classify, and a 500
    from math.exp's overflow on /rerank)."""
    from transformers import BertForSequenceClassification

    folder = save_tiny_model("BertForSequenceClassification", "BertConfig", tmp_path, minilm_path, num_labels=1, **TINY)
    model = BertForSequenceClassification.from_pretrained(folder)
    with torch.no_grad():
        model.classifier.bias.fill_(-1000.0)
    model.config.sentence_transformers = {"activation_fn": "torch.nn.modules.linear.Identity"}
    model.save_pretrained(folder)
    llm = LLM(str(folder), dtype="float32")
    with in_process_server(llm.engine, warmup=False) as url:
        client = Client(base_url=url)
        got = classify.sync_detailed(client=client, body=ClassifyInput(input_=TEXTS, raw_scores=False))
        assert got.status_code == 200, got.content
        assert [[s.score for s in scores] for scores in got.parsed.data] == [[0.0], [0.0]]
        ranked = rerank.sync_detailed(client=client, body=RerankInput(query="wing", documents=TEXTS))
        assert ranked.status_code == 200, ranked.content
        assert [r.relevance_score for r in ranked.parsed.results] == [0.0, 0.0]
