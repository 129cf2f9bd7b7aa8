"""/classify and cross-encoder /score and /rerank on a (tiny, seeded) classifier checkpoint."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

from polyvec import LLM
from tests.entrypoints.server.conftest import Server, in_process_server
from tests.helpers import TINY, save_tiny_model


@pytest.fixture(scope="module")
def classifier(tmp_path_factory, minilm_path):
    folder = save_tiny_model(
        "BertForSequenceClassification",
        "BertConfig",
        tmp_path_factory.mktemp("clf"),
        minilm_path,
        num_labels=3,
        id2label={0: "neg", 1: "neu", 2: "pos"},
        label2id={"neg": 0, "neu": 1, "pos": 2},
        **TINY,
    )
    s = Server(str(folder))
    yield s, LLM(str(folder), dtype="float32")
    s.stop()


@pytest.fixture(scope="module")
def cross_encoder_folder(tmp_path_factory, minilm_path):
    return save_tiny_model(
        "BertForSequenceClassification", "BertConfig", tmp_path_factory.mktemp("ce"), minilm_path, num_labels=1, **TINY
    )


@pytest.fixture(scope="module")
def cross_encoder(cross_encoder_folder):
    folder = cross_encoder_folder
    s = Server(str(folder))
    yield s, LLM(str(folder), dtype="float32")
    s.stop()


def test_classify(classifier):
    s, llm = classifier
    texts = ["great wing", "terrible drag", "a neutral statement about flow"]
    body = s.post("/classify", {"input": texts}).json()
    ref = [o.outputs.data for o in llm.classify(texts, use_tqdm=False)]
    for item, want in zip(body["data"], ref):
        assert item["num_classes"] == 3 and np.allclose(item["probs"], want.tolist(), atol=1e-6)
        assert item["label"] == ["neg", "neu", "pos"][int(want.argmax())]
    assert body["id"].startswith("classify-") and body["usage"]["prompt_tokens"] > 0
    logits = s.post("/classify", {"input": texts[:1], "use_activation": False}).json()["data"][0]["probs"]
    assert np.allclose(torch.softmax(torch.tensor(logits), -1).tolist(), ref[0].tolist(), atol=1e-6)
    assert s.post("/pooling", {"input": "x", "task": "classify"}).json()["data"][0]["shape"] == [3]
    r = s.post("/v1/embeddings", {"input": "x"})
    assert r.status_code == 400 and "it supports: classify" in r.json()["error"]["message"]


def test_cross_encoder_score_and_rerank(cross_encoder):
    s, llm = cross_encoder
    query, docs = "wing flutter", ["flutter of a swept wing", "heat transfer", "wings"]
    ref = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    body = s.post("/score", {"text_1": query, "text_2": docs}).json()
    assert np.allclose([d["score"] for d in body["data"]], ref, atol=1e-6)
    ranked = s.post("/rerank", {"query": query, "documents": docs}).json()["results"]
    assert [r["index"] for r in ranked] == list(np.argsort(ref)[::-1])


def test_cross_encoder_refuses_images_by_name(cross_encoder):
    """An image_url part (or a data:image URL) sent to a cross-encoder: 400 naming the side and item, as a
    text-only bi-encoder answers (it was tokenized as text and scored, 200)."""
    s, _ = cross_encoder
    png = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
    url = "data:image/png;base64," + png
    part = {"content": [{"type": "image_url", "image_url": {"url": url}}]}
    cases = [
        ("/rerank", {"query": "red", "documents": ["a red square", part]}, "documents", "documents item 1 is an image"),
        ("/score", {"text_1": part, "text_2": "a red square"}, "text_1", "text_1 item 0 is an image"),
        ("/score", {"text_1": "red", "text_2": ["x", url]}, "text_2", "text_2 item 1 is an image"),
    ]
    for path, body, param, where in cases:
        r = s.post(path, body)
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert err["param"] == param and where in err["message"] and "reads text only" in err["message"], err


def test_cross_encoder_per_side_token_caps(cross_encoder):
    """max_tokens_per_query / _per_doc on a cross-encoder (Cohere v2 rerank sends max_tokens_per_doc): each text
    cut to its first N content tokens, then paired, as vLLM 0.34's get_score_prompt does (it was a 400)."""
    from transformers import AutoTokenizer

    s, llm = cross_encoder
    tok = AutoTokenizer.from_pretrained(llm.model_config.path)

    def cut(text: str, most: int) -> str:
        offsets = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        return text if len(offsets) <= most else text[: offsets[most - 1][1]]

    query, docs = "wing flutter at transonic speed", ["flutter of a swept wing", "heat transfer in air", "wings"]
    ref = [o.outputs.score for o in llm.score(cut(query, 2), [cut(d, 3) for d in docs], use_tqdm=False)]
    assert cut(docs[0], 3) == "flutter of a" and cut(query, 2) == "wing flutter"
    body = {"query": query, "documents": docs, "max_tokens_per_query": 2, "max_tokens_per_doc": 3}
    for path in ("/rerank", "/v2/rerank"):
        ranked = s.post(path, body).json()["results"]
        assert np.allclose([r["relevance_score"] for r in sorted(ranked, key=lambda r: r["index"])], ref, atol=1e-6)
    body = {"text_1": query, "text_2": docs, "max_tokens_per_doc": 3}
    plain = [o.outputs.score for o in llm.score(query, [cut(d, 3) for d in docs], use_tqdm=False)]
    assert np.allclose([d["score"] for d in s.post("/score", body).json()["data"]], plain, atol=1e-6)


