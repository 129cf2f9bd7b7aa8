"""HTTP contract tests per endpoint, checked against the offline engine on the same weights."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch

from polyvec.entrypoints.server.encoding import from_bytes
from tests.helpers import cosine_rows

TEXTS = [
    "experimental investigation of the aerodynamics of a wing in a slipstream",
    "heat transfer to a blunt body",
    "flutter",
]


def offline(llm, method, texts, **kw):
    return (
        torch.stack([o.outputs.data for o in getattr(llm, method)(texts, use_tqdm=False, **kw)])
        if method == "embed"
        else [o.outputs.data for o in getattr(llm, method)(texts, use_tqdm=False, **kw)]
    )


def test_openai_client_float_and_base64(server, minilm_llm):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    ref = offline(minilm_llm, "embed", TEXTS)
    for fmt in ("float", "base64"):
        resp = client.embeddings.create(input=TEXTS, model="minilm", encoding_format=fmt)
        if fmt == "base64":  # asked for explicitly, the client hands back the string: little-endian float32
            got = torch.tensor(np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in resp.data]))
        else:
            got = torch.tensor([d.embedding for d in resp.data])
        assert [d.index for d in resp.data] == [0, 1, 2]
        assert cosine_rows(got, ref).min() >= 0.9999
        assert (
            resp.usage.prompt_tokens
            == resp.usage.total_tokens
            == sum(len(o.prompt_token_ids) for o in minilm_llm.embed(TEXTS, use_tqdm=False))
        )
        assert resp.model == "minilm"
    # The client's default (no encoding_format) is base64 too.
    got = torch.tensor(client.embeddings.create(input=TEXTS[0], model="minilm").data[0].embedding)
    assert cosine_rows(got[None], ref[:1]).item() >= 0.9999


def test_embeddings_token_id_inputs(server, minilm_llm):
    ids = minilm_llm.embed(TEXTS[1], use_tqdm=False)[0].prompt_token_ids
    for payload in (ids, [ids, ids]):
        r = server.post("/v1/embeddings", {"input": payload})
        assert r.status_code == 200, r.text
        got = torch.tensor([d["embedding"] for d in r.json()["data"]])
        assert cosine_rows(got, offline(minilm_llm, "embed", [TEXTS[1]])).min() >= 0.9999


def test_pooling_token_embed_equals_offline(server, minilm_llm):
    r = server.post("/pooling", {"input": TEXTS, "task": "token_embed"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["id"].startswith("pooling-")
    ref = offline(minilm_llm, "token_embed", TEXTS)
    for item, expected in zip(body["data"], ref):
        got = torch.tensor(item["data"])
        assert item["object"] == "pooling" and item["shape"] == list(expected.shape) == list(got.shape)
        assert cosine_rows(got, expected).min() >= 0.9999
    # No task: the model's own (vLLM's instance task), embed for an embedding model.
    default = server.post("/pooling", {"input": TEXTS[0]}).json()
    embed = server.post("/pooling", {"input": TEXTS[0], "task": "embed"}).json()
    assert default["data"][0]["shape"] == [384] and default["data"][0]["data"] == embed["data"][0]["data"]


@pytest.mark.parametrize("task", ["embed", "token_embed"])
@pytest.mark.parametrize("fmt", ["base64", "bytes", "bytes_only"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("endianness", ["native", "big", "little"])
def test_every_encoding_decodes_to_float(server, task, fmt, dtype, endianness):
    req = {"input": TEXTS, "task": task, "embed_dtype": dtype, "endianness": endianness}
    ref = [d["data"] for d in server.post("/pooling", req).json()["data"]]
    r = server.post("/pooling", dict(req, encoding_format=fmt))
    assert r.status_code == 200, r.text
    tol = {"float32": 1e-7, "float16": 1e-3, "bfloat16": 1e-2}[dtype]
    if fmt == "base64":
        decoded = [from_bytes(base64.b64decode(d["data"]), d["shape"], dtype, endianness) for d in r.json()["data"]]
    else:
        assert r.headers["content-type"] == "application/octet-stream"
        if fmt == "bytes":
            meta = json.loads(r.headers["metadata"])
            assert meta["usage"]["prompt_tokens"] > 0 and len(meta["data"]) == 3
            items = meta["data"]
        else:
            assert "metadata" not in r.headers
            shapes = [np.array(d).shape for d in ref]
            sizes = [int(np.prod(s)) * (4 if dtype == "float32" else 2) for s in shapes]
            starts = np.cumsum([0] + sizes)
            items = [{"start": int(starts[i]), "end": int(starts[i + 1]), "shape": list(shapes[i])} for i in range(3)]
        decoded = [from_bytes(r.content[it["start"] : it["end"]], it["shape"], dtype, endianness) for it in items]
    for got, want in zip(decoded, ref):
        assert torch.allclose(got, torch.tensor(want), atol=tol)


def test_score_endpoints(server, minilm_llm):
    query, docs = "wing in a slipstream", TEXTS
    ref = [o.outputs.score for o in minilm_llm.score(query, docs, use_tqdm=False)]
    for path in ("/score", "/v1/score"):
        body = server.post(path, {"text_1": query, "text_2": docs, "model": "minilm"}).json()
        assert [d["index"] for d in body["data"]] == [0, 1, 2] and body["data"][0]["object"] == "score"
        assert np.allclose([d["score"] for d in body["data"]], ref, atol=1e-5)
        assert body["usage"]["prompt_tokens"] > 0
    one = server.post("/score", {"text_1": query, "text_2": docs[1]}).json()["data"]
    assert len(one) == 1 and abs(one[0]["score"] - ref[1]) < 1e-5
    n_n = server.post("/score", {"queries": [query] * 3, "documents": docs}).json()["data"]
    assert np.allclose([d["score"] for d in n_n], ref, atol=1e-5)
    bad = server.post("/score", {"text_1": [query, query], "text_2": docs})
    assert bad.status_code == 400 and "text_1 has 2 items and text_2 has 3" in bad.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank(server, minilm_llm, path):
    query = "wing in a slipstream"
    ref = [o.outputs.score for o in minilm_llm.score(query, TEXTS, use_tqdm=False)]
    body = server.post(path, {"query": query, "documents": TEXTS, "top_n": 2}).json()
    assert [r["index"] for r in body["results"]] == list(np.argsort(ref)[::-1][:2])
    assert all(abs(r["relevance_score"] - ref[r["index"]]) < 1e-5 for r in body["results"])
    assert body["results"][0]["document"]["text"] == TEXTS[body["results"][0]["index"]]
    assert body["usage"]["total_tokens"] > 0
    bare = server.post(path, {"query": query, "documents": TEXTS, "return_documents": False}).json()
    assert len(bare["results"]) == 3 and "document" not in bare["results"][0]
    # one document alone, as vLLM takes it (a 400 "must be a list" before)
    one = server.post(path, {"query": query, "documents": TEXTS[1]})
    assert one.status_code == 200 and abs(one.json()["results"][0]["relevance_score"] - ref[1]) < 1e-5, one.text


def test_cohere_embed_v2(server, minilm_llm):
    ref = offline(minilm_llm, "embed", TEXTS)
    body = server.post(
        "/v2/embed",
        {"texts": TEXTS, "input_type": "search_document", "embedding_types": ["float", "base64", "binary", "ubinary"]},
    ).json()
    assert body["response_type"] == "embeddings_by_type" and body["texts"] == TEXTS
    assert body["meta"]["billed_units"]["input_tokens"] > 0
    assert cosine_rows(torch.tensor(body["embeddings"]["float"]), ref).min() >= 0.9999
    b64 = torch.tensor(np.frombuffer(base64.b64decode(body["embeddings"]["base64"][0]), dtype="<f4").copy())
    assert cosine_rows(b64[None], ref[:1]).item() >= 0.9999
    ubin = np.array(body["embeddings"]["ubinary"][0], dtype=np.uint8)
    assert (np.unpackbits(ubin).astype(bool) == (ref[0].numpy() >= 0)).all()
    assert body["embeddings"]["binary"][0] == [int(x) - 128 for x in ubin]


def test_tokenize_detokenize(server):
    tok = server.post("/tokenize", {"prompt": "Hello world", "return_token_strs": True}).json()
    assert tok["tokens"] == [101, 7592, 2088, 102] and tok["count"] == 4 and tok["max_model_len"] == 256
    assert tok["token_strs"] == ["[CLS]", "hello", "world", "[SEP]"]
    bare = server.post("/tokenize", {"prompt": "Hello world", "add_special_tokens": False}).json()
    assert bare["tokens"] == [7592, 2088] and bare["token_strs"] is None
    assert server.post("/detokenize", {"tokens": [7592, 2088]}).json() == {"prompt": "hello world"}
    bad = server.post("/detokenize", {"tokens": [99999999]})
    assert bad.status_code == 400 and "outside the vocabulary" in bad.json()["error"]["message"]


def test_models_health_version_metrics(server):
    models = server.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["minilm", "sentence-transformers/all-MiniLM-L6-v2"]
    assert models["data"][0]["max_model_len"] == 256
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")  # OpenAI's retrieve (it was a 404)
    assert client.models.retrieve("sentence-transformers/all-MiniLM-L6-v2").id == models["data"][1]["id"]
    with pytest.raises(openai.NotFoundError, match="the model 'default/not-specified' does not exist"):
        client.models.retrieve("default/not-specified")
    assert server.get("/health").status_code == 200
    assert server.get("/version").json()["version"]
    server.post("/v1/embeddings", {"input": "metrics probe"})
    text = server.get("/metrics").text
    for name in (
        'polyvec_requests_total{endpoint="/v1/embeddings",status="200"}',
        "polyvec_request_latency_seconds_bucket",
        "polyvec_prompt_tokens_total",
        "polyvec_queue_depth",
        "polyvec_batch_tokens_bucket",
        "polyvec_batch_sequences_bucket",
        "polyvec_engine_busy_seconds_total",
    ):
        assert name in text, name


def _metric(text: str, name: str) -> float:
    return float(next(line.rsplit(" ", 1)[1] for line in text.splitlines() if line.startswith(name)))


def test_vllm_metrics_count_prompts(server):
    """vLLM observes each prompt (an engine request) once in every per-request metric: e2e latency's count
    moves with request_success, not once per HTTP request."""
    names = ("vllm:e2e_request_latency_seconds_count", "vllm:request_success_total", "vllm:prompt_tokens_total")
    before = [_metric(server.get("/metrics").text, n) for n in names]
    assert server.post("/v1/embeddings", {"input": ["Hello world", "a b c d", "x"]}).status_code == 200
    after = [_metric(server.get("/metrics").text, n) for n in names]
    assert [b - a for a, b in zip(before, after)] == [3, 3, 4 + 6 + 3]


def test_tei_metrics_under_teis_names(server):
    """TEI's dashboards read te_request_count / _success / _failure (TEI's exact names, no _total), the request
    latency and input lengths, the batches and the queue; none were there. As TEI's, the count is of bodies that
    parsed (a token id outside the vocabulary is refused with the body), failures of those and refusals for
    overload (429); single is a body's one input, batch a list."""
    names = (
        'te_request_count{method="batch"}',
        'te_request_success{method="batch"}',
        'te_request_failure{err="validation"}',
        "te_request_duration_count",
        "te_request_input_length_sum",
        "te_request_tokenization_duration_count",
        "te_request_queue_duration_count",
        "te_request_inference_duration_count",
    )
    metrics = lambda: server.get("/metrics").text  # noqa: E731
    before = [_metric(metrics(), n) if n in metrics() else 0.0 for n in names]
    assert server.post("/v1/embeddings", {"input": ["Hello world", "a b c d"]}).status_code == 200
    assert server.post("/v1/embeddings", {"input": ["fine", [999999]]}).status_code == 400  # the body's: not counted
    assert server.post("/v1/embeddings", {"input": ["a", "b"], "dimensions": 100}).status_code == 400  # counted
    assert server.post("/nowhere", {"input": "x"}).status_code == 404  # not a pooling request
    assert server.post("/v1/embeddings", {"input": "one"}).status_code == 200
    text = metrics()
    after = [_metric(text, n) for n in names]
    assert [b - a for a, b in zip(before, after)] == [2, 1, 1, 2, 4 + 6 + 3, 2, 2, 2]
    assert _metric(text, 'te_request_success{method="single"}') >= 1
    for name in ("# TYPE te_batch_next_size histogram", "# TYPE te_batch_next_tokens histogram", "te_queue_size "):
        assert name in text, name


