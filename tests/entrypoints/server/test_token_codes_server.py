"""/pooling token_embed with token_encoding: int8 rows with scales, binary rows of packed sign bits; with muvera:
one fixed-dimensional encoding per input; each equal to the offline output; 400s for other tasks and values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from polyvec import PoolingParams


@pytest.mark.parametrize("encoding", ["int8", "binary"])
def test_pooling_returns_the_offline_codes(server, minilm_llm, encoding):
    texts = ["late interaction keeps a vector per token", "flutter"]
    want = minilm_llm.token_embed(texts, PoolingParams(token_encoding=encoding), use_tqdm=False)
    body = server.post("/pooling", {"input": texts, "task": "token_embed", "token_encoding": encoding}).json()
    for item, o in zip(body["data"], want):
        codes = o.outputs.codes
        assert item["encoding"] == encoding and item["shape"] == [codes.codes.shape[0], codes.dim]
        assert np.array_equal(np.array(item["data"]), codes.codes.numpy())
        if encoding == "int8":
            assert torch.allclose(torch.tensor(item["scales"], dtype=torch.float64), codes.scales.double(), rtol=1e-6)
        else:
            assert "scales" not in item and min(min(r) for r in item["data"]) >= 0


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"task": "embed", "token_encoding": "int8"}, None, "token_encoding applies to token_embed"),
        ({"task": "token_embed", "token_encoding": "int8", "encoding_format": "base64"}, "encoding_format",
         "encoding_format must be float"),
        ({"task": ["token_embed"], "token_encoding": "int8"}, "token_encoding", "one token_embed task"),
        ({"task": "token_embed", "token_encoding": "int4"}, "token_encoding", None),
    ],
)  # fmt: skip
def test_bad_token_encoding_is_400(server, body, param, message):
    r = server.post("/pooling", {"input": "x", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    if param is not None:
        assert err["param"] == param
    if message is not None:
        assert message in err["message"]
    assert server.post("/pooling", {"input": "x", "task": "token_embed"}).status_code == 200


def test_pooling_returns_the_offline_muvera_encoding(server, minilm_llm):
    texts = ["late interaction keeps a vector per token", "flutter"]
    for spec, input_type in (({}, None), ({"k_sim": 3, "dim_proj": 8, "r_reps": 4, "seed": 9}, "query")):
        want = minilm_llm.token_embed(texts, PoolingParams(muvera=spec or True, input_type=input_type), use_tqdm=False)
        body = {"input": texts, "task": "token_embed", "muvera": spec}
        if input_type:
            body["input_type"] = input_type
        got = server.post("/pooling", body).json()
        for item, o in zip(got["data"], want):
            assert item["shape"] == list(o.outputs.data.shape)
            assert np.allclose(np.array(item["data"]), o.outputs.data.numpy(), rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"task": "token_embed", "muvera": {"k_sim": 11}}, "muvera", "'muvera.k_sim'"),
        ({"task": "token_embed", "muvera": {"dim_proj": 500, "r_reps": 2}}, None, "must not exceed"),
        ({"task": "token_embed", "muvera": {"r_reps": 20, "k_sim": 10, "dim_proj": 64}}, None, "the limit is"),
        ({"task": "token_embed", "muvera": {"bits": 2}}, "muvera", "unknown field 'muvera.bits'"),
        ({"task": "embed", "muvera": {}}, None, "muvera applies to token_embed"),
        ({"task": "token_embed", "muvera": {}, "token_encoding": "int8"}, None, "cannot be combined"),
    ],
)
def test_bad_muvera_is_400(server, body, param, message):
    r = server.post("/pooling", {"input": "x", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    if param is not None:
        assert err["param"] == param, err
    if message is not None:
        assert message in err["message"], err
    assert server.post("/pooling", {"input": "x", "task": "token_embed", "muvera": {}}).status_code == 200


def test_muvera_output_is_held_to_the_token_limit(minilm_llm):
    """MUVERA's numbers do not shrink with the input: a request of many short inputs is held to the numbers the
    token limit allows as token vectors (40 tokens x 384 here), a 413 naming muvera; one under it passes."""
    import httpx

    from .conftest import in_process_server

    with in_process_server(minilm_llm.engine, max_tokens_per_request=40, warmup=False) as url:
        spec = {"k_sim": 3, "dim_proj": 16, "r_reps": 20}  # 2,560 numbers an input; 15,360 allowed
        r = httpx.post(f"{url}/pooling", json={"input": ["a"] * 7, "task": "token_embed", "muvera": spec})
        assert r.status_code == 413, r.text
        err = r.json()["error"]
        assert err["param"] == "muvera" and "17920 MUVERA numbers (7 inputs)" in err["message"], err
        r = httpx.post(f"{url}/pooling", json={"input": ["a"] * 6, "task": "token_embed", "muvera": spec})
        assert r.status_code == 200 and len(r.json()["data"][5]["data"]) == 2560, r.text
