"""SPLADE (embed_sparse) against sentence-transformers' SparseEncoder on the real SPLADE-tiny weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from polyvec import LLM, PoolingParams
from polyvec.layers import pooler
from tests.helpers import save_inference_free_splade


@pytest.fixture(scope="module")
def splade_llm(splade_path):
    return LLM(str(splade_path), dtype="float32")


def _reference(folder, texts):
    from sentence_transformers import SparseEncoder

    st = SparseEncoder(str(folder), device="cpu")
    out = st.encode(texts, convert_to_tensor=True, batch_size=8)
    return (out.to_dense() if out.is_sparse else out).float(), st


def _assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    """The same non-zero ids; weights within 1e-4 relative, or 1e-5 absolute for weights near zero, where the
    float32 noise of the logits (up to ~5e-6 on 500-token texts: padded batches there, packed here) is more
    than 1e-4 of the weight."""
    assert torch.equal(got.nonzero(), want.nonzero()), "the same non-zero vocabulary ids"
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)
    big = want > 0.1
    assert ((got[big] - want[big]).abs() / want[big]).max() <= 1e-4


def test_sparse_vectors_equal_sentence_transformers(splade_llm, splade_path, cranfield_texts):
    want, st = _reference(splade_path, cranfield_texts)
    assert splade_llm.model_config.max_model_len == st.max_seq_length
    outs = splade_llm.embed_sparse(cranfield_texts, use_tqdm=False)
    for o, w in zip(outs, want):
        _assert_same(o.outputs.data, w)
        assert o.outputs.indices == sorted(o.outputs.indices) and len(o.outputs.values) == len(o.outputs.indices)
        assert all(v > 0 for v in o.outputs.values) and o.outputs.dim == 30522


def test_batch_invariant_and_chunked_reduction_exact(splade_llm, cranfield_texts, monkeypatch):
    whole = [o.outputs.data for o in splade_llm.embed_sparse(cranfield_texts[:12], use_tqdm=False)]
    alone = [splade_llm.embed_sparse(t, use_tqdm=False)[0].outputs.data for t in cranfield_texts[:3]]
    for a, w in zip(alone, whole):
        assert torch.allclose(a, w, atol=1e-6)
    # chunks of 48 tokens: several short sequences per chunk, and long ones split across chunks
    monkeypatch.setattr(pooler, "SPARSE_CHUNK_TOKENS", 48)
    small = [o.outputs.data for o in splade_llm.embed_sparse(cranfield_texts[:12], use_tqdm=False)]
    for s, w in zip(small, whole):
        assert torch.allclose(s, w, atol=1e-6)


@pytest.mark.parametrize(("strategy", "activation"), [("sum", "relu"), ("max", "log1p_relu")])
def test_sentence_transformers_sparse_layout(tmp_path, splade_path, cranfield_texts, strategy, activation):
    """A SparseEncoder folder: MLMTransformer + SpladePooling with its pooling strategy and activation."""
    folder = tmp_path / "splade"
    shutil.copytree(splade_path, folder)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.sparse_encoder.models.MLMTransformer"},
        {"idx": 1, "name": "1", "path": "1_SpladePooling", "type": "sentence_transformers.sparse_encoder.models.SpladePooling"},  # noqa: E501
    ]  # fmt: skip
    (folder / "modules.json").write_text(json.dumps(modules))
    sparse_model = {"model_type": "SparseEncoder", "similarity_fn_name": "dot"}
    (folder / "config_sentence_transformers.json").write_text(json.dumps(sparse_model))
    (folder / "1_SpladePooling").mkdir()
    config = {"pooling_strategy": strategy, "activation_function": activation, "word_embedding_dimension": 30522}
    (folder / "1_SpladePooling" / "config.json").write_text(json.dumps(config))
    texts = cranfield_texts[:8]
    want, st = _reference(folder, texts)
    assert len(st) == 2 and st[1].pooling_strategy == strategy and st[1].activation_function == activation
    llm = LLM(str(folder), dtype="float32")
    assert llm.model_config.splade.pooling == strategy
    for o, w in zip(llm.embed_sparse(texts, use_tqdm=False), want):
        _assert_same(o.outputs.data, w)


def test_pruning_and_tokens(splade_llm, cranfield_texts):
    text = cranfield_texts[5]
    full = splade_llm.embed_sparse(text, use_tqdm=False)[0].outputs
    top = splade_llm.embed_sparse(text, PoolingParams(sparse_top_k=5, return_tokens=True), use_tqdm=False)[0]
    best = sorted(range(len(full.values)), key=lambda i: -full.values[i])[:5]
    assert top.outputs.indices == sorted(full.indices[i] for i in best)
    tok = splade_llm.get_tokenizer()
    assert top.outputs.tokens == [tok.id_to_token(i) for i in top.outputs.indices]
    cut = splade_llm.embed_sparse(text, PoolingParams(sparse_threshold=1.0), use_tqdm=False)[0].outputs
    assert cut.indices == [i for i, v in zip(full.indices, full.values) if v >= 1.0]
    for bad, message in [
        (PoolingParams(use_activation=False), "use_activation=False is not valid"),
        (PoolingParams(activation=False), "activation=False is not valid"),  # the older name, ignored before
        (PoolingParams(sparse_top_k=0), "sparse_top_k must be a positive integer"),
        (PoolingParams(sparse_threshold=-1.0), "sparse_threshold must be a non-negative number"),
        (PoolingParams(long_input="window"), "does not apply to embed_sparse"),
    ]:
        with pytest.raises(ValueError, match=message):
            splade_llm.embed_sparse(text, bad, use_tqdm=False)
    with pytest.raises(ValueError, match="sparse_top_k applies to embed_sparse, not 'token_classify'"):
        splade_llm.token_classify(text, PoolingParams(sparse_top_k=3), use_tqdm=False)


def test_dense_models_do_not_have_it(minilm_llm):
    with pytest.raises(ValueError, match="Unsupported task: 'embed_sparse'"):
        minilm_llm.embed_sparse("x", use_tqdm=False)


def test_bfloat16_decoder_stays_close(splade_path, splade_llm, cranfield_texts):
    """In bfloat16 the vocabulary decoder runs in bfloat16 too (its logits in float32): the same vectors to
    cosine 0.9999; weights near zero may appear or vanish."""
    bf16 = LLM(str(splade_path), dtype="bfloat16")
    for a, b in zip(
        bf16.embed_sparse(cranfield_texts[:10], use_tqdm=False),
        splade_llm.embed_sparse(cranfield_texts[:10], use_tqdm=False),
    ):
        assert torch.nn.functional.cosine_similarity(a.outputs.data, b.outputs.data, dim=0) >= 0.9999


@pytest.fixture(scope="module")
def inference_free(tmp_path_factory, splade_path):
    from sentence_transformers import SparseEncoder

    folder = save_inference_free_splade(splade_path, tmp_path_factory.mktemp("inference-free"))
    return folder, SparseEncoder(str(folder), device="cpu")


def test_inference_free_splade_equals_sentence_transformers(inference_free, cranfield_texts):
    folder, st = inference_free
    queries = ["what is the boundary layer?", "Heat transfer; heat transfer at Mach 5!", cranfield_texts[7], ""]
    docs = cranfield_texts[:6]
    llm = LLM(str(folder), dtype="float32")
    assert llm.model_config.splade.query_weights is not None
    q_want = st.encode_query(queries, convert_to_tensor=True).to_dense().float()
    d_want = st.encode_document(docs, convert_to_tensor=True).to_dense().float()
    steps = llm.engine.stats.num_batches
    q_got = llm.embed_sparse(queries, PoolingParams(input_type="query"), use_tqdm=False)
    assert llm.engine.stats.num_batches == steps, "queries need no forward pass"
    for o, w in zip(q_got, q_want):
        assert torch.equal(o.outputs.data, w)  # a table lookup: exact
    assert q_got[3].outputs.indices == [] and q_got[1].prompt_token_ids[0] != llm.get_tokenizer().token_to_id("[CLS]")
    for params in (None, PoolingParams(input_type="document")):
        for o, w in zip(llm.embed_sparse(docs, params, use_tqdm=False), d_want):
            _assert_same(o.outputs.data, w)
    # queries and documents mixed in one call, with pruning on the query side
    mixed = llm.embed_sparse(
        [queries[0], docs[0]], [PoolingParams(input_type="query", sparse_top_k=2), PoolingParams()], use_tqdm=False
    )
    top2 = q_want[0].topk(2).indices.sort().values.tolist()
    assert mixed[0].outputs.indices == top2
    _assert_same(mixed[1].outputs.data, d_want[0])
    with pytest.raises(ValueError, match="several tasks from one pass need the model"):
        llm.encode(queries[0], PoolingParams(input_type="query"), pooling_task=["embed_sparse", "token_classify"])


def test_router_with_another_query_route_is_refused(inference_free, tmp_path):
    folder = tmp_path / "router"
    shutil.copytree(inference_free[0], folder)
    config = json.loads((folder / "router_config.json").read_text())
    config["structure"]["query"] = ["document_0_MLMTransformer"]
    (folder / "router_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"query route is \['MLMTransformer'\].*not supported"):
        LLM(str(folder), dtype="float32")


def test_vllms_splade_architecture_embeds_over_the_vocabulary(splade_path, splade_llm, cranfield_texts, monkeypatch):
    """vLLM's `--hf-overrides '{"architectures": ["BertSpladeSparseEmbeddingModel"]}'` (its documented way to serve
    SPLADE) was refused. Its embed is log1p(relu(MLM logits)) max-pooled, as a dense vector over the vocabulary,
    with a leading cls_token_id and a trailing sep_token_id of config.json left out (none when it names none);
    a text left with no tokens gives zeros. Against transformers' BertForMaskedLM on the same weights."""
    from transformers import AutoTokenizer, BertForMaskedLM

    texts = [*cranfield_texts[:6], "", "a"]
    arch = {"architectures": ["BertSpladeSparseEmbeddingModel"]}
    plain = LLM(str(splade_path), dtype="float32", hf_overrides=arch)
    assert plain.engine.supported_tasks[0] == "embed" and plain.engine.pooling_task == "embed"
    got = torch.stack([o.outputs.data for o in plain.embed(texts, use_tqdm=False)])
    sparse = torch.stack([o.outputs.data for o in splade_llm.embed_sparse(texts, use_tqdm=False)])
    assert got.shape == (len(texts), 30522) and torch.allclose(got, sparse, atol=1e-6)  # no ids: every token

    trimmed = LLM(str(splade_path), dtype="float32", hf_overrides={**arch, "cls_token_id": 101, "sep_token_id": 102})
    got = torch.stack([o.outputs.data for o in trimmed.embed(texts, use_tqdm=False)])
    tok, mlm = AutoTokenizer.from_pretrained(str(splade_path)), BertForMaskedLM.from_pretrained(str(splade_path))
    for row, text in zip(got, texts):
        enc = tok(text, return_tensors="pt", truncation=True, max_length=512)
        with torch.no_grad():
            logits = mlm(**enc).logits[0, 1:-1]  # [CLS] and [SEP] left out
        want = torch.log1p(torch.relu(logits)).amax(0) if len(logits) else torch.zeros(30522)
        assert torch.allclose(row, want, atol=1e-5), text[:40]
    assert not got[-2].any() and got[-1].any()  # "" is [CLS] [SEP]: nothing left
    with pytest.raises(ValueError, match="long_input='window' does not apply to a SPLADE model's embed"):
        trimmed.embed(texts[:1], PoolingParams(long_input="window"), use_tqdm=False)
    monkeypatch.setattr(pooler, "SPARSE_CHUNK_TOKENS", 16)  # a long text's logits in pieces: the same vector
    assert torch.allclose(trimmed.embed(texts[:2], use_tqdm=False)[0].outputs.data, got[0], atol=1e-6)