def test_tei_routes_count_their_failures_as_tei(server):
    """TEI counts a request once its body parsed, then each failure under its cause: a task the model lacks
    (model_type), an input over the limit (tokenization), too many inputs (batch_size), an empty one (validation).
    Failures raised before the engine was reached were not counted at all; one list of token ids is one input."""
    labels = ('method="single"', 'method="batch"', 'err="model_type"', 'err="tokenization"', 'err="batch_size"',
              'err="validation"')  # fmt: skip

    def read() -> list[float]:
        text = server.get("/metrics").text
        count = [f"te_request_count{{{x}}}" for x in labels[:2]]
        failure = [f"te_request_failure{{{x}}}" for x in labels[2:]]
        return [_metric(text, n) if n in text else 0.0 for n in count + failure]

    before = read()
    assert server.post("/predict", {"inputs": "x"}).status_code == 424  # MiniLM classifies nothing
    assert server.post("/embed", {"inputs": "word " * 600, "truncate": False}).status_code == 422
    assert server.post("/embed", {"inputs": ["a"] * 4097}).status_code == 422  # --max-inputs-per-request 4096
    assert server.post("/embed", {"inputs": ["a", ""]}).status_code == 400
    assert server.post("/embed", {"inputs": [101, 7592, 102]}).status_code == 200
    assert server.post("/rerank", {"query": "q", "texts": []}).status_code == 400  # TEI: a failure, not counted
    after = read()
    assert [b - a for a, b in zip(before, after)] == [3, 2, 1, 1, 1, 2]
    text = server.get("/metrics").text  # input-length buckets stop at the longest input, as TEI's
    buckets = [float(line.split('le="')[1].split('"')[0]) for line in text.splitlines()
               if line.startswith("te_request_input_length_bucket")]  # fmt: skip
    assert max(b for b in buckets if b != float("inf")) == 256.0  # MiniLM's max_model_len 256 (TEI's 2^k ≤ it)


def test_add_special_tokens_false(server, minilm_llm):
    body = server.post("/pooling", {"input": "hello world", "task": "token_embed", "add_special_tokens": False}).json()
    assert body["data"][0]["shape"] == [2, 384] and body["usage"]["prompt_tokens"] == 2