def test_cross_encoder_errors_name_the_pair(cross_encoder_folder):
    """A cross-encoder's prompts are (query, document) pairs: an over-long one is named by both its items."""
    llm = LLM(str(cross_encoder_folder), dtype="float32", truncation="error", max_model_len=32)
    with in_process_server(llm.engine) as url:
        r = httpx.post(url + "/rerank", json={"query": "wing flutter", "documents": ["short", "word " * 40]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "documents"
        assert r.json()["error"]["message"].startswith("the pair of 'query' and 'documents' item 1 has 45 tokens")
        r = httpx.post(url + "/score", json={"text_1": ["a", "b"], "text_2": ["c", "word " * 40]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "text_2"
        assert r.json()["error"]["message"].startswith("the pair of 'text_1' item 1 and 'text_2' item 1 has")


@pytest.fixture(scope="module")
def colbert_server(pylate_model):
    s = Server(str(pylate_model[1]))
    yield s, LLM(str(pylate_model[1]), dtype="float32")
    s.stop()


def test_colbert_over_http(colbert_server):
    from polyvec import PoolingParams

    s, llm = colbert_server
    query, docs = "slipstream over a wing", ["a wing in a propeller slipstream.", "heat transfer"]
    q = s.post("/pooling", {"input": query, "task": "token_embed", "input_type": "query"}).json()["data"][0]
    assert q["shape"] == [24, 96] and q["input_type"] == "query"
    ref = llm.token_embed(query, PoolingParams(input_type="query"), use_tqdm=False)[0].outputs.data
    assert torch.allclose(torch.tensor(q["data"]), ref, atol=1e-5)
    d = s.post("/v1/embeddings", {"input": docs[0], "input_type": "search_document"}).json()["data"][0]
    assert d["input_type"] == "document" and d["shape"][1] == 96
    plain = s.post("/pooling", {"input": docs[0]}).json()["data"][0]
    assert plain["input_type"] == "document" and plain["shape"] == d["shape"]
    # vLLM's SageMaker route: an {"input"} body is an embeddings request only on an embed model; here /pooling's
    invoked = s.post("/invocations", {"input": docs[0]}).json()
    assert invoked["object"] == "list" and invoked["data"][0]["object"] == "pooling"
    assert invoked["data"][0]["data"] == plain["data"]
    bad = s.post("/pooling", {"input": query, "task": "embed"})
    assert bad.status_code == 400 and "it supports: token_embed" in bad.json()["error"]["message"]
    offline = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    scored = s.post("/score", {"text_1": query, "text_2": docs}).json()["data"]
    assert np.allclose([x["score"] for x in scored], offline, rtol=1e-4)
    ranked = s.post("/rerank", {"query": query, "documents": docs}).json()["results"]
    assert [r["index"] for r in ranked] == list(np.argsort(offline)[::-1])
    assert abs(ranked[0]["relevance_score"] - max(offline)) <= 1e-4 * max(offline)
    # max_tokens_per_doc cuts the text before [CLS] [D] ... [SEP] (3 kept [CLS] [D] [SEP]: every score the same)
    capped = s.post("/score", {"text_1": query, "text_2": docs, "max_tokens_per_doc": 3}).json()["data"]
    want = [o.outputs.score for o in llm.score(query, ["a wing in", "heat transfer"], use_tqdm=False)]
    assert np.allclose([x["score"] for x in capped], want, rtol=1e-4) and abs(want[0] - want[1]) > 1e-3
    # Cohere v1 has one vector per text: token matrices are refused there (its client failed to parse them)
    r = s.post("/v1/embed", {"texts": docs})
    assert (
        r.status_code == 400 and "/v2/embed" in r.json()["error"]["message"] and r.json()["error"]["param"] == "texts"
    )
    assert s.post("/v2/embed", {"texts": docs}).json()["shapes"][1][1] == 96
    # POST / (TEI's) has no route for a ColBERT model: 424, once the body is one TEI takes (its refusals first)
    root = [httpx.post(s.url + "/", content=b"", headers={"content-type": "application/json"}),
            s.post("/", {"bogus": 1}), s.post("/", {"inputs": "x"})]  # fmt: skip
    assert [r.status_code for r in root] == [400, 422, 424], [r.text for r in root]
    assert root[1].json()["error_type"] == "Validation" and "inputs" in root[1].json()["error"]


def test_qwen3_reranker_served_as_vllm_serves_it(tmp_path, minilm_path):
    """`--hf-overrides` with vLLM's Qwen3-Reranker recipe and `--chat-template` its rerank template: /score and
    /rerank render each pair through the template, `instruction` its variable (it was refused: no template)."""
    import json

    from tests.models.test_decoder_parity import QWEN3_RERANKER, RERANK_TEMPLATE, save_decoder

    save_decoder("qwen3", "ForCausalLM", tmp_path / "m", minilm_path)
    template = RERANK_TEMPLATE + "\n<Judge>: is the document relevant? answer yes or no"  # words after the document
    (tmp_path / "rerank.jinja").write_text(template)
    llm = LLM(str(tmp_path / "m"), dtype="float32", hf_overrides=QWEN3_RERANKER)
    query, docs = "capital of china", ["beijing is the capital", "gravity is a force"]
    want = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False, chat_template=template)]
    plain = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    long_doc = "the capital of china is beijing. " * 80  # over max_model_len: cut so that the template's end stays
    (fitted,) = llm.score(query, [long_doc], use_tqdm=False, chat_template=template)
    assert len(fitted.prompt_token_ids) == llm.model_config.max_model_len
    s = Server(
        str(tmp_path / "m"),
        "--hf-overrides",
        json.dumps(QWEN3_RERANKER),
        "--chat-template",
        str(tmp_path / "rerank.jinja"),
    )
    try:
        scores = httpx.post(s.url + "/score", json={"text_1": query, "text_2": docs}).json()
        assert [d["score"] for d in scores["data"]] == pytest.approx(want, abs=1e-5)
        # TEI's body on /rerank: the pair fitted as on /score (its template's end was cut off)
        tei = httpx.post(s.url + "/rerank", json={"query": query, "texts": [*docs, long_doc], "truncate": True})
        assert tei.status_code == 200, tei.text
        got = {r["index"]: r["score"] for r in tei.json()}
        assert [got[0], got[1], got[2]] == pytest.approx([*want, fitted.outputs.score], abs=1e-5)
        ranked = httpx.post(s.url + "/rerank", json={"query": query, "documents": docs, "instruction": "Find it"})
        assert ranked.status_code == 200, ranked.text
        assert {r["index"]: r["relevance_score"] for r in ranked.json()["results"]}[0] != pytest.approx(want[0])
    finally:
        s.stop()
    assert want != pytest.approx(plain, abs=1e-4)  # the template matters


STRICT_RERANK = (
    "{% if instruction is not defined %}{{ raise_exception('an instruction is required') }}{% endif %}"
    "{{ cls_token }}<I>{{ instruction }}<Q>{{ messages[0].content }}<D>{{ messages[1].content }}"
)


def test_a_rerank_template_gets_special_tokens_and_its_variables(tmp_path, minilm_path):
    """vLLM 0.34's scoring requests take chat_template_kwargs (their "instruction" over `instruction`; a 400
    'unknown field' before), the template sees the special tokens as transformers passes them (it saw none), and
    a template that fails is a 400 naming the variables (TEI's /rerank said 'not a re-ranker model')."""
    from tests.entrypoints.server.conftest import in_process_server
    from tests.models.test_decoder_parity import QWEN3_RERANKER, save_decoder

    save_decoder("qwen3", "ForCausalLM", tmp_path / "m", minilm_path)
    (tmp_path / "strict.jinja").write_text(STRICT_RERANK)
    llm = LLM(str(tmp_path / "m"), dtype="float32", hf_overrides=QWEN3_RERANKER)
    query, docs = "capital of china", ["beijing is the capital", "gravity is a force"]
    body = STRICT_RERANK.split("{% endif %}")[1].replace("{{ instruction }}", "find it")
    literal = body.replace("{{ cls_token }}", "[CLS]")
    want = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False, chat_template=literal)]
    bare = body.replace("{{ cls_token }}", "")
    assert [o.outputs.score for o in llm.score(query, docs, use_tqdm=False, chat_template=body)] == pytest.approx(want)
    assert want != pytest.approx([o.outputs.score for o in llm.score(query, docs, use_tqdm=False, chat_template=bare)])
    with in_process_server(llm.engine, chat_template=str(tmp_path / "strict.jinja")) as url:
        for extra in (
            {"instruction": "find it"},
            {"chat_template_kwargs": {"instruction": "find it"}},
            {"chat_template_kwargs": {"instruction": "find it"}, "instruction": "something else"},
        ):
            r = httpx.post(url + "/score", json={"text_1": query, "text_2": docs, **extra}, timeout=60)
            assert r.status_code == 200, r.text
            assert [d["score"] for d in r.json()["data"]] == pytest.approx(want, abs=1e-5), extra
        r = httpx.post(url + "/rerank", json={"query": query, "documents": docs}, timeout=60)
        error = r.json()["error"]
        assert (
            r.status_code == 400
            and "an instruction is required" in error["message"]
            and error["param"] == "instruction"
        )
        r = httpx.post(url + "/rerank", json={"query": query, "texts": docs}, timeout=60)  # TEI's body
        assert r.status_code == 422 and "an instruction is required" in r.json()["error"], r.text
        for reserved in ({"messages": []}, {"chat_template": "x"}, {"tools": []}):  # a 500, or ignored
            body = {"text_1": query, "text_2": docs, "chat_template_kwargs": {"instruction": "find it", **reserved}}
            r = httpx.post(url + "/score", json=body, timeout=60)
            error = r.json()["error"]
            assert (
                r.status_code == 400 and error["param"] == "chat_template_kwargs" and "cannot set" in error["message"]
            )
        # apply_chat_template's own options pass on to the template, as vLLM passes them (a 500 before)
        body = {
            "text_1": query,
            "text_2": docs,
            "chat_template_kwargs": {"instruction": "find it", "add_generation_prompt": True},
        }
        r = httpx.post(url + "/score", json=body, timeout=60)
        assert r.status_code == 200 and [d["score"] for d in r.json()["data"]] == pytest.approx(want, abs=1e-5)
        # a request's template variables are variables, whatever their names (render()'s own names gave a 500)
        for name in ("template", "special_tokens", "variables", "content_format_option"):
            body = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {name: "x"}}
            r = httpx.post(url + "/tokenize", json=body, timeout=60)
            assert r.status_code != 500, (name, r.text)


