"""Decoders (Qwen3, Qwen2, Llama, Mistral) against transformers on the same weights, whole and chunked.

Tiny random-initialised checkpoints (fixed seed, RMSNorm weights perturbed so a mis-loaded norm cannot pass).
Prompts of 50-60 tokens are mixed in one run with short ones; with a token budget of 16 the long ones are
prefilled in 4 chunks across steps, interleaved with the short requests.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from polyvec import LLM, PoolerConfig, PoolingParams
from tests.helpers import cosine_rows

DECODER = dict(
    vocab_size=30522,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=512,
)
FAMILIES = {
    "qwen3": ("Qwen3", "Qwen3Config", dict(DECODER, head_dim=16)),
    "qwen2": ("Qwen2", "Qwen2Config", dict(DECODER)),
    "llama": (
        "Llama",
        "LlamaConfig",
        dict(
            DECODER,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    "mistral": ("Mistral", "MistralConfig", dict(DECODER, sliding_window=24)),
}
LENGTHS = (55, 3, 60, 7, 50, 12, 58)


def save_decoder(kind: str, head: str, folder, tokenizer_from, seed: int = 0, **extra):
    import transformers

    prefix, cfg_name, kwargs = FAMILIES[kind]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_name)(**kwargs, **extra)
    model = getattr(transformers, f"{prefix}{head}")(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif "bias" in name:
                p.normal_(0.0, 0.05)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, folder / name)
    return model


def prompts(seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1000, 30000, (n,), generator=g).tolist() for n in LENGTHS]


def reference_hidden(model, ids: list[int]) -> torch.Tensor:
    base = getattr(model, "model", model)
    with torch.no_grad():
        return base(input_ids=torch.tensor([ids])).last_hidden_state[0]


@pytest.fixture(scope="module", params=list(FAMILIES))
def causal_lm(request, tmp_path_factory, minilm_path):
    folder = tmp_path_factory.mktemp(request.param)
    model = save_decoder(request.param, "ForCausalLM", folder, minilm_path)
    return request.param, folder, model


@pytest.mark.parametrize("budget", [None, 16])
def test_embed_last_token_embed_all_and_mean(causal_lm, budget):
    _kind, folder, model = causal_lm
    ps = prompts()
    refs = [reference_hidden(model, p) for p in ps]
    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=budget, enable_prefix_caching=False)
    assert llm.supported_tasks == ("embed", "token_embed")
    assert "convert=embed" in llm.model_config.sources["architecture"]
    token_prompts = [{"prompt_token_ids": p} for p in ps]
    embeds = llm.embed(token_prompts, use_tqdm=False)
    tokens = llm.token_embed(token_prompts, use_tqdm=False)
    for ref, e, t in zip(refs, embeds, tokens):
        assert cosine_rows(e.outputs.data, F.normalize(ref[-1], dim=-1)).item() >= 0.9999  # LAST + normalize
        assert t.outputs.data.shape == ref.shape
        assert cosine_rows(t.outputs.data, F.normalize(ref, dim=-1)).min().item() >= 0.9999
    if budget == 16:
        assert llm.engine.stats.num_batches >= 4 * 3  # the long prompts really went in chunks
    mean_llm = LLM(
        str(folder),
        dtype="float32",
        max_num_batched_tokens=budget,
        enable_prefix_caching=False,
        pooler_config=PoolerConfig(pooling_type="MEAN"),
    )
    means = mean_llm.embed(token_prompts, use_tqdm=False)
    for ref, m in zip(refs, means):
        assert cosine_rows(m.outputs.data, F.normalize(ref.mean(0), dim=-1)).item() >= 0.9999


POOLINGS = ["CLS", "LAST", "MEAN", "MAX", "WEIGHTED_MEAN", "ALL", "STEP"]


@pytest.mark.parametrize("pooling", POOLINGS)
def test_chunked_equals_unchunked(tmp_path, minilm_path, pooling):
    save_decoder("qwen3", "ForCausalLM", tmp_path, minilm_path)
    ps = prompts(seed=2)
    step_tag = ps[0][10]  # a token that occurs in the first prompt
    results = []
    for budget in (None, 16):
        llm = LLM(
            str(tmp_path),
            dtype="float32",
            max_num_batched_tokens=budget,
            enable_prefix_caching=False,
            pooler_config=PoolerConfig(pooling_type=pooling),
        )
        task = "token_embed" if pooling in ("ALL", "STEP") else "embed"
        params = PoolingParams(step_tag_id=step_tag) if pooling == "STEP" else None
        outs = llm.encode([{"prompt_token_ids": p} for p in ps], params, pooling_task=task, use_tqdm=False)
        results.append([o.outputs.data for o in outs])
    for whole, chunked in zip(*results):
        assert whole.shape == chunked.shape
        if whole.numel():
            assert cosine_rows(whole.reshape(-1, whole.shape[-1]), chunked.reshape(-1, whole.shape[-1])).min() >= 0.9999
            assert torch.allclose(whole, chunked, atol=1e-5)
    if pooling == "STEP":
        assert results[0][0].shape[0] == ps[0].count(step_tag) >= 1


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_sequence_classifier_whole_and_chunked(tmp_path, minilm_path, kind):
    model = save_decoder(kind, "ForSequenceClassification", tmp_path, minilm_path, num_labels=3)
    ps = prompts(seed=3)
    with torch.no_grad():
        refs = [model(input_ids=torch.tensor([p])).logits[0] for p in ps]
    with torch.no_grad():  # token_classify: the score head on every token (vLLM's sequence classifiers)
        token_refs = [model.score(model.model(input_ids=torch.tensor([p])).last_hidden_state)[0] for p in ps]
    for budget in (None, 16):
        llm = LLM(str(tmp_path), dtype="float32", max_num_batched_tokens=budget)
        assert llm.supported_tasks == ("classify", "token_classify")
        outs = llm.classify([{"prompt_token_ids": p} for p in ps], PoolingParams(use_activation=False), use_tqdm=False)
        for ref, o in zip(refs, outs):
            assert torch.allclose(o.outputs.data, ref, atol=1e-5)
        raw = PoolingParams(use_activation=False)
        tokens = llm.encode([{"prompt_token_ids": p} for p in ps], raw, use_tqdm=False)  # no task: token_classify
        for ref, o in zip(token_refs, tokens):
            assert o.outputs.data.shape == ref.shape and torch.allclose(o.outputs.data, ref, atol=1e-5)


def test_convert_classify_from_lm_head_tokens(tmp_path, minilm_path):
    """vLLM's classifier_from_token: a causal LM served as a classifier over the logits of named tokens."""
    model = save_decoder("qwen3", "ForCausalLM", tmp_path, minilm_path)
    llm = LLM(str(tmp_path), dtype="float32", convert="classify", hf_overrides={"classifier_from_token": ["no", "yes"]})
    ids = [llm.get_tokenizer().token_to_id(t) for t in ("no", "yes")]
    ps = prompts(seed=4)
    outs = llm.classify([{"prompt_token_ids": p} for p in ps], PoolingParams(use_activation=False), use_tqdm=False)
    for p, o in zip(ps, outs):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p])).logits[0, -1, ids]
        assert torch.allclose(o.outputs.data, logits, atol=1e-5)
    with pytest.raises(ValueError, match="classifier_from_token"):
        LLM(str(tmp_path), dtype="float32", convert="classify")


