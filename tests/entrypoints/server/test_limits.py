"""Per-request limits on tokenized input (strict_server: max_model_len 64, --max-tokens-per-request 10000,
--max-windows-per-input 150): over either, 413 with the error body naming the limit and its flag, before anything
is queued; under them, the same requests succeed."""

from __future__ import annotations

import orjson

AUTH = {"Authorization": "Bearer sekret"}
WORDS_60 = "word " * 60  # 62 tokens with [CLS] and [SEP]: fits in max_model_len 64


def _error(r) -> dict:
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert error["code"] == 413 and error["type"] == "RequestEntityTooLarge"
    return error


def test_tokens_per_request(strict_server):
    s = strict_server
    ok = s.post("/v1/embeddings", {"input": [WORDS_60] * 161}, headers=AUTH)  # 9982 tokens
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 9982, ok.text
    error = _error(s.post("/v1/embeddings", {"input": [WORDS_60] * 162}, headers=AUTH))  # 10044 tokens
    assert error["message"] == (
        "the request's inputs have 10044 tokens after tokenization and truncation; the limit is 10000 tokens per "
        "request (--max-tokens-per-request)"
    )
    assert error["param"] == "input"
    # Counted after truncation: 162 inputs cut to 32 tokens each are 5184 tokens.
    cut = s.post("/v1/embeddings", {"input": [WORDS_60] * 162, "truncate_prompt_tokens": 32}, headers=AUTH)
    assert cut.status_code == 200, cut.text
    # Every pooling route: Cohere's texts, a rerank's query and documents together.
    error = _error(s.post("/v2/embed", {"texts": [WORDS_60] * 162, "embedding_types": ["float"]}, headers=AUTH))
    assert "--max-tokens-per-request" in error["message"] and error["param"] == "texts"
    error = _error(s.post("/rerank", {"query": WORDS_60, "documents": [WORDS_60] * 161}, headers=AUTH))
    assert "10044 tokens" in error["message"] and "--max-tokens-per-request" in error["message"]
    assert s.post("/v1/embeddings", {"input": "still fine"}, headers=AUTH).status_code == 200
    # /tokenize documents this 413 too (it counted any number of tokens): vLLM's body, and TEI's (its body)
    long = " ".join([WORDS_60] * 170)
    error = _error(s.post("/tokenize", {"prompt": long}, headers=AUTH))
    assert "the limit is 10000 tokens per request (--max-tokens-per-request)" in error["message"]
    assert error["param"] == "prompt"
    # TEI's routes keep the limit's 413 (they answered 422), in TEI's body
    for path, body in (("/tokenize", {"inputs": [long]}), ("/embed", {"inputs": [WORDS_60] * 162})):
        r = s.post(path, body, headers=AUTH)
        assert r.status_code == 413 and r.json()["error_type"] == "Validation", (path, r.text)
        assert "--max-tokens-per-request" in r.json()["error"]
    assert s.post("/tokenize", {"prompt": WORDS_60}, headers=AUTH).json()["count"] == 62


