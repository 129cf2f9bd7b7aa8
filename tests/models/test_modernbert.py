"""ModernBERT against transformers (and sentence-transformers / PyLate for their layouts) on small random
configurations whose local window (±8 tokens) is shorter than most test inputs, so both attention kinds count."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from polyvec import LLM, PoolingParams
from polyvec.platforms import KernelOptions
from tests.helpers import cosine_rows, save_pylate

CONFIG = dict(
    vocab_size=30522,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,  # layers 0 and 3 global, 1 and 2 local
    num_attention_heads=4,
    local_attention=16,
    global_attn_every_n_layers=3,
    max_position_embeddings=2048,
    pad_token_id=0,
    cls_token_id=101,
    sep_token_id=102,
    bos_token_id=101,
    eos_token_id=102,
)
TEXTS = [
    "flutter",
    "the boundary layer separates from the wing at high angles of attack",
    "heat transfer to a flat plate in supersonic flow, measured and compared with theory " * 6,
    "a",
]


def save_modernbert(kind: str, folder: Path, tokenizer_from: Path, old_config: bool = False, **overrides) -> Path:
    """transformers' ModernBert{kind} with seeded weights (norms perturbed off 1, so a mis-loaded norm shows),
    MiniLM's tokenizer; `old_config`: config.json as checkpoints before transformers 5 write it (global/local
    rope thetas and global_attn_every_n_layers instead of rope_parameters and layer_types)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.ModernBertConfig(**{**CONFIG, **overrides})
    model = getattr(transformers, f"ModernBert{kind}")(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    shutil.copy(tokenizer_from / "tokenizer.json", folder / "tokenizer.json")
    if old_config:
        config = json.loads((folder / "config.json").read_text())
        config.pop("layer_types", None)
        rope = config.pop("rope_parameters")
        config["global_rope_theta"] = rope["full_attention"]["rope_theta"]
        config["local_rope_theta"] = rope["sliding_attention"]["rope_theta"]
        config["global_attn_every_n_layers"] = CONFIG["global_attn_every_n_layers"]
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def _hf(folder: Path, kind: str):
    import transformers

    model = getattr(transformers, f"ModernBert{kind}").from_pretrained(str(folder)).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    return model, tok


def _run_hf(model, tok, text: str):
    enc = tok(text, return_tensors="pt")
    with torch.no_grad():
        return model(**enc)


@pytest.fixture(scope="module")
def bare(tmp_path_factory, minilm_path):
    return save_modernbert("Model", tmp_path_factory.mktemp("modernbert"), minilm_path)


@pytest.mark.parametrize("old_config", [False, True])
@pytest.mark.parametrize("kernels", [None, KernelOptions(native=False)], ids=["packed-kernel", "sdpa-grid"])
def test_trunk_matches_transformers(tmp_path, minilm_path, old_config, kernels):
    folder = save_modernbert("Model", tmp_path / "m", minilm_path, old_config=old_config)
    model, tok = _hf(folder, "Model")
    assert model.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    llm = LLM(str(folder), dtype="float32", kernels=kernels)
    assert llm.engine.runner.packed_attention is (kernels is None)
    outs = llm.token_embed(TEXTS, PoolingParams(use_activation=False), use_tqdm=False)
    assert max(len(o.prompt_token_ids) for o in outs) > 90  # far past the window
    for text, o in zip(TEXTS, outs):
        ref = _run_hf(model, tok, text).last_hidden_state[0]
        assert o.outputs.data.shape == ref.shape
        assert cosine_rows(o.outputs.data, ref).min() >= 0.9999
        assert (o.outputs.data - ref).abs().max() < 1e-4


def test_embed_batch_invariance_and_long_input(bare):
    """Alone or in a batch: the same vectors; an input of 1,500 tokens (no windows of max_model_len) matches."""
    model, tok = _hf(bare, "Model")
    llm = LLM(str(bare), dtype="float32")
    together = llm.embed(TEXTS, use_tqdm=False)
    for text, o in zip(TEXTS, together):
        alone = llm.embed(text, use_tqdm=False)[0].outputs.data
        assert (alone - o.outputs.data).abs().max() <= 1e-6
    long_text = " ".join(f"word{i}" for i in range(500))
    out = llm.token_embed(long_text, PoolingParams(use_activation=False), use_tqdm=False)[0]
    assert len(out.prompt_token_ids) > 1000
    ref = _run_hf(model, tok, long_text).last_hidden_state[0]
    assert cosine_rows(out.outputs.data, ref).min() >= 0.9999


def test_bfloat16_stays_close(bare):
    f32 = LLM(str(bare), dtype="float32").embed(TEXTS, use_tqdm=False)
    bf16 = LLM(str(bare), dtype="bfloat16").embed(TEXTS, use_tqdm=False)
    for a, b in zip(f32, bf16):
        assert cosine_rows(a.outputs.data, b.outputs.data).item() >= 0.999


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_sequence_classifier_matches_transformers(tmp_path, minilm_path, pooling):
    folder = save_modernbert("ForSequenceClassification", tmp_path / "c", minilm_path, num_labels=3,
                             classifier_pooling=pooling)  # fmt: skip
    model, tok = _hf(folder, "ForSequenceClassification")
    llm = LLM(str(folder), dtype="float32")
    raw = llm.classify(TEXTS, PoolingParams(use_activation=False), use_tqdm=False)
    for text, o in zip(TEXTS, raw):
        ref = _run_hf(model, tok, text).logits[0]
        assert (o.outputs.data - ref).abs().max() <= 1e-5
    probs = llm.classify(TEXTS[1], use_tqdm=False)[0].outputs.data
    assert torch.allclose(probs, _run_hf(model, tok, TEXTS[1]).logits[0].softmax(-1), atol=1e-6)
    # a cross-encoder (one label) scores pairs
    one = save_modernbert("ForSequenceClassification", tmp_path / "x", minilm_path, num_labels=1,
                          classifier_pooling=pooling)  # fmt: skip
    model1, tok1 = _hf(one, "ForSequenceClassification")
    llm1 = LLM(str(one), dtype="float32")
    got = llm1.score("what is flutter?", ["flutter is an aeroelastic instability", "a"], use_tqdm=False)
    for doc, s in zip(["flutter is an aeroelastic instability", "a"], got):
        enc = tok1("what is flutter?", doc, return_tensors="pt")
        with torch.no_grad():
            want = torch.sigmoid(model1(**enc).logits[0, 0]).item()
        assert s.outputs.score == pytest.approx(want, abs=1e-5)


def test_token_classifier_matches_transformers(tmp_path, minilm_path):
    folder = save_modernbert("ForTokenClassification", tmp_path / "t", minilm_path, num_labels=5)
    model, tok = _hf(folder, "ForTokenClassification")
    llm = LLM(str(folder), dtype="float32")
    for text, o in zip(TEXTS, llm.token_classify(TEXTS, PoolingParams(use_activation=False), use_tqdm=False)):
        ref = _run_hf(model, tok, text).logits[0]
        assert o.outputs.data.shape == ref.shape and (o.outputs.data - ref).abs().max() <= 1e-5


def test_masked_lm_matches_transformers(tmp_path, minilm_path):
    folder = save_modernbert("ForMaskedLM", tmp_path / "mlm", minilm_path)
    model, tok = _hf(folder, "ForMaskedLM")
    llm = LLM(str(folder), dtype="float32")
    assert set(llm.supported_tasks) >= {"token_classify", "embed_sparse"}
    for text, o in zip(TEXTS[:3], llm.token_classify(TEXTS[:3], PoolingParams(use_activation=False), use_tqdm=False)):
        ref = _run_hf(model, tok, text).logits[0]
        assert (o.outputs.data - ref).abs().max() <= 1e-4
    # SPLADE on a ModernBERT masked LM: log(1 + relu(logits)) max-pooled
    sparse = llm.embed_sparse(TEXTS[1], use_tqdm=False)[0].outputs.data
    ref = torch.log1p(torch.relu(_run_hf(model, tok, TEXTS[1]).logits[0])).amax(0)
    assert torch.allclose(sparse, ref, rtol=1e-4, atol=1e-5)


def test_sentence_transformers_layout(tmp_path, bare):
    """modernbert-embed / gte-modernbert shape: Transformer + mean Pooling + Normalize."""
    from sentence_transformers import SentenceTransformer, models

    st = SentenceTransformer(
        modules=[models.Transformer(str(bare)), models.Pooling(64, "mean"), models.Normalize()], device="cpu"
    )
    folder = tmp_path / "st"
    st.save(str(folder))
    llm = LLM(str(folder), dtype="float32")
    got = torch.stack([o.outputs.data for o in llm.embed(TEXTS, use_tqdm=False)])
    want = torch.from_numpy(st.encode(TEXTS))
    assert cosine_rows(got, want).min() >= 0.9999


def test_pylate_colbert_layout(tmp_path, bare):
    """GTE-ModernColBERT shape: PyLate's query/document recipe, skiplist and MaxSim on a ModernBERT trunk."""
    from pylate import scores

    model, folder = save_pylate(bare, tmp_path / "colbert", 64, 16, query_length=12, document_length=48)
    llm = LLM(str(folder), dtype="float32")
    assert llm.model_config.colbert is not None and llm.model_config.colbert.layout == "pylate"
    docs = llm.token_embed(TEXTS[1:3], PoolingParams(input_type="document"), use_tqdm=False)
    ref_docs = [torch.as_tensor(d) for d in model.encode(TEXTS[1:3], is_query=False)]
    for o, r in zip(docs, ref_docs):
        r = torch.as_tensor(r)
        assert o.outputs.data.shape == r.shape and cosine_rows(o.outputs.data, r).min() >= 0.9999
    queries = llm.token_embed(["what is flutter?"], PoolingParams(input_type="query"), use_tqdm=False)
    ref_q = torch.as_tensor(model.encode(["what is flutter?"], is_query=True)[0])
    assert cosine_rows(queries[0].outputs.data[: ref_q.shape[0]], ref_q).min() >= 0.9999
    # MaxSim over the expanded query as polyvec scores it, against PyLate's scoring function
    got = llm.score("what is flutter?", TEXTS[1:3], use_tqdm=False)
    padded = torch.nn.utils.rnn.pad_sequence([o.outputs.data for o in docs], batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(o.outputs.data)) for o in docs], batch_first=True)
    want = scores.colbert_scores(queries[0].outputs.data[None], padded, documents_mask=mask)[0]
    for s, w in zip(got, want):
        assert s.outputs.score == pytest.approx(float(w), rel=1e-4)