RERANK_TEMPLATE = (
    "<Instruct>: {{ instruction | default('Given a web search query, retrieve relevant passages', true) }}\n"
    "<Query>: {{ messages | selectattr('role', 'eq', 'query') | map(attribute='content') | first }}\n"
    "<Document>: {{ messages | selectattr('role', 'eq', 'document') | map(attribute='content') | first }}"
)
QWEN3_RERANKER = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True,
}


def test_qwen3_reranker_recipe_of_vllm(tmp_path, minilm_path):
    """vLLM 0.34's Qwen3-Reranker recipe (hf_overrides above, a ForCausalLM checkpoint): one label,
    sigmoid(logit(yes) - logit(no)) at the last token; the pair is query + document joined without a separator,
    or rendered through a chat template given explicitly (roles "query" and "document"). It did not load."""
    model = save_decoder("qwen3", "ForCausalLM", tmp_path, minilm_path)
    llm = LLM(str(tmp_path), dtype="float32", hf_overrides=QWEN3_RERANKER)
    assert llm.model_config.num_labels == 1 and llm.is_cross_encoder
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    no, yes = tok.token_to_id("no"), tok.token_to_id("yes")
    query, docs = "what is the capital of china?", ["the capital of china is beijing.", "gravity is a force."]

    def reference(text: str) -> float:
        ids = tok.encode(text).ids
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        return torch.sigmoid(logits[yes] - logits[no]).item()

    got = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    assert got == pytest.approx([reference(query + d) for d in docs], abs=1e-5)
    templated = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False, chat_template=RERANK_TEMPLATE)]
    from polyvec.chat import render

    pairs = [[{"role": "query", "content": query}, {"role": "document", "content": d}] for d in docs]
    want = [reference(render(RERANK_TEMPLATE, pair)) for pair in pairs]
    assert templated == pytest.approx(want, abs=1e-5) and templated != pytest.approx(got, abs=1e-4)
    with pytest.raises(ValueError, match="from_2_way_softmax' needs two classifier_from_token tokens"):
        LLM(str(tmp_path), dtype="float32", hf_overrides={**QWEN3_RERANKER, "classifier_from_token": ["yes"]})


