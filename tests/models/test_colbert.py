"""ColBERT (late interaction) on the real all-MiniLM-L6-v2 weights with a seeded projection.

PyLate layout: the model is built with PyLate (it adds the [Q]/[D] marker tokens and resizes the embeddings)
and written in PyLate's on-disk layout. PyLate 1.6 pins sentence-transformers 5.3; with the 6.x installed
here its `save`, its ST-Dense conversion and its query expansion are broken, so the test (1) builds the model
from explicit modules and writes the folder itself, and (2) uses PyLate's `encode` as the reference for
documents and for the attended query tokens, and a step-by-step transformers reference (the documented
recipe) for the full expanded query. Stanford layout: the same weights as an HF_ColBERT checkpoint with
artifact.metadata, checked against the transformers reference.
"""

from __future__ import annotations

import json
import shutil
import string

import pytest
import torch
import torch.nn.functional as F

from polyvec import LLM, PoolingParams
from tests.helpers import cosine_rows

QUERIES = ["what is the slipstream effect on a wing?", "flutter"]
DOCS = [
    "experimental investigation of the aerodynamics of a wing in a slipstream. an experimental study, "
    "of a wing (in a propeller slipstream) was made!",
    "heat transfer " * 40,
    "wings.",
]


def reference_encode(bert, proj: torch.Tensor, ids: list[int], n_attended: int) -> torch.Tensor:
    """The recipe step by step with transformers: BERT with the expansion tokens masked as keys, projection,
    per-token L2 normalization."""
    mask = torch.zeros(1, len(ids), dtype=torch.long)
    mask[0, :n_attended] = 1
    with torch.no_grad():
        hidden = bert(input_ids=torch.tensor([ids]), attention_mask=mask).last_hidden_state[0]
    return F.normalize(hidden @ proj.T, dim=-1)


def test_pylate_layout_matches_pylate(pylate_model):
    model, folder = pylate_model
    llm = LLM(str(folder), dtype="float32")
    assert llm.supported_tasks == ("token_embed",) and llm.model_config.colbert.layout == "pylate"
    ref_docs = model.encode(DOCS, is_query=False)
    docs = llm.token_embed(DOCS, PoolingParams(input_type="document"), use_tqdm=False)
    for r, o in zip(ref_docs, docs):
        r = torch.as_tensor(r)
        assert o.input_type == "document" and o.outputs.data.shape == r.shape  # skiplist tokens dropped
        assert cosine_rows(o.outputs.data, r).min() >= 0.9999
    assert docs[0].outputs.data.shape[0] < len(docs[0].prompt_token_ids)  # punctuation removed
    assert len(docs[1].prompt_token_ids) == 64  # truncated to document_length, marker included
    # No input_type: a ColBERT model encodes documents.
    default = llm.token_embed(DOCS[:1], use_tqdm=False)[0]
    assert default.input_type == "document"
    assert (default.outputs.data - docs[0].outputs.data).abs().max() <= 1e-5

    queries = llm.token_embed(QUERIES, PoolingParams(input_type="query"), use_tqdm=False)
    for q, r in zip(queries, model.encode(QUERIES, is_query=True)):
        r = torch.as_tensor(r)  # PyLate (under ST 6) returns only the attended tokens
        assert q.input_type == "query" and q.outputs.data.shape == (24, 96)
        assert q.prompt_token_ids[1] == model.query_prefix_id and q.prompt_token_ids[-1] == 103  # [MASK]
        assert cosine_rows(q.outputs.data[: r.shape[0]], r).min() >= 0.9999


def test_expanded_query_matches_reference(pylate_model):
    import transformers

    model, folder = pylate_model
    bert = transformers.AutoModel.from_pretrained(str(folder)).eval()
    proj = model[1].linear.weight.detach()
    llm = LLM(str(folder), dtype="float32")
    for q in llm.token_embed(QUERIES, PoolingParams(input_type="query"), use_tqdm=False):
        ids = q.prompt_token_ids
        n_attended = len(ids) - sum(1 for t in ids if t == 103)
        ref = reference_encode(bert, proj, ids, n_attended)
        assert cosine_rows(q.outputs.data, ref).min() >= 0.9999
        # The expansion tokens are computed but not attended to: attending to them changes the result.
        attended = reference_encode(bert, proj, ids, len(ids))
        assert cosine_rows(q.outputs.data, attended).min() < 0.9999


