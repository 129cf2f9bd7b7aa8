"""bge-m3's three outputs (dense, sparse, multi-vector) against FlagEmbedding's BGEM3FlagModel, on a small
random XLM-RoBERTa with seeded heads saved in bge-m3's layout (colbert_linear.pt, sparse_linear.pt)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from polyvec import LLM, PoolingParams
from polyvec.scoring import colbert_score, lexical_matching_score
from tests.helpers import TINY, cosine_rows, save_tiny_model

TEXTS = [
    "the wing stalls at high angle of attack",
    "heat transfer in laminar boundary layers with suction and blowing at the wall",
    "shock",
    "what similarity laws must be obeyed when constructing aeroelastic models of heated high speed aircraft?",
]


@pytest.fixture(scope="module")
def m3_folder(tmp_path_factory, minilm_path):
    folder = tmp_path_factory.mktemp("bge-m3")
    cfg = dict(TINY, pad_token_id=1, type_vocab_size=1, max_position_embeddings=130)
    save_tiny_model("XLMRobertaModel", "XLMRobertaConfig", folder, minilm_path, **cfg)
    # XLM-R's special-token roles on MiniLM's vocabulary: [SEP] is the eos token, as </s> is in bge-m3
    special = {"cls_token": "[CLS]", "sep_token": "[SEP]", "eos_token": "[SEP]", "pad_token": "[PAD]"}
    special |= {"unk_token": "[UNK]", "mask_token": "[MASK]", "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(special))
    torch.manual_seed(1)
    torch.save(torch.nn.Linear(32, 32).state_dict(), folder / "colbert_linear.pt")
    torch.save(torch.nn.Linear(32, 1).state_dict(), folder / "sparse_linear.pt")
    return folder


@pytest.fixture(scope="module")
def reference(m3_folder):
    from FlagEmbedding import BGEM3FlagModel

    model = BGEM3FlagModel(str(m3_folder), use_fp16=False, devices="cpu")
    out = model.encode(TEXTS, return_dense=True, return_sparse=True, return_colbert_vecs=True, max_length=128)
    return model, out


def test_three_outputs_equal_flagembedding(m3_folder, reference):
    _, ref = reference
    llm = LLM(str(m3_folder), dtype="float32")
    assert set(llm.supported_tasks) == {"embed", "token_embed", "embed_sparse", "token_classify"}
    dense = torch.stack([o.outputs.data for o in llm.embed(TEXTS, use_tqdm=False)])
    assert cosine_rows(dense, torch.tensor(np.asarray(ref["dense_vecs"]))).min() >= 0.9999
    for o, want in zip(llm.token_embed(TEXTS, use_tqdm=False), ref["colbert_vecs"]):
        want = torch.tensor(np.asarray(want))
        assert o.outputs.data.shape == want.shape  # every token but the first
        assert cosine_rows(o.outputs.data, want).min() >= 0.9999
    for o, want in zip(llm.embed_sparse(TEXTS, use_tqdm=False), ref["lexical_weights"]):
        got = dict(zip(o.outputs.indices, o.outputs.values))
        assert set(got) == {int(k) for k in want}
        for k, w in want.items():
            assert abs(got[int(k)] - float(w)) <= 1e-5


def test_token_classify_is_vllms_per_token_sparse_weights(m3_folder, reference):
    """vLLM 0.34's BgeM3EmbeddingModel serves the sparse head per token under token_classify: relu(sparse_linear
    (h)) for each token, a leading BOS and trailing EOS (config.json's ids) left out; its clients max-merge
    the weights by token id into FlagEmbedding's lexical weights."""
    import transformers

    _, ref = reference
    llm = LLM(str(m3_folder), dtype="float32")
    trunk = transformers.AutoModel.from_pretrained(m3_folder).eval()
    sparse = torch.nn.Linear(32, 1)
    sparse.load_state_dict(torch.load(m3_folder / "sparse_linear.pt"))
    bos, eos = trunk.config.bos_token_id, trunk.config.eos_token_id
    ids = [bos, 7592, 2088, 7592, eos]  # XLM-R's <s> ... </s> ids, as a real bge-m3 tokenizer writes them
    got = llm.token_classify([{"prompt_token_ids": ids}], use_tqdm=False)[0].outputs.data
    raw = llm.token_classify([{"prompt_token_ids": ids}], PoolingParams(use_activation=False), use_tqdm=False)
    with torch.no_grad():
        logits = sparse(trunk(input_ids=torch.tensor([ids])).last_hidden_state[0]).squeeze(-1)
    assert got.shape == (3,) and torch.allclose(got, torch.relu(logits)[1:-1], atol=1e-5)
    assert torch.allclose(raw[0].outputs.data, logits[1:-1], atol=1e-5)
    # this tokenizer's [CLS]/[SEP] are not config.json's BOS/EOS: every token kept, max-merged = lexical weights
    for o, lexical in zip(llm.token_classify(TEXTS, use_tqdm=False), ref["lexical_weights"]):
        merged: dict[int, float] = {}
        for t, w in zip(o.prompt_token_ids, o.outputs.data.tolist()):
            if t not in (101, 102, 0, 100) and w > 0:  # FlagEmbedding leaves out cls, eos, pad, unk
                merged[t] = max(w, merged.get(t, 0.0))
        assert set(merged) == {int(k) for k in lexical}
        assert all(abs(merged[int(k)] - float(v)) <= 1e-5 for k, v in lexical.items())
    with pytest.raises(ValueError, match="does not apply to bge-m3's token_classify"):
        llm.token_classify(TEXTS[:1], PoolingParams(long_input="window"), use_tqdm=False)


def test_scores_as_flagembedding_defines_them(m3_folder, reference):
    model, ref = reference
    llm = LLM(str(m3_folder), dtype="float32")
    sparse = llm.embed_sparse(TEXTS, use_tqdm=False)
    vecs = llm.token_embed(TEXTS, use_tqdm=False)
    for i in range(len(TEXTS)):
        for j in range(len(TEXTS)):
            want = model.compute_lexical_matching_score(ref["lexical_weights"][i], ref["lexical_weights"][j])
            got = lexical_matching_score(sparse[i].outputs, sparse[j].outputs)
            assert abs(got - float(want)) <= 1e-4
            want = float(model.colbert_score(ref["colbert_vecs"][i], ref["colbert_vecs"][j]))
            assert abs(colbert_score(vecs[i].outputs.data, vecs[j].outputs.data) - want) <= 1e-4


def test_combined_score(m3_folder, reference):
    from polyvec.scoring import bge_m3_score

    model, _ = reference
    llm = LLM(str(m3_folder), dtype="float32")
    q, d = TEXTS[0], TEXTS[3]
    want = model.compute_score([(q, d)], weights_for_different_modes=[0.4, 0.2, 0.4], max_passage_length=128)
    dense = float(llm.embed(q, use_tqdm=False)[0].outputs.data @ llm.embed(d, use_tqdm=False)[0].outputs.data)
    sparse = lexical_matching_score(*(o.outputs for o in llm.embed_sparse([q, d], use_tqdm=False)))
    colbert = colbert_score(*(o.outputs.data for o in llm.token_embed([q, d], use_tqdm=False)))
    for key, got in [("dense", dense), ("sparse", sparse), ("colbert", colbert)]:
        assert abs(got - float(np.asarray(want[key]).ravel()[0])) <= 1e-4, key
    combined = float(np.asarray(want["colbert+sparse+dense"]).ravel()[0])
    assert abs(bge_m3_score(dense, sparse, colbert) - combined) <= 1e-4


def test_three_outputs_from_one_pass_equal_single_tasks(m3_folder):
    """Several tasks in one call: one forward pass per prompt, every head on the same hidden states; each entry
    equals the single-task result."""
    llm = LLM(str(m3_folder), dtype="float32")
    tasks = ["embed", "embed_sparse", "token_embed"]
    multi = llm.encode(TEXTS, pooling_task=tasks, use_tqdm=False)
    assert llm.engine.stats.num_batched_tokens  # the one pass ran
    before = llm.engine.stats.num_batched_tokens
    singles = {
        "embed": llm.embed(TEXTS, use_tqdm=False),
        "embed_sparse": llm.embed_sparse(TEXTS, use_tqdm=False),
        "token_embed": llm.token_embed(TEXTS, use_tqdm=False),
    }
    per_task = (llm.engine.stats.num_batched_tokens - before) // 3
    assert per_task == sum(len(o.prompt_token_ids) for o in multi)  # the list cost one pass, each single one
    for i, o in enumerate(multi):
        assert o.task == "embed+embed_sparse+token_embed" and list(o.outputs.data) == tasks
        for task in tasks:
            assert torch.equal(o.outputs.data[task], singles[task][i].outputs.data), task
    with pytest.raises(ValueError, match="without repeats"):
        llm.encode(TEXTS, pooling_task=["embed", "embed"], use_tqdm=False)


def test_options_of_some_tasks_leave_the_others_alone(m3_folder):
    """dimensions (the full size here), normalize=False and use_activation=False apply to the dense tasks of a
    list and leave embed_sparse alone, as its sparse options leave the dense ones (they refused the whole
    request); an option that fits none of the tasks is still refused."""
    llm = LLM(str(m3_folder), dtype="float32")
    tasks = ["embed_sparse", "embed", "token_embed"]
    sparse = llm.embed_sparse(TEXTS, use_tqdm=False)
    for options in ({"dimensions": 32}, {"normalize": False}, {"use_activation": False}):
        multi = llm.encode(TEXTS, PoolingParams(**options), pooling_task=tasks, use_tqdm=False)
        dense = {t: llm.encode(TEXTS, PoolingParams(**options), pooling_task=t, use_tqdm=False) for t in tasks[1:]}
        for i, o in enumerate(multi):
            assert torch.equal(o.outputs.data["embed_sparse"], sparse[i].outputs.data), options
            for task in tasks[1:]:
                assert torch.equal(o.outputs.data[task], dense[task][i].outputs.data), (options, task)
    with pytest.raises(ValueError, match="dimensions is only valid for the embed and token_embed tasks"):
        llm.encode(TEXTS, PoolingParams(dimensions=32), pooling_task=["embed_sparse", "token_classify"], use_tqdm=False)
    with pytest.raises(ValueError, match="activation is only valid for the classify, token_classify tasks"):
        llm.encode(TEXTS, PoolingParams(activation=False), pooling_task=["embed", "token_embed"], use_tqdm=False)
    with pytest.raises(ValueError, match="Unsupported task: 'classify'"):
        llm.encode(TEXTS, pooling_task=["embed", "classify"], use_tqdm=False)


def test_long_input_windows_of_token_vectors(m3_folder):
    """long_input="window" on bge-m3's token vectors: every token but the first, in place (each window's
    vectors also leave out its first row: the merge took them one row off, [CLS] included)."""
    llm = LLM(str(m3_folder), dtype="float32")
    text = " ".join(["aeroelastic flutter of a swept wing"] * 40)  # 322 tokens, 128 a window
    whole = llm.token_embed([text], PoolingParams(long_input="window"), use_tqdm=False)[0]
    cut = llm.token_embed([text], use_tqdm=False)[0]  # the first window's tokens, truncated
    assert whole.outputs.data.shape == (len(whole.prompt_token_ids) - 1, 32)
    assert torch.allclose(whole.outputs.data[:60], cut.outputs.data[:60], atol=1e-6)


def test_late_chunking_keeps_the_special_tokens(m3_folder):
    """vLLM 0.34's test_bge_m3_late_chunking_keeps_special_tokens: each chunk is the mean of chunk_size hidden
    rows, the first token's included (bge-m3's token vectors leave it out, which made every request fail on
    misaligned offsets), then the ColBERT projection and normalization; dimensions as for a Matryoshka model."""
    import transformers

    from polyvec import LateChunkingParams

    text = TEXTS[1]
    llm = LLM(str(m3_folder), dtype="float32", hf_overrides={"is_matryoshka": True})
    trunk = transformers.AutoModel.from_pretrained(m3_folder).eval()
    colbert = torch.nn.Linear(32, 32)
    colbert.load_state_dict(torch.load(m3_folder / "colbert_linear.pt"))
    plain = llm.token_embed(text, use_tqdm=False)[0]
    ids = plain.prompt_token_ids
    with torch.no_grad():
        hidden = trunk(torch.tensor([ids])).last_hidden_state[0]
        for size, dims in ((1, None), (3, None), (5, 16), (128, None)):
            means = torch.stack([part.mean(0) for part in hidden.split(size)])
            want = torch.nn.functional.normalize(colbert(means)[:, :dims], dim=-1)
            params = PoolingParams(late_chunking_params=LateChunkingParams(size), dimensions=dims)
            out = llm.token_embed(text, params, use_tqdm=False)[0]
            assert out.outputs.data.shape == want.shape and cosine_rows(out.outputs.data, want).min() >= 0.9999
            assert out.late_chunking.input_tokens == len(ids) and out.late_chunking.chunks[0].token_range[0] == 0
        # one-token chunks without normalization are the projected rows, the first token's before the others
        rows = llm.token_embed(text, PoolingParams(use_activation=False, late_chunking_params=LateChunkingParams(1)),
                               use_tqdm=False)[0].outputs.data  # fmt: skip
        assert torch.allclose(rows, colbert(hidden), atol=1e-5)
        assert torch.allclose(torch.nn.functional.normalize(rows[1:], dim=-1), plain.outputs.data, atol=1e-5)


def test_token_vectors_drop_only_a_leading_cls(m3_folder):
    """vLLM's BOS filter: bge-m3 leaves out the first token's vector only where it is <s> (its cls token); an
    input of token ids without it keeps every token (its first was dropped), and split into windows gives the
    same rows (129 rows for 320 tokens: the windows were misaligned)."""
    llm = LLM(str(m3_folder), dtype="float32")
    ids = [7592, 2088, 1997, 1037] * 80  # 320 content tokens, no [CLS] / [SEP]; windows of 128
    head = [{"prompt_token_ids": ids[:100]}]
    assert llm.token_embed(head, use_tqdm=False)[0].outputs.data.shape == (100, 32)
    cls = llm.token_embed([{"prompt_token_ids": [101, *ids[:100]]}], use_tqdm=False)[0].outputs.data
    assert cls.shape == (100, 32)
    whole = llm.token_embed([{"prompt_token_ids": ids}], PoolingParams(long_input="window"), use_tqdm=False)[0]
    alone = llm.token_embed(head, use_tqdm=False)[0].outputs.data
    assert whole.outputs.data.shape == (320, 32) and cosine_rows(whole.outputs.data[:60], alone[:60]).min() >= 0.9999
    # a [CLS] id inside the text that starts a window is a content token there too (319 rows, shifted, before)
    inner = [*ids[:128], 101, *ids[129:]]
    windows = llm.token_embed([{"prompt_token_ids": inner}], PoolingParams(long_input="window"), use_tqdm=False)[0]
    assert windows.outputs.data.shape == (320, 32)
    assert cosine_rows(windows.outputs.data[:60], whole.outputs.data[:60]).min() >= 0.9999
