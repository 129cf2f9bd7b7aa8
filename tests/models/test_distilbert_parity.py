"""DistilBERT (msmarco-distilbert, multi-qa-distilbert, distiluse, OpenSearch's sparse encoders; served by TEI)
against transformers and sentence-transformers on the same tiny random weights. Its classifier and token heads are
in test_heads.py with the other encoder families."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from polyvec import LLM, PoolingParams
from tests.helpers import cosine_rows, save_tiny_model

DISTIL = dict(vocab_size=30522, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=128)
TEXTS = ["the wing stalls at high angle of attack", "shock", "heat transfer in laminar boundary layers " * 8]


@pytest.mark.parametrize("extra", [{}, {"sinusoidal_pos_embds": True, "activation": "relu"}])
def test_hidden_states_match_transformers(tmp_path, minilm_path, extra):
    import transformers

    save_tiny_model("DistilBertModel", "DistilBertConfig", tmp_path, minilm_path, **DISTIL, **extra)
    model = transformers.AutoModel.from_pretrained(str(tmp_path)).eval()
    llm = LLM(str(tmp_path), dtype="float32")
    assert (llm.model_config.architecture, llm.model_config.hidden_size) == ("DistilBertModel", 32)
    assert llm.model_config.max_model_len == 128
    for out in llm.token_embed(TEXTS, PoolingParams(use_activation=False), use_tqdm=False):
        with torch.no_grad():
            want = model(input_ids=torch.tensor([out.prompt_token_ids])).last_hidden_state[0]
        assert (out.outputs.data - want).abs().max() <= 1e-5


def test_a_sentence_transformers_layout_matches(tmp_path, minilm_path):
    """mean pooling + Normalize (multi-qa-distilbert-cos-v1's modules); config.json without `architectures`, as
    older repos, read by model_type."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    save_tiny_model("DistilBertModel", "DistilBertConfig", tmp_path / "m", minilm_path, **DISTIL)
    trunk = Transformer(str(tmp_path / "m"), max_seq_length=64)
    st = SentenceTransformer(modules=[trunk, Pooling(32, "mean"), Normalize()], device="cpu")
    st.save(str(tmp_path / "st"))
    config = json.loads((tmp_path / "st" / "config.json").read_text())
    config.pop("architectures")
    (tmp_path / "st" / "config.json").write_text(json.dumps(config))
    llm = LLM(str(tmp_path / "st"), dtype="float32")
    assert llm.model_config.max_model_len == 64
    got = torch.stack([o.outputs.data for o in llm.embed(TEXTS, use_tqdm=False)])
    assert cosine_rows(got, st.encode(TEXTS, convert_to_tensor=True)).min() >= 0.9999


def test_masked_lm_and_its_sparse_vectors(tmp_path, minilm_path):
    """OpenSearch's neural sparse encoders are DistilBertForMaskedLM: vocabulary logits per token (the decoder
    tied to the input embeddings) and SPLADE's max of log(1 + relu) over the tokens."""
    import transformers

    save_tiny_model("DistilBertForMaskedLM", "DistilBertConfig", tmp_path, minilm_path, **DISTIL)
    model = transformers.AutoModelForMaskedLM.from_pretrained(str(tmp_path)).eval()
    llm = LLM(str(tmp_path), dtype="float32")
    assert llm.supported_tasks == ("token_classify", "embed_sparse")
    logits = llm.token_classify(TEXTS, PoolingParams(use_activation=False), use_tqdm=False)
    sparse = llm.embed_sparse(TEXTS, use_tqdm=False)
    for lg, sp in zip(logits, sparse):
        with torch.no_grad():
            want = model(input_ids=torch.tensor([lg.prompt_token_ids])).logits[0]
        assert (lg.outputs.data - want).abs().max() <= 1e-4
        dense = torch.log1p(F.relu(want)).max(0).values
        ids = dense.nonzero().flatten()
        assert sp.outputs.indices == ids.tolist()
        assert torch.allclose(torch.tensor(sp.outputs.values), dense[ids], atol=1e-5)