def test_maxsim_scores_match_pylate(pylate_model):
    from pylate import scores

    model, folder = pylate_model
    llm = LLM(str(folder), dtype="float32")
    q = [o.outputs.data for o in llm.token_embed(QUERIES, PoolingParams(input_type="query"), use_tqdm=False)]
    d = [o.outputs.data for o in llm.token_embed(DOCS, PoolingParams(input_type="document"), use_tqdm=False)]
    padded = torch.nn.utils.rnn.pad_sequence(d, batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(x)) for x in d], batch_first=True)
    ref = scores.colbert_scores(torch.stack(q), padded, documents_mask=mask)  # [n_queries, n_docs]
    one_n = torch.tensor([o.outputs.score for o in llm.score(QUERIES[0], DOCS, use_tqdm=False)])
    assert torch.allclose(one_n, ref[0], rtol=1e-4)
    one_one = llm.score(QUERIES[1], DOCS[2], use_tqdm=False)[0].outputs.score
    assert abs(one_one - ref[1, 2].item()) <= 1e-4 * abs(ref[1, 2].item())
    n_n = torch.tensor([o.outputs.score for o in llm.score(QUERIES, DOCS[:2], use_tqdm=False)])
    assert torch.allclose(n_n, torch.stack([ref[0, 0], ref[1, 1]]), rtol=1e-4)
    # storage codes, MUVERA vectors and late chunks are not what MaxSim reads (int8 codes scored 3e6)
    for params in (PoolingParams(token_encoding="int8"), PoolingParams(muvera={})):
        with pytest.raises(ValueError, match="does not apply to score"):
            llm.score(QUERIES[0], DOCS, pooling_params=params, use_tqdm=False)
    # a cut that leaves no room beside the marker says so (it said "no tokens ... add_special_tokens is off")
    with pytest.raises(ValueError, match="truncate_prompt_tokens=1 leaves no token of it: a ColBERT model's marker"):
        llm.token_embed(DOCS[0], PoolingParams(truncate_prompt_tokens=1), use_tqdm=False)
    # embed() follows the pooling task, as vLLM's: a ColBERT model's token matrices (document mode)
    assert torch.equal(llm.embed(DOCS[:1], use_tqdm=False)[0].outputs.data, d[0])


