"""/pooling token_embed with token_encoding: int8 rows with scales, binary rows of packed sign bits; equal to
the offline codes; 400s for other tasks and encodings."""

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
