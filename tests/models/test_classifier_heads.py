"""Classifier heads as vLLM 0.34 and transformers read them: regression problems, a decoder score layer's bias,
and the activation of the columns a process-reward request picks."""

from __future__ import annotations

import pytest
import torch

from polyvec import LLM, PoolingParams
from tests.helpers import TINY, save_tiny_model


def _classifier(folder, minilm_path, head: str, **config):
    import transformers

    save_tiny_model(head, "BertConfig", folder, minilm_path, **config, **TINY)
    model = getattr(transformers, f"Auto{head.replace('Bert', 'Model')}").from_pretrained(str(folder)).eval()
    return model, transformers.AutoTokenizer.from_pretrained(str(folder))


def test_a_one_label_regression_model_returns_its_logit(tmp_path, minilm_path):
    """problem_type regression wins over the one-label sigmoid, as in vLLM's activation rule and transformers'
    pipeline (a sigmoid squeezed every score to ~0.5)."""
    model, tok = _classifier(tmp_path, minilm_path, "BertForSequenceClassification", num_labels=1,
                             problem_type="regression")  # fmt: skip
    texts = ["a wing stalls", "heat transfer in a boundary layer"]
    llm = LLM(str(tmp_path), dtype="float32")
    assert llm.model_config.classifier_activation == "identity"
    with torch.no_grad():
        want = model(**tok(texts, return_tensors="pt", padding=True)).logits
    got = torch.stack([o.outputs.data for o in llm.classify(texts, use_tqdm=False)])
    assert torch.allclose(got, want, atol=1e-5)


def test_returned_token_ids_are_activated_over_the_picked_columns(tmp_path, minilm_path):
    """vLLM's STEP pooling picks the columns, then the activation runs over them: a softmax of the two columns
    (rows summed to 0.44: a softmax of all five, then two kept), a sigmoid of a single one."""
    model, tok = _classifier(tmp_path, minilm_path, "BertForTokenClassification", num_labels=5)
    text = "great wing . terrible drag ."
    enc = tok(text, return_tensors="pt")
    with torch.no_grad():
        logits = model(**enc).logits[0]
    ids, step = enc["input_ids"][0], int(tok.convert_tokens_to_ids("."))
    llm = LLM(str(tmp_path), dtype="float32")
    params = PoolingParams(step_tag_id=step, returned_token_ids=[0, 1])
    got = llm.encode(text, params, pooling_task="token_classify", use_tqdm=False)[0].outputs.data
    assert torch.allclose(got, logits[ids == step][:, [0, 1]].softmax(-1), atol=1e-6)
    one = llm.encode(text, PoolingParams(returned_token_ids=[3]), pooling_task="token_classify", use_tqdm=False)[0]
    assert torch.allclose(one.outputs.data, logits[:, [3]].sigmoid(), atol=1e-6)
    raw = PoolingParams(returned_token_ids=[0, 1], use_activation=False)
    plain = llm.encode(text, raw, pooling_task="token_classify", use_tqdm=False)[0].outputs.data
    assert torch.allclose(plain, logits[:, [0, 1]], atol=1e-5)
    every = llm.encode(text, pooling_task="token_classify", use_tqdm=False)[0].outputs.data  # no columns picked
    assert torch.allclose(every, logits.softmax(-1), atol=1e-6)


@pytest.mark.parametrize("with_bias", [True, False])
def test_a_decoder_score_layer_keeps_its_bias(tmp_path, minilm_path, with_bias):
    """A decoder *ForSequenceClassification checkpoint with score.bias: vLLM adds it (it was dropped without a
    word); one without stays as transformers computes it."""
    from safetensors.torch import load_file, save_file

    from tests.models.test_decoder_parity import save_decoder

    model = save_decoder("qwen2", "ForSequenceClassification", tmp_path, minilm_path, num_labels=2)
    bias = torch.tensor([5.0, -5.0]) if with_bias else torch.zeros(2)
    if with_bias:
        state = load_file(tmp_path / "model.safetensors")
        save_file({**state, "score.bias": bias}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ids = [101, 2000, 3000, 4000, 102]
    with torch.no_grad():
        want = model(input_ids=torch.tensor([ids])).logits[0] + bias
    llm = LLM(str(tmp_path), dtype="float32")
    got = llm.classify([{"prompt_token_ids": ids}], PoolingParams(use_activation=False), use_tqdm=False)[0]
    assert torch.allclose(got.outputs.data, want, atol=1e-5)


def test_a_text_cut_below_the_special_tokens_ignores_the_pairs_beside_it(tmp_path, minilm_path):
    """truncate_prompt_tokens=2 on a single text keeps [CLS] [SEP] whether or not a text pair shares the call (the
    pair's three special tokens decided the path of every text in the call: [CLS] and the first word)."""
    _classifier(tmp_path, minilm_path, "BertForSequenceClassification", num_labels=1)
    llm = LLM(str(tmp_path), dtype="float32")
    kwargs = {"pooling_task": "classify", "tokenization_kwargs": {"truncate_prompt_tokens": 2}, "use_tqdm": False}
    alone = llm.encode(["hello world again"], **kwargs)[0]
    beside = llm.encode([("q q", "d d"), "hello world again"], **kwargs)[1]
    assert alone.prompt_token_ids == beside.prompt_token_ids == [101, 102]
    assert torch.equal(alone.outputs.data, beside.outputs.data)