def test_a_sentence_transformers_cross_encoder_scores_through_its_saved_template(tmp_path, minilm_path):
    """sentence-transformers 6 saves a CrossEncoder whose tokenizer has a chat template with `message` inputs:
    it scores each pair as "query" / "document" messages through that template (its saved variables too), as
    vLLM 0.34 reads the same files; polyvec scored the plain text pair (silently other scores)."""
    import json
    import shutil

    from sentence_transformers import CrossEncoder

    from tests.helpers import save_special_tokenizer

    raw = save_tiny_model("BertForSequenceClassification", "BertConfig", tmp_path / "raw", minilm_path,
                          num_labels=1, **TINY)  # fmt: skip
    save_special_tokenizer(raw, minilm_path, [])  # nothing added around a text: the template writes it all
    template = "{{ instruction | default('judge') }}: {% for m in messages %}{{ m.role }} {{ m.content }} {% endfor %}"
    (raw / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "model_max_length": 128}))
    folder = tmp_path / "st"
    CrossEncoder(str(raw), device="cpu").save(str(folder))
    config = json.loads((folder / "sentence_bert_config.json").read_text())
    assert "message" in config["modality_config"]
    config["processing_kwargs"] = {"chat_template": {"instruction": "relevant?"}}
    (folder / "sentence_bert_config.json").write_text(json.dumps(config))
    query, docs = "capital of china", ["beijing is the capital of china", "gravity is a force"]
    want = CrossEncoder(str(folder), device="cpu").predict([(query, d) for d in docs]).tolist()
    llm = LLM(str(folder), dtype="float32")
    got = llm.score(query, docs, use_tqdm=False)
    assert [o.outputs.score for o in got] == pytest.approx(want, abs=1e-6)
    rendered = llm.get_tokenizer().decode(got[0].prompt_token_ids)
    assert rendered.startswith("relevant? : query capital of china document beijing"), rendered
    plain = LLM(str(raw), dtype="float32").score(query, docs, use_tqdm=False)
    assert [o.outputs.score for o in plain] != pytest.approx(want, abs=1e-6)  # the template matters here
    shutil.rmtree(raw)
    with in_process_server(llm.engine) as url:
        ranked = httpx.post(url + "/rerank", json={"query": query, "documents": docs}).json()["results"]
        assert {r["index"]: r["relevance_score"] for r in ranked} == pytest.approx(dict(enumerate(want)), abs=1e-6)
        asked = httpx.post(url + "/score", json={"text_1": query, "text_2": docs[0], "instruction": "other"})
        assert asked.status_code == 200 and asked.json()["data"][0]["score"] != pytest.approx(want[0], abs=1e-7)