def _save_st_decoder(folder, minilm_path, pooling: dict) -> None:
    """A Qwen3 decoder as a sentence-transformers folder: `pooling` in 1_Pooling, Normalize, a query prompt."""
    save_decoder("qwen3", "ForCausalLM", folder, minilm_path)
    (folder / "modules.json").write_text(
        json.dumps(
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
            ]
        )
    )
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **pooling}))
    (folder / "2_Normalize").mkdir()
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128, "do_lower_case": False}))
    (folder / "config_sentence_transformers.json").write_text(
        json.dumps(
            {
                "prompts": {"query": "Instruct: find passages about aerodynamics\nQuery:", "document": ""},
                "default_prompt_name": None,
            }
        )
    )


@pytest.mark.parametrize("budget", [None, 8])
def test_include_prompt_false_in_chunks(tmp_path, minilm_path, budget):
    """`include_prompt: false` on a decoder: mean pooling leaves the instruction's tokens out, also when the
    prompt is prefilled over several chunks (a budget of 8 tokens) and on prefix-cache hits."""
    from sentence_transformers import SentenceTransformer

    _save_st_decoder(tmp_path, minilm_path, {"pooling_mode": "mean", "include_prompt": False})
    texts = ["what is the stall angle of a thin wing", "laminar boundary layer", "shock waves"]
    want = SentenceTransformer(str(tmp_path), device="cpu").encode(texts, prompt_name="query", convert_to_tensor=True)
    llm = LLM(str(tmp_path), dtype="float32", max_num_batched_tokens=budget)
    for _ in range(2):  # the second time, the instruction's blocks come from the prefix cache
        got = torch.stack([o.outputs.data for o in llm.embed(texts, PoolingParams(input_type="query"), use_tqdm=False)])
        assert cosine_rows(got, want).min().item() >= 0.9999
    if budget:
        assert llm.engine.stats.num_batches >= 6  # the prompts really went in chunks