def test_stanford_layout(pylate_model, tmp_path, minilm_path):
    """An HF_ColBERT checkpoint (bert.* + linear.weight, artifact.metadata) follows the Stanford recipe."""
    import transformers
    from safetensors.torch import load_file, save_file

    torch.manual_seed(1)
    proj = torch.randn(64, 384) * 0.05
    state = {f"bert.{k}": v for k, v in load_file(minilm_path / "model.safetensors").items()}
    state["linear.weight"] = proj
    save_file(state, tmp_path / "model.safetensors")
    cfg = json.loads((minilm_path / "config.json").read_text())
    cfg["architectures"] = ["HF_ColBERT"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shutil.copy(minilm_path / "tokenizer.json", tmp_path)
    (tmp_path / "artifact.metadata").write_text(
        json.dumps(
            {
                "query_token_id": "[unused0]",
                "doc_token_id": "[unused1]",
                "query_maxlen": 16,
                "doc_maxlen": 40,
                "mask_punctuation": True,
                "dim": 64,
                "attend_to_mask_tokens": False,
            }
        )
    )
    llm = LLM(str(tmp_path), dtype="float32")
    cb = llm.model_config.colbert
    assert cb.layout == "stanford" and llm.model_config.token_dim == 64 and llm.model_config.architecture == "BertModel"
    bert = transformers.BertModel(transformers.BertConfig(**{k: v for k, v in cfg.items() if k != "architectures"}))
    bert.load_state_dict({k[5:]: v for k, v in state.items() if k.startswith("bert.")}, strict=False)
    bert.eval()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(minilm_path / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    punct = {tok.token_to_id(c) for c in string.punctuation}
    # Stanford: tokenize ". " + text to maxlen, put the marker where "." was, pad queries with [MASK].
    q = llm.token_embed(QUERIES[0], PoolingParams(input_type="query"), use_tqdm=False)[0]
    ids = tok.encode(". " + QUERIES[0]).ids[:16]
    ids[1] = tok.token_to_id("[unused0]")
    n = len(ids)
    ids = ids + [103] * (16 - n)
    assert q.prompt_token_ids == ids
    assert cosine_rows(q.outputs.data, reference_encode(bert, proj, ids, n)).min() >= 0.9999
    for doc in DOCS[:2]:  # one shorter than doc_maxlen, one truncated to it
        d = llm.token_embed(doc, PoolingParams(input_type="document"), use_tqdm=False)[0]
        ids = tok.encode(". " + doc).ids
        if len(ids) > 40:
            ids = ids[:39] + [ids[-1]]
        ids[1] = tok.token_to_id("[unused1]")
        assert d.prompt_token_ids == ids
        ref = reference_encode(bert, proj, ids, len(ids))[[i for i, t in enumerate(ids) if t not in punct]]
        assert d.outputs.data.shape == ref.shape and cosine_rows(d.outputs.data, ref).min() >= 0.9999


def test_empty_prefixes_and_the_tokenizers_mask_token(tmp_path, minilm_path):
    """PyLate's empty query / document prefix inserts no marker (polyvec refused to load: "'' is not in the
    vocabulary"), and query expansion pads with the tokenizer's own mask token (it looked for "[MASK]" by name,
    even with expansion off)."""
    import transformers

    from tests.helpers import save_pylate

    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors", "tokenizer.json", "vocab.txt"):
        shutil.copy(minilm_path / f, bare)
    special = {"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]"}
    (bare / "tokenizer_config.json").write_text(
        json.dumps({**special, "mask_token": "[unused5]", "do_lower_case": True})
    )
    model, folder = save_pylate(bare, tmp_path / "colbert", 384, 96, 24, 64, query_prefix="", document_prefix="")
    llm = LLM(str(folder), dtype="float32")
    mask = transformers.AutoTokenizer.from_pretrained(str(folder)).mask_token_id
    docs = llm.token_embed(DOCS, PoolingParams(input_type="document"), use_tqdm=False)
    for o, r in zip(docs, model.encode(DOCS, is_query=False)):
        r = torch.as_tensor(r)
        assert o.outputs.data.shape == r.shape and cosine_rows(o.outputs.data, r).min() >= 0.9999
    assert docs[2].prompt_token_ids == model.tokenize([DOCS[2]], is_query=False)["input_ids"][0].tolist()
    for q, r in zip(llm.token_embed(QUERIES, PoolingParams(input_type="query"), use_tqdm=False),
                    model.encode(QUERIES, is_query=True)):  # fmt: skip
        r = torch.as_tensor(r)
        assert q.outputs.data.shape == (24, 96) and q.prompt_token_ids[-1] == mask != 103
        assert cosine_rows(q.outputs.data[: r.shape[0]], r).min() >= 0.9999


def test_vllm_colbert_architecture_on_a_pylate_folder(pylate_model):
    """vLLM's documented way to serve a PyLate checkpoint, hf_overrides architectures ColBERTModel: every token
    through the sentence-transformers Dense projection, normalized, no recipe (it was refused: no dimension in
    config.json, then no linear.weight)."""
    import transformers

    model, folder = pylate_model
    llm = LLM(str(folder), dtype="float32", hf_overrides={"architectures": ["ColBERTModel"]})
    assert llm.model_config.colbert.layout == "vllm" and llm.model_config.token_dim == 96
    bert = transformers.AutoModel.from_pretrained(str(folder)).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    proj = model[1].linear.weight.detach()
    for text, o in zip(DOCS, llm.token_embed(DOCS, use_tqdm=False)):
        ids = o.prompt_token_ids
        assert ids == tok(text)["input_ids"]  # no marker, no skiplist: every token
        assert cosine_rows(o.outputs.data, reference_encode(bert, proj, ids, len(ids))).min() >= 0.9999
    # vLLM's late chunking on it (it was refused for any ColBERT model; PyLate's recipe, which edits the tokens,
    # still is): each chunk the mean of chunk_size hidden rows, then the projection, normalized
    from polyvec import LateChunkingParams

    params = PoolingParams(late_chunking_params=LateChunkingParams(3))
    chunked = llm.token_embed(DOCS[0], params, use_tqdm=False)[0]
    with torch.no_grad():
        hidden = bert(input_ids=torch.tensor([chunked.prompt_token_ids])).last_hidden_state[0]
    want = F.normalize(torch.stack([part.mean(0) for part in hidden.split(3)]) @ proj.T, dim=-1)
    assert chunked.outputs.data.shape == want.shape and cosine_rows(chunked.outputs.data, want).min() >= 0.9999
    with pytest.raises(ValueError, match="Late chunking does not support a ColBERT model's query and document recipe"):
        LLM(str(folder), dtype="float32").token_embed(DOCS[0], params)


def test_prompts_go_before_the_text_as_pylate_puts_them(pylate_model, tmp_path):
    """config_sentence_transformers.json's prompts: the default one before every text (PyLate's encode without
    prompt_name), input_type's before its texts (PyLate's prompt_name); the marker still after [CLS]."""
    model, folder = pylate_model
    shutil.copytree(folder, tmp_path / "m")
    prompts = {"query": "search_query: ", "document": "search_document: "}
    cfg_path = tmp_path / "m" / "config_sentence_transformers.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "prompts": prompts, "default_prompt_name": "document"}))
    llm = LLM(str(tmp_path / "m"), dtype="float32")
    saved = model.prompts, model.default_prompt_name
    model.prompts, model.default_prompt_name = prompts, "document"
    try:
        ref_default = model.encode(DOCS, is_query=False)
        ref_queries = model.encode(QUERIES, is_query=True, prompt_name="query")
    finally:
        model.prompts, model.default_prompt_name = saved
    docs = llm.token_embed(DOCS, use_tqdm=False)
    for o, r in zip(docs, ref_default):
        r = torch.as_tensor(r)
        assert o.outputs.data.shape == r.shape and cosine_rows(o.outputs.data, r).min() >= 0.9999
    assert docs[2].prompt_token_ids[1] == model.document_prefix_id
    # input_type "document" names the same prompt here; PyLate under ST 6 returns a query's attended tokens only
    named = llm.token_embed(DOCS, PoolingParams(input_type="document"), use_tqdm=False)
    assert all(torch.equal(a.outputs.data, b.outputs.data) for a, b in zip(named, docs))
    queries = llm.token_embed(QUERIES, PoolingParams(input_type="query"), use_tqdm=False)
    for q, r in zip(queries, ref_queries):
        r = torch.as_tensor(r)
        assert q.outputs.data.shape == (24, 96) and q.prompt_token_ids[1] == model.query_prefix_id
        assert cosine_rows(q.outputs.data[: r.shape[0]], r).min() >= 0.9999
    # token ids in either mode: the prompt is the caller's to include (a PromptError refused them with prompts)
    tok = llm.get_tokenizer()
    ids = tok("search_query: " + QUERIES[0])["input_ids"]
    by_ids = llm.token_embed([ids], PoolingParams(input_type="query"), use_tqdm=False)[0]
    assert by_ids.prompt_token_ids == queries[0].prompt_token_ids
    assert torch.allclose(by_ids.outputs.data, queries[0].outputs.data, atol=1e-5)
    doc_ids = tok("search_document: " + DOCS[2])["input_ids"]
    by_doc = llm.token_embed([doc_ids], PoolingParams(input_type="document"), use_tqdm=False)[0]
    assert by_doc.prompt_token_ids == docs[2].prompt_token_ids