def test_a_saved_template_pair_is_fitted_as_sentence_transformers_tokenizes_it(tmp_path, minilm_path):
    """A BERT tokenizer (it adds [CLS] / [SEP]) and a template writing its own: a long pair is cut to fit the
    model with the template's end kept, counted without added special tokens, the same tokens offline and over
    HTTP as sentence-transformers'; the pair was cut from the end offline, 2 tokens short on the server. A
    missing saved template refuses scoring only, and --chat-template replaces it."""
    import json
    import shutil

    from sentence_transformers import CrossEncoder

    raw = save_tiny_model("BertForSequenceClassification", "BertConfig", tmp_path / "raw", minilm_path,
                          num_labels=1, **TINY)  # fmt: skip
    for name in ("vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm_path / name, raw / name)
    template = "[CLS]{% for m in messages %}{{ m.role }}: {{ m.content }}[SEP]{% endfor %}"
    config = json.loads((minilm_path / "tokenizer_config.json").read_text())
    (raw / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": template, "model_max_length": 40})
    )
    folder = tmp_path / "st"
    CrossEncoder(str(raw), device="cpu").save(str(folder))
    query, doc = "capital of china", " ".join(f"word{i} beijing capital" for i in range(40))
    ce = CrossEncoder(str(folder), device="cpu")
    want_ids = ce[0].preprocess([(query, doc)])["input_ids"][0].tolist()
    llm = LLM(str(folder), dtype="float32")
    assert llm.model_config.max_model_len == 40
    got = llm.score(query, [doc], use_tqdm=False)[0]
    assert got.prompt_token_ids[-1] == 102 and len(got.prompt_token_ids) == 40
    assert got.prompt_token_ids == want_ids
    with in_process_server(llm.engine) as url:
        r = httpx.post(url + "/score", json={"text_1": query, "text_2": doc}).json()
        assert r["data"][0]["score"] == pytest.approx(got.outputs.score, abs=1e-6) and r["usage"]["prompt_tokens"] == 40

    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "chat_template"}))
    bare = LLM(str(folder), dtype="float32")
    assert bare.classify(["a text"], use_tqdm=False)[0].outputs.data.shape == (1,)  # other tasks run
    with pytest.raises(ValueError, match="declares message inputs, but the checkpoint has no 'default' chat template"):
        bare.score(query, ["short"], use_tqdm=False)
    assert bare.score(query, ["short"], use_tqdm=False, chat_template=template)[0].prompt_token_ids[0] == 101
    with in_process_server(bare.engine) as url:
        r = httpx.post(url + "/rerank", json={"query": query, "documents": ["short"]})
        assert r.status_code == 400 and "no 'default' chat template" in r.json()["error"]["message"], r.text