def test_token_ids_count_as_sent(strict_server):
    """Token ids are counted as sent, before truncation: 8 million ids in one prompt were validated on the event
    loop (/health held 2 s, 2 GB), then cut to max_model_len. A large body's are counted before it is parsed,
    a small one's after: the same 413 either way."""
    s = strict_server
    small = {"input": [[2773] * 5001, [2773] * 5000]}  # 10001 ids, a body of ~60 KB
    error = _error(s.post("/v1/embeddings", small, headers=AUTH))
    assert (
        error["message"].startswith("the request carries 10001 token ids; the limit is 10000")
        and error["param"] == "input"
    )
    from polyvec.entrypoints.server.app import _too_many_items  # what the middleware runs on a large body

    large = orjson.dumps({"input": [2773] * 300_000})
    assert _too_many_items(large, 4096, 10000) == ("input", 300_000, True)
    assert _too_many_items(orjson.dumps({"input": [[1, 2]] * 6000}), 8000, 10000) == ("input", 12000, True)
    assert _too_many_items(large, 4096, 0) is None  # no limit
    # what orjson refuses and json.loads (FastAPI's) reads is checked too: it was parsed on the event loop
    many = b'{"input": [' + b",".join([b"[1]"] * 5000) + b"]"
    for body in (b"\xef\xbb\xbf" + many + b"}", many + b', "dimensions": NaN}', many + b', "user": "\\ud800"}'):
        assert _too_many_items(body, 4096, 0) == ("input", 5000, False), body[-30:]
    # a flat list of numbers is one token-id prompt, whatever its bad item (an id beyond 64 bits, 1.0)
    for bad in (b"100000000000000000000000000000", b"1.0"):
        body = b'{"input": [' + b",".join([b"1"] * 5000 + [bad]) + b"]}"
        assert _too_many_items(body, 4096, 0) is None, bad
    ok = s.post("/v1/embeddings", {"input": [[2773] * 5000] * 2, "truncate_prompt_tokens": 64}, headers=AUTH)
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 128, ok.text


def test_windows_per_input(strict_server):
    s = strict_server
    # 62 content tokens per window of 64: 9300 words are 150 windows, 9301 words 151.
    fits = s.post("/v1/embeddings", {"input": "word " * 9300, "long_input": "window"}, headers=AUTH)
    assert fits.status_code == 200 and fits.json()["usage"]["prompt_tokens"] == 9302, fits.text
    body = {"input": ["short", "word " * 9301], "long_input": "window"}
    error = _error(s.post("/v1/embeddings", body, headers=AUTH))
    assert error["message"] == (
        "'input' item 1 has 9303 tokens, split into 151 windows of 64 tokens; the limit is 150 windows per input "
        "(--max-windows-per-input)"
    )
    assert error["param"] == "input"
    pooled = s.post("/pooling", {**body, "task": "token_embed"}, headers=AUTH)
    assert _error(pooled)["message"].startswith("'input' item 1 has 9303 tokens, split into 151 windows")


def test_limits_are_documented(strict_server):
    doc = strict_server.get("/openapi.json", headers=AUTH).json()
    described = doc["paths"]["/v1/embeddings"]["post"]["responses"]["413"]["description"]
    assert "--max-tokens-per-request" in described and "--max-windows-per-input" in described


def test_a_huge_text_over_the_window_limit_is_refused_from_a_part(minilm_llm):
    """An input to be split into windows was tokenized whole before the window limit refused it (a huge text:
    seconds of a tokenizer thread and gigabytes); one longer than the windows can hold is refused from a part
    of it now, as too long, with the window limit's 413. An input that fits the windows still passes."""
    import httpx

    from .conftest import in_process_server

    window = minilm_llm.model_config.max_model_len
    with in_process_server(minilm_llm.engine, max_windows_per_input=4, warmup=False) as url:
        huge = {"input": ["short", "word " * 200_000], "long_input": "window"}  # 1 MB: read in part
        r = httpx.post(f"{url}/v1/embeddings", json=huge, timeout=60)
        assert r.status_code == 413, r.text
        error = r.json()["error"]
        assert error["param"] == "input" and error["message"].startswith("'input' item 1 has at least "), error
        assert error["message"].endswith(
            f"tokens, more than 4 windows of {window} tokens hold; the limit is 4 windows per input "
            "(--max-windows-per-input)"
        )
        n = int(error["message"].split()[6])
        assert 4 * window < n < 200_000  # the part's tokens, not the whole text's
        ids = {"input": [[101] + [2773] * (4 * window + 10) + [102]], "long_input": "window"}  # token ids alike
        error = httpx.post(f"{url}/v1/embeddings", json=ids, timeout=60).json()["error"]
        assert error["code"] == 413 and "windows per input (--max-windows-per-input)" in error["message"], error
        fits = httpx.post(f"{url}/v1/embeddings", json={"input": "word " * (3 * window), "long_input": "window"})
        assert fits.status_code == 200, fits.text