def test_qwen3_embedding_layout_with_instruction_prompts(tmp_path, minilm_path):
    """A Qwen3-Embedding-style folder: config.json says Qwen3ForCausalLM, modules.json has last-token
    pooling + Normalize, config_sentence_transformers.json has a query instruction. Against
    sentence-transformers on the same folder, with prompt_name="query" ↔ input_type="query"."""
    from sentence_transformers import SentenceTransformer

    _save_st_decoder(tmp_path, minilm_path, {"pooling_mode_lasttoken": True, "include_prompt": True})
    texts = ["what is the stall angle of a thin wing", "laminar boundary layer", "shock waves"]
    st = SentenceTransformer(str(tmp_path), device="cpu")
    llm = LLM(str(tmp_path), dtype="float32")
    assert llm.model_config.prompts["query"].startswith("Instruct:")
    for input_type in ("query", "document"):
        ref = st.encode(texts, prompt_name=input_type, convert_to_tensor=True, batch_size=2)
        got = torch.stack(
            [o.outputs.data for o in llm.embed(texts, PoolingParams(input_type=input_type), use_tqdm=False)]
        )
        assert cosine_rows(got, ref).min().item() >= 0.9999
    plain = torch.stack([o.outputs.data for o in llm.embed(texts, use_tqdm=False)])
    assert cosine_rows(plain, ref).min().item() >= 0.9999  # the document prompt is empty
    # token ids cannot take the query prompt: refused by name (the document embedding came back, silently)
    ids = {"prompt_token_ids": llm.embed(texts[0], use_tqdm=False)[0].prompt_token_ids}
    with pytest.raises(ValueError, match="prompt 0: input_type='query' puts the model's 'query' prompt before a text"):
        llm.embed([ids], PoolingParams(input_type="query"), use_tqdm=False)
    assert torch.allclose(llm.embed([ids], PoolingParams(input_type="document"), use_tqdm=False)[0].outputs.data,
                          plain[0], atol=1e-5)  # fmt: skip


def test_requests_wait_when_the_kv_cache_is_full(tmp_path, minilm_path):
    """A KV budget of 70 tokens holds one long prompt at a time: the others wait, none fails, results equal."""
    save_decoder("qwen3", "ForCausalLM", tmp_path, minilm_path)
    ps = prompts(seed=8)
    whole = LLM(str(tmp_path), dtype="float32", enable_prefix_caching=False).embed(
        [{"prompt_token_ids": p} for p in ps], use_tqdm=False
    )
    per_token = 2 * 2 * 2 * 16 * 4  # keys + values, 2 layers, 2 KV heads, head_dim 16, float32
    llm = LLM(
        str(tmp_path),
        dtype="float32",
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
        kv_cache_memory_bytes=70 * per_token,
    )
    assert llm.engine.kv_cache_tokens == 70
    peak = 0
    step = llm.engine.step

    def watched_step():
        nonlocal peak
        out = step()
        peak = max(peak, llm.engine.scheduler.kv_used)
        return out

    llm.engine.step = watched_step
    got = llm.embed([{"prompt_token_ids": p} for p in ps], use_tqdm=False)
    for a, b in zip(whole, got):
        assert torch.allclose(a.outputs.data, b.outputs.data, atol=1e-5)
    assert 50 <= peak <= 70 and llm.engine.scheduler.kv_used == 0
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        llm.embed([{"prompt_token_ids": ps[0] + ps[2]}], use_tqdm=False)


