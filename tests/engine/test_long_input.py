"""Encoder input longer than max_model_len (all-MiniLM-L6-v2, 256 tokens): truncation by default, an error
naming the limit and the option with truncation="error", and windows when asked (long_input="window")."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from polyvec import LLM, PoolingParams


@pytest.fixture(scope="module")
def long_doc(cranfield_texts) -> str:
    text, k = "", 0
    while len(text.split()) < 2600:  # ~3,000 word pieces
        text += " " + cranfield_texts[k % len(cranfield_texts)]
        k += 1
    return text.strip()


def windows_of(ids: list[int], limit: int, overlap: int) -> tuple[list[list[int]], list[int]]:
    """The documented split: [CLS] + content[s : s + W] + [SEP], W = limit - 2, s_k = k (W - overlap)."""
    body, width = ids[1:-1], limit - 2
    stride = width - overlap
    starts = [0]
    while starts[-1] + width < len(body):
        starts.append(starts[-1] + stride)
    return [ids[:1] + body[s : s + width] + ids[-1:] for s in starts], starts


def test_default_truncates_and_reports_tokens_used(minilm_llm, long_doc):
    (out,) = minilm_llm.embed([long_doc], use_tqdm=False)
    assert len(out.prompt_token_ids) == 256
    assert out.num_input_tokens > 2900


def test_error_mode_names_the_limit_and_the_option(minilm_path, long_doc):
    llm = LLM(str(minilm_path), dtype="float32", truncation="error")
    with pytest.raises(ValueError, match=r"256 tokens.*long_input='window'"):
        llm.embed([long_doc], use_tqdm=False)
    (out,) = llm.embed([long_doc], PoolingParams(long_input="window"), use_tqdm=False)  # opt-in per request
    assert len(out.prompt_token_ids) > 2900


def test_embed_windows_are_the_token_weighted_mean(minilm_llm, long_doc):
    ids = minilm_llm.get_tokenizer().encode(long_doc)
    assert len(ids) > 2900
    (out,) = minilm_llm.embed([long_doc, "a short text"], PoolingParams(long_input="window"), use_tqdm=False)[:1]
    windows, _ = windows_of(ids, 256, 0)
    raw = minilm_llm.embed(
        [{"prompt_token_ids": w} for w in windows], PoolingParams(use_activation=False), use_tqdm=False
    )
    weights = torch.tensor([float(len(w)) for w in windows])
    expected = F.normalize(
        (torch.stack([r.outputs.data for r in raw]) * weights[:, None]).sum(0) / weights.sum(), dim=0
    )
    assert out.outputs.data.shape == (384,)
    assert abs(out.outputs.data.norm().item() - 1) < 1e-5
    assert torch.allclose(out.outputs.data, expected, atol=1e-6)
    assert out.prompt_token_ids == ids and len(windows) == -(-(len(ids) - 2) // 254)


@pytest.mark.parametrize("overlap", [0, 32])
def test_token_embed_windows_return_one_vector_per_token(minilm_llm, long_doc, overlap):
    ids = minilm_llm.get_tokenizer().encode(long_doc)
    (out,) = minilm_llm.token_embed(
        [long_doc], PoolingParams(long_input="window", window_overlap=overlap), use_tqdm=False
    )
    assert out.outputs.data.shape == (len(ids), 384)
    windows, starts = windows_of(ids, 256, overlap)
    per_window = [
        o.outputs.data for o in minilm_llm.token_embed([{"prompt_token_ids": w} for w in windows], use_tqdm=False)
    ]
    # Content token t comes from the window where it is farthest from an edge.
    keep_from = [0] + [s + overlap // 2 for s in starts[1:]]
    keep_to = keep_from[1:] + [len(ids) - 2]
    expected = [per_window[0][:1]]
    for k, s in enumerate(starts):
        expected.append(per_window[k][1 + keep_from[k] - s : 1 + keep_to[k] - s])
    expected.append(per_window[-1][-1:])
    assert torch.allclose(out.outputs.data, torch.cat(expected), atol=1e-6)
    # The first tokens equal those of the truncated input (the first window is the truncated input).
    (trunc,) = minilm_llm.token_embed([long_doc], use_tqdm=False)
    n = 1 + (keep_to[0] if len(starts) > 1 else 254)
    assert torch.allclose(out.outputs.data[:n], trunc.outputs.data[:n], atol=1e-6)


def test_engine_wide_window_setting_and_short_inputs_unchanged(minilm_path, long_doc):
    llm = LLM(str(minilm_path), dtype="float32", long_input="window", window_overlap=16)
    short, long_ = llm.embed(["a short text", long_doc], use_tqdm=False)
    plain = LLM(str(minilm_path), dtype="float32").embed(["a short text"], use_tqdm=False)[0]
    assert torch.allclose(short.outputs.data, plain.outputs.data, atol=1e-6)
    assert len(long_.prompt_token_ids) > 2900
    (trunc,) = llm.embed([long_doc], PoolingParams(long_input="truncate"), use_tqdm=False)  # per-request override
    assert len(trunc.prompt_token_ids) == 256


def test_bad_window_options(minilm_llm, long_doc):
    with pytest.raises(ValueError, match="window_overlap"):
        minilm_llm.embed([long_doc], PoolingParams(long_input="window", window_overlap=200), use_tqdm=False)
    with pytest.raises(ValueError, match="long_input"):
        minilm_llm.embed([long_doc], PoolingParams(long_input="sliding"), use_tqdm=False)


def test_windows_refuse_step_pooling(minilm_llm, long_doc):
    with pytest.raises(ValueError, match="STEP"):
        minilm_llm.token_embed([long_doc], PoolingParams(long_input="window", step_tag_id=1012), use_tqdm=False)
