"""Bad input gets a 4xx JSON error naming the problem, and the server keeps serving."""

from __future__ import annotations

import pytest

OK = {"input": "a good request"}
LONG = "turbulent boundary layer " * 4000  # ~100k characters

# (path, body or raw bytes, status, words the message must contain)
CASES = [
    ("/v1/embeddings", {"input": 5}, 400, "field 'input'"),
    ("/v1/embeddings", {"input": "x", "colour": "red"}, 400, "unknown field 'colour'"),
    ("/v1/embeddings", {}, 400, "field 'input' is required"),
    ("/v1/embeddings", {"input": []}, 400, "'input' must not be empty"),
    ("/v1/embeddings", {"input": [[]]}, 400, "'input' item 0 is an empty list of token ids"),
    (
        "/v1/embeddings",
        {"input": ["ok", "\u200b"], "add_special_tokens": False},
        400,
        "input 1 has no tokens after tokenization",
    ),
    (
        "/v1/embeddings",
        {"input": "\u0003", "add_special_tokens": False, "encoding_format": "base64"},
        400,
        "input 0 has no tokens after tokenization",
    ),
    (
        "/pooling",
        {"input": ["\u200b"], "add_special_tokens": False, "task": "token_embed"},
        400,
        "input 0 has no tokens after tokenization",
    ),
    ("/v1/embeddings", {"input": [101, -5]}, 400, "field 'input'"),
    ("/v1/embeddings", {"input": [101, 99999999]}, 400, "token ids must be integers in 0..30521"),
    ("/v1/embeddings", {"input": "x", "dimensions": 0}, 400, "field 'dimensions'"),
    ("/v1/embeddings", {"input": "x", "dimensions": 100}, 400, "dimensions=100 is not allowed"),
    ("/v1/embeddings", {"input": "x", "encoding_format": "hex"}, 400, "field 'encoding_format'"),
    ("/v1/embeddings", {"input": "x", "embed_dtype": "int8"}, 400, "field 'embed_dtype'"),
    ("/v1/embeddings", {"input": "x", "truncate_prompt_tokens": 1000}, 400, "truncate_prompt_tokens=1000"),
    ("/v1/embeddings", {"input": "x", "normalize": True, "use_activation": False}, 400, "conflicts"),
    ("/v1/embeddings", {"input": "x", "model": "gpt-4"}, 404, "the model 'gpt-4' does not exist"),
    ("/v1/embeddings", {"input": ["x"] * 5000}, 400, "the limit is 4096 per request"),
    ("/v1/embeddings", b'{"input": [1, 2', 400, "not valid JSON"),
    ("/v1/embeddings", b'\xff\xfe\x00{"input": "x"}', 400, "not valid JSON"),
    ("/v1/embeddings", b"[1, 2, 3]", 400, "field 'body'"),
    ("/pooling", {"input": "x", "task": "summarize"}, 400, "field 'task'"),
    ("/pooling", {"input": "x", "task": "classify"}, 400, "it supports: embed, token_embed"),
    ("/pooling", {"input": "x", "task": "embed", "activation": True}, 400, "activation is only valid"),
    ("/pooling", {"input": "x", "task": "embed", "softmax": True}, 400, "unknown field 'softmax'"),
    ("/classify", {"input": "x"}, 400, "it supports: embed, token_embed"),
    ("/score", {"text_1": "x"}, 400, "text_1 and text_2 are required"),
    ("/score", {"text_1": [], "text_2": "y"}, 400, "at least one text on each side"),
    ("/rerank", {"query": "q", "documents": []}, 400, "'documents' must not be empty"),
    ("/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, 400, "field 'top_n'"),
    ("/v2/embed", {"texts": ["x"], "truncate": "START"}, 400, "truncate='START' is not supported"),
    ("/v2/embed", {"texts": ["x"], "embedding_types": ["int4"]}, 400, "field 'embedding_types"),
    ("/tokenize", {"prompt": "x", "text": "x"}, 400, "unknown field 'text'"),
    ("/tokenize", {"text": "x"}, 400, "field 'prompt' is required"),
    ("/nowhere", {"input": "x"}, 404, "no route /nowhere"),
]


@pytest.mark.parametrize("path,body,status,words", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_bad_input(server, path, body, status, words):
    if isinstance(body, bytes):
        r = server.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = server.post(path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"], err
    assert err["code"] == status and err["type"] and "Traceback" not in r.text
    assert server.post("/v1/embeddings", OK).status_code == 200


def test_empty_and_blank_strings_are_inputs(server, minilm_llm):
    """As in sentence-transformers and vLLM: an empty string embeds its special tokens; one blank item does not
    fail the batch."""
    r = server.post("/v1/embeddings", {"input": ["", "a real sentence", "   "]})
    assert r.status_code == 200, r.text
    got = [item["embedding"] for item in r.json()["data"]]
    ref = [o.outputs.embedding for o in minilm_llm.embed(["", "a real sentence", "   "], use_tqdm=False)]
    for a, b in zip(got, ref):
        assert sum(x * y for x, y in zip(a, b)) > 0.9999
    assert r.json()["usage"]["prompt_tokens"] == 2 + 5 + 2


def test_long_input_is_truncated_by_default(server):
    r = server.post("/v1/embeddings", {"input": LONG})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 256


def test_wrong_method(server):
    r = server.get("/v1/embeddings")
    assert r.status_code == 405 and r.json()["error"]["code"] == 405


def test_api_key(strict_server):
    s = strict_server
    assert s.get("/health").status_code == 200  # open even with a key
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
        r = s.post("/v1/embeddings", {"input": "x"}, headers=headers)
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    assert s.get("/v1/models").status_code == 401 and s.get("/metrics").status_code == 401
    ok = s.post("/v1/embeddings", {"input": "x"}, headers={"Authorization": "Bearer sekret"})
    assert ok.status_code == 200


def test_truncation_error_mode_and_body_limit(strict_server):
    s, auth = strict_server, {"Authorization": "Bearer sekret"}
    r = s.post("/v1/embeddings", {"input": ["short", "word " * 100]}, headers=auth)
    assert r.status_code == 400
    assert "prompt 1 has 102 tokens, more than the maximum input length of 64" in r.json()["error"]["message"]
    cut = s.post("/v1/embeddings", {"input": "word " * 100, "truncate_prompt_tokens": 32}, headers=auth)
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 32
    big = s.post("/v1/embeddings", {"input": LONG * 2}, headers=auth)
    assert big.status_code == 413 and "larger than the limit of 200000 bytes" in big.json()["error"]["message"]
    assert s.post("/v1/embeddings", {"input": "still fine"}, headers=auth).status_code == 200