@pytest.mark.parametrize("budget", [None, 8])
def test_long_inputs_in_windows_as_vllm_chunked_processing(tmp_path, minilm_path, budget):
    """vLLM's `enable_chunked_processing` on a decoder: an input over max_model_len is read in windows of
    max_model_len tokens (each prefilled in chunks under a small budget), their LAST vectors averaged by token
    count, then normalized; token_embed returns every token's vector. It was silently truncated."""
    model = save_decoder("qwen2", "ForCausalLM", tmp_path, minilm_path)
    ids = torch.randint(1000, 30000, (100,), generator=torch.Generator().manual_seed(3)).tolist()
    llm = LLM(
        str(tmp_path),
        dtype="float32",
        max_model_len=32,
        max_num_batched_tokens=budget,
        pooler_config=PoolerConfig(enable_chunked_processing=True, max_embed_len=200),
    )
    windows = [ids[s : s + 32] for s in range(0, len(ids), 32)]
    hidden = [reference_hidden(model, w) for w in windows]
    weights = torch.tensor([float(len(w)) for w in windows])
    want = F.normalize((torch.stack([h[-1] for h in hidden]) * weights[:, None]).sum(0) / weights.sum(), dim=0)
    short = ids[:20]
    out, alone = llm.embed([{"prompt_token_ids": ids}, {"prompt_token_ids": short}], use_tqdm=False)
    assert out.prompt_token_ids == ids and out.num_input_tokens == 100
    assert cosine_rows(out.outputs.data, want).item() >= 0.9999
    assert cosine_rows(alone.outputs.data, F.normalize(reference_hidden(model, short)[-1], dim=0)).item() >= 0.9999
    (tokens,) = llm.token_embed([{"prompt_token_ids": ids}], use_tqdm=False)
    assert cosine_rows(tokens.outputs.data, F.normalize(torch.cat(hidden), dim=-1)).min().item() >= 0.9999
    with pytest.raises(ValueError, match="200"):  # max_embed_len: longer inputs are refused
        llm.embed([{"prompt_token_ids": ids * 3}], use_tqdm=False)


def test_late_chunking_over_chunked_prefill_and_a_cached_prefix(tmp_path, minilm_path):
    """vLLM 0.34's test_late_chunking_recomputes_cached_prefix_with_chunked_prefill: a decoder's late chunks are
    the means of its hidden rows whether the prompt went in pieces of 16 tokens or its prefix came from the
    cache (the chunk means are taken in the pooler now, over every row the prefill carried)."""
    from polyvec import LateChunkingParams

    model = save_decoder("qwen3", "ForCausalLM", tmp_path, minilm_path)
    text = "the flutter of a heated wing at supersonic speed, measured in a blowdown tunnel " * 3
    llm = LLM(str(tmp_path), dtype="float32", max_num_batched_tokens=16)
    params = PoolingParams(late_chunking_params=LateChunkingParams(7))
    first = llm.token_embed(text, params, use_tqdm=False)[0]
    ref = reference_hidden(model, first.prompt_token_ids)
    want = F.normalize(torch.stack([part.mean(0) for part in ref.split(7)]), dim=-1)
    assert first.outputs.data.shape == want.shape and cosine_rows(first.outputs.data, want).min() >= 0.9999
    again = llm.token_embed(text, params, use_tqdm=False)[0]  # its prefix now cached
    assert again.num_cached_tokens > 0 and torch.allclose(again.outputs.data, first.outputs.data, atol=1e-5)


def test_a_templated_pair_too_long_has_its_document_cut_not_the_template(tmp_path, minilm_path):
    """A rendered reranker prompt over max_model_len lost its end, the template's words after the document (the
    Qwen3-Reranker template's assistant turn), so the yes/no logit was read inside the document; the document is
    cut so that the whole prompt fits (as Qwen3-Reranker's own usage truncates), the template kept."""
    model = save_decoder("qwen3", "ForCausalLM", tmp_path, minilm_path)
    template = RERANK_TEMPLATE + "\n<Judge>: is the document relevant? answer yes or no"
    llm = LLM(str(tmp_path), dtype="float32", hf_overrides=QWEN3_RERANKER, max_model_len=48)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    no, yes = tok.token_to_id("no"), tok.token_to_id("yes")
    query, doc = "what is the capital of china?", "the capital of china is beijing. " * 20
    (out,) = llm.score(query, [doc], use_tqdm=False, chat_template=template)
    ids = out.prompt_token_ids
    text = tok.decode(ids)  # lowercased: MiniLM's vocabulary
    assert 40 <= len(ids) <= 48 and text.endswith("answer yes or no") and "< document > : the capital" in text, text
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
    assert out.outputs.score == pytest.approx(torch.sigmoid(logits[yes] - logits[no]).item(), abs=1e-5)
    # a query that leaves the document no room: the document goes, then the query is cut; the end stays
    (long_query,) = llm.score(query * 4, ["beijing is the capital."], use_tqdm=False, chat_template=template)
    assert len(long_query.prompt_token_ids) <= 48 and tok.decode(long_query.prompt_token_ids).endswith("yes or no")
    with pytest.raises(ValueError, match="the chat template's own words exceed max_model_len=48"):
        llm.score(query, [doc], use_tqdm=False, chat_template=template + " filler" * 60)