def test_served_over_http(bare):
    from tests.entrypoints.server.conftest import Server

    llm = LLM(str(bare), dtype="float32")
    s = Server(str(bare))
    try:
        body = s.post("/v1/embeddings", {"input": TEXTS[:2]}).json()
        for item, o in zip(body["data"], llm.embed(TEXTS[:2], use_tqdm=False)):
            assert cosine_rows(torch.tensor(item["embedding"]), o.outputs.data).item() >= 0.99999
    finally:
        s.stop()


@pytest.mark.parametrize("trunk", ["ModernBert", "Bert"])
def test_vllm_colbert_layout(tmp_path, bare, minilm_path, trunk):
    """vLLM's ColBERTModernBertModel / ColBERTModel: the trunk's checkpoint with `linear.weight` beside it and
    `colbert_dim` in config.json; every token, normalized, no query/document recipe; MaxSim scores."""
    import transformers
    from safetensors.torch import load_file, save_file

    src = bare if trunk == "ModernBert" else minilm_path
    folder = tmp_path / "vllm-colbert"
    folder.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        shutil.copy(src / name, folder / name)
    hidden = json.loads((src / "config.json").read_text())["hidden_size"]
    torch.manual_seed(1)
    proj = torch.randn(24, hidden) / hidden**0.5
    state = load_file(str(folder / "model.safetensors"))
    save_file({**state, "linear.weight": proj}, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    arch = "ColBERTModernBertModel" if trunk == "ModernBert" else "ColBERTModel"
    (folder / "config.json").write_text(json.dumps({**config, "architectures": [arch]}))
    # no size in config.json: the projection's own, as vLLM reads it (it was refused)
    unsized = LLM(str(folder), dtype="float32")
    assert (
        unsized.model_config.token_dim == 24 and unsized.token_embed("a", use_tqdm=False)[0].outputs.data.shape[1] == 24
    )
    (folder / "config.json").write_text(json.dumps({**config, "architectures": [arch], "colbert_dim": 24}))
    llm = LLM(str(folder), dtype="float32")
    assert llm.engine.is_late_interaction and llm.supported_tasks == ("token_embed",)
    model = getattr(transformers, f"{trunk}Model").from_pretrained(str(src)).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    texts = TEXTS[:3]
    for input_type in ("query", "document"):
        outs = llm.token_embed(texts, PoolingParams(input_type=input_type), use_tqdm=False)
        for text, o in zip(texts, outs):
            enc = tok(text, return_tensors="pt")
            assert o.prompt_token_ids == enc["input_ids"][0].tolist()  # no markers, no expansion
            with torch.no_grad():
                ref = torch.nn.functional.normalize(model(**enc).last_hidden_state[0] @ proj.T, dim=-1)
            assert cosine_rows(o.outputs.data, ref).min() >= 0.9999
    q = llm.token_embed("what is flutter?", use_tqdm=False)[0].outputs.data
    d = llm.token_embed(texts[1], use_tqdm=False)[0].outputs.data
    score = llm.score("what is flutter?", texts[1], use_tqdm=False)[0].outputs.score
    assert score == pytest.approx((q @ d.T).amax(1).sum().item(), rel=1e-5)


def test_local_layers_in_segments_equal_whole_sequences(bare, monkeypatch):
    """Long sequences attend in the local layers segment by segment (each with its window's keys on either
    side): the same hidden states as attending over the whole sequence with the window mask."""
    from polyvec.models import modernbert

    llm = LLM(str(bare), dtype="float32")
    texts = [" ".join(f"w{i}" for i in range(n)) for n in (30, 200, 45)] + TEXTS
    monkeypatch.setattr(modernbert, "SEGMENT_QUERIES", 16)  # ±8 window: sequences over 64 tokens are cut
    calls = []
    plan = modernbert.LocalSegments.plan
    monkeypatch.setattr(modernbert.LocalSegments, "plan", lambda *a: calls.append(r := plan(*a)) or r)
    cut = llm.token_embed(texts, PoolingParams(use_activation=False), use_tqdm=False)
    assert calls and calls[0] is not None and len(calls[0].cu_seqlens) > len(texts) + 10
    monkeypatch.setattr(modernbert.LocalSegments, "plan", lambda *a: None)
    whole = llm.token_embed(texts, PoolingParams(use_activation=False), use_tqdm=False)
    for a, b in zip(cut, whole):
        assert (a.outputs.data - b.outputs.data).abs().max() <= 1e-5
