"""int8 and binary token codes: round trips, the packed bit layout, asymmetric MaxSim, and the engine's
token_embed outputs in that form (offline and over /pooling)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from polyvec import PoolingParams
from polyvec.token_codes import TokenCodes, encode_tokens, maxsim
from tests.helpers import cosine_rows


def test_int8_round_trip_and_layout():
    x = torch.randn(50, 384)
    c = encode_tokens(x, "int8")
    assert c.codes.dtype == torch.int8 and c.codes.shape == (50, 384) and c.scales.shape == (50,)
    assert c.codes.abs().amax(dim=1).eq(127).all()  # each vector's largest entry takes the full range
    back = c.dequantize()
    assert (back - x).abs().max() <= (c.scales / 2 + 1e-7).max()  # half a step at most
    assert cosine_rows(back, x).min() >= 0.9999
    assert c.nbytes == 50 * 384 + 50 * 4 and x.numel() * 4 / c.nbytes > 3.9


def test_binary_is_numpys_packbits_of_the_signs():
    x = torch.randn(7, 130)  # a width that is not a multiple of 8
    c = encode_tokens(x, "binary")
    assert c.codes.dtype == torch.uint8 and c.codes.shape == (7, 17) and c.scales is None
    assert np.array_equal(c.codes.numpy(), np.packbits(x.numpy() >= 0, axis=1))
    back = c.dequantize()
    assert torch.equal(back > 0, x >= 0) and torch.allclose(back.norm(dim=1), torch.ones(7))
    with pytest.raises(ValueError, match="token_encoding must be one of int8, binary"):
        encode_tokens(x, "int4")


def test_asymmetric_maxsim_keeps_the_query_float():
    q, d = torch.randn(8, 64), torch.randn(30, 64)
    d = d / d.norm(dim=1, keepdim=True)
    exact = maxsim(q, d)
    c8 = encode_tokens(d, "int8")
    assert maxsim(q, c8) == pytest.approx(float((q @ c8.dequantize().T).amax(1).sum()), rel=1e-6)
    assert maxsim(q, c8) == pytest.approx(exact, rel=1e-2)
    bits = encode_tokens(d, "binary")
    signs = (d >= 0).float() * 2 - 1
    assert maxsim(q, bits) == pytest.approx(float((q @ signs.T).amax(1).sum()) / math.sqrt(64), rel=1e-6)


def test_engine_outputs_codes_and_rankings_hold(minilm_llm, cranfield_texts):
    docs = cranfield_texts[:20]
    floats = [o.outputs.data for o in minilm_llm.token_embed(docs, use_tqdm=False)]
    for encoding in ("int8", "binary"):
        outs = minilm_llm.token_embed(docs, PoolingParams(token_encoding=encoding), use_tqdm=False)
        for o, f in zip(outs, floats):
            want = encode_tokens(f, encoding)
            assert isinstance(o.outputs.codes, TokenCodes) and o.outputs.data is o.outputs.codes.codes
            assert torch.equal(o.outputs.codes.codes, want.codes)
        queries = [o.outputs.data for o in minilm_llm.token_embed(docs[:5], use_tqdm=False)]
        for q in queries:  # each document's own text as the query: its own page first, as with floats
            exact = [maxsim(q, f) for f in floats]
            coded = [maxsim(q, o.outputs.codes) for o in outs]
            assert int(np.argmax(coded)) == int(np.argmax(exact))
            if encoding == "int8":
                assert coded == pytest.approx(exact, rel=5e-3)
    with pytest.raises(ValueError, match="token_encoding applies to token_embed, not 'embed'"):
        minilm_llm.embed("x", PoolingParams(token_encoding="int8"), use_tqdm=False)