def test_a_decoder_with_is_causal_false_attends_both_ways(tmp_path, minilm_path):
    """vLLM's `is_causal: false` (gte-Qwen2's config): every token attends to its whole prompt. It was ignored (the
    model ran causally: the first token's state did not see the rest). The reference is transformers' Qwen2 with
    an all-visible attention mask; outputs do not depend on the batch."""
    import json

    model = save_decoder("qwen2", "ForCausalLM", tmp_path, minilm_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "is_causal": False}))
    llm = LLM(str(tmp_path), dtype="float32")
    assert not llm.model_config.is_causal
    ps = prompts()
    outs = llm.token_embed([{"prompt_token_ids": p} for p in ps], PoolingParams(use_activation=False), use_tqdm=False)
    for p, out in zip(ps, outs):
        with torch.no_grad():
            visible = torch.zeros(1, 1, len(p), len(p))  # additive mask: nothing hidden
            ref = model.model(input_ids=torch.tensor([p]), attention_mask=visible).last_hidden_state[0]
        assert cosine_rows(out.outputs.data, ref).min().item() >= 0.9999
    (alone,) = llm.token_embed({"prompt_token_ids": ps[2]}, PoolingParams(use_activation=False), use_tqdm=False)
    assert torch.allclose(alone.outputs.data, outs[2].outputs.data, atol=1e-5)
    overridden = LLM(str(tmp_path), dtype="float32", hf_overrides={"is_causal": True})
    assert overridden.model_config.is_causal  # vLLM's hf_overrides set it too


def test_a_llama_config_with_a_stray_sliding_window_attends_to_everything(tmp_path, minilm_path):
    """transformers' and vLLM's Llama apply no window unless layer_types ask for one; a `sliding_window` left in a
    Llama config (Mistral conversions) was applied to every layer (cosine 0.37 to the reference)."""
    model = save_decoder("llama", "ForCausalLM", tmp_path, minilm_path, sliding_window=8)
    llm = LLM(str(tmp_path), dtype="float32")
    ps = prompts()
    outs = llm.token_embed([{"prompt_token_ids": p} for p in ps], PoolingParams(use_activation=False), use_tqdm=False)
    for p, out in zip(ps, outs):
        assert cosine_rows(out.outputs.data, reference_hidden(model, p)).min().item() >= 0.9999


def test_a_mistral_config_without_sliding_window_has_transformers_default():
    """transformers' MistralConfig windows every layer when config.json leaves `sliding_window` out (vLLM reads
    the same config); polyvec applied none. An explicit null is no window, as there."""
    from transformers import MistralConfig

    from polyvec.models.args import DecoderArgs

    base = {"hidden_size": 32, "num_attention_heads": 2, "num_hidden_layers": 2, "intermediate_size": 64,
            "vocab_size": 100}  # fmt: skip
    assert DecoderArgs.from_hf({**base, "model_type": "mistral"}).sliding_window == MistralConfig().sliding_window
    assert DecoderArgs.from_hf({**base, "model_type": "mistral", "sliding_window": None}).sliding_window is None
    assert DecoderArgs.from_hf({**base, "model_type": "llama"}).sliding_window is None
    # vLLM's is_causal false (bidirectional embedders): the whole prompt, not a window nobody asked for
    assert DecoderArgs.from_hf({**base, "model_type": "mistral", "is_causal": False}).sliding_window is None


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 24, "beta_fast": 8, "truncate": False},
        {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 20, "attention_factor": 1.5},
        {"rope_type": "yarn", "factor": 4.0},  # the length trained on: max_position_embeddings
        {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32, "mscale": 2.0, "mscale_all_dim": 1.0},
    ],
)
def test_yarn_rope_matches_transformers(tmp_path, minilm_path, rope):
    """YaRN (Qwen's recipe for long inputs) was refused at load; prompts past the original length, chunked too."""
    model = save_decoder("qwen3", "Model", tmp_path, minilm_path, rope_scaling=rope)
    ps = prompts()
    llm = LLM(str(tmp_path), dtype="float32", max_num_batched_tokens=16, enable_prefix_caching=False)
    for p, out in zip(ps, llm.token_embed([{"prompt_token_ids": p} for p in ps], use_tqdm=False)):
        ref = F.normalize(reference_hidden(model, p), dim=-1)
        assert cosine_rows(out.outputs.data, ref).min().item() >= 0.9999, (rope, len(p))
    assert llm.model_config.max_model_len == 512  # vLLM takes a YaRN config's max_position_embeddings as scaled


@pytest.mark.parametrize(
    "rope, top",
    [
        ({"rope_type": "yarn", "factor": 4.0}, {"original_max_position_embeddings": 16}),  # Phi-3's place: it wins
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, {"original_max_position_embeddings": 16}),  # noqa: E501
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}, {}),
    ],
)  # fmt: skip
def test_rope_lengths_as_transformers_standardizes_them(tmp_path, minilm_path, rope, top):
    """A config.json of transformers 4 (rope_scaling, no rope_parameters): a top-level original_max_position_embeddings
    overrides the rope's (other vectors than transformers' before), and none at all is max_position_embeddings (Llama-3
    rope loaded, then every request failed with a KeyError)."""
    import transformers

    save_decoder("qwen3", "Model", tmp_path, minilm_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("rope_parameters", None)
    (tmp_path / "config.json").write_text(json.dumps({**config, "rope_theta": 10000.0, "rope_scaling": rope, **top}))
    model = transformers.Qwen3Model.from_pretrained(str(tmp_path)).eval()
    llm = LLM(str(tmp_path), dtype="float32", enable_prefix_caching=False)
    for p, out in zip(prompts(), llm.token_embed([{"prompt_token_ids": p} for p in prompts()], use_tqdm=False)):
        assert cosine_rows(out.outputs.data, F.normalize(reference_hidden(model, p), dim=-1)).min().item() >= 0.9999


def test_linear_rope_stretches_the_length_limit(tmp_path, minilm_path):
    """vLLM multiplies max_position_embeddings by a linear (or dynamic) factor: inputs up to 1,024 here, not 512."""
    save_decoder("qwen2", "Model", tmp_path, minilm_path, rope_scaling={"rope_type": "linear", "factor": 2.0})
    llm = LLM(str(tmp_path), dtype="float32")
    assert llm.model_config.max_model_len == 1024
    assert llm.embed([{"prompt_token_ids": [1000] * 700}], use_tqdm=False)[0].outputs.data.shape == (64,)


LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
            "original_max_position_embeddings": 128}  # fmt: skip


@pytest.mark.parametrize("rope", [LONGROPE, {"rope_type": "dynamic", "factor": 2.0}])
def test_an_unsupported_rope_type_is_refused_at_load(tmp_path, minilm_path, rope):
    """dynamic / longrope loaded, then every forward pass failed (a server healthy, each request a 500)."""
    from polyvec import LLM

    save_decoder("qwen2", "Model", tmp_path, minilm_path, rope_scaling=rope)
    with pytest.raises(ValueError, match=f"rope type '{rope['rope_type']}' \\(config.json\\) is not supported"):
        LLM(str(tmp_path), dtype="float32")
