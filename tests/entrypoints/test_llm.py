"""The vLLM-compatible offline API: methods, output fields, overrides, errors."""

from __future__ import annotations

import logging
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from polyvec import LLM, EmbeddingRequestOutput, PoolerConfig, PoolingParams, PoolingRequestOutput
from tests.conftest import DATA, REPO
from tests.helpers import cosine_rows

QUERY = "how do wings behave in a slipstream"
DOCS = [
    "experimental investigation of the aerodynamics of a wing in a slipstream",
    "heat transfer to a blunt body in hypersonic flow",
    "the wing was tested in a wind tunnel",
]


def test_embed_output_fields(minilm_llm):
    outs = minilm_llm.embed([QUERY, DOCS[0]], use_tqdm=False)
    assert isinstance(outs[0], EmbeddingRequestOutput)
    emb = outs[0].outputs.embedding
    assert isinstance(emb, list) and len(emb) == 384 == outs[0].outputs.hidden_size
    assert abs(sum(x * x for x in emb) - 1) < 1e-5
    assert outs[0].prompt_token_ids[0] == 101 and outs[0].finished
    assert outs[0].request_id != outs[1].request_id


def test_outputs_as_vllms(minilm_llm):
    """vLLM 0.34's output surface: outputs compare by value (a tensor-holding dataclass raised "Boolean value
    of Tensor ... is ambiguous"), `error` is None, `from_base` re-wraps a generic pooling output, an empty
    prompt list is vLLM's ValueError, and numpy integers are token ids."""
    import numpy as np

    from polyvec.outputs import ClassificationOutput, EmbeddingOutput, PoolingOutput

    a, b = (minilm_llm.encode(QUERY, pooling_task="token_embed", use_tqdm=False)[0] for _ in range(2))
    assert a.outputs == b.outputs and a.outputs != minilm_llm.encode(DOCS[0], use_tqdm=False)[0].outputs
    one = minilm_llm.encode(QUERY, pooling_task="embed", use_tqdm=False)[0]
    assert one.error is None and minilm_llm.embed(QUERY, use_tqdm=False)[0].error is None
    typed = EmbeddingRequestOutput.from_base(one)
    assert typed.outputs == minilm_llm.embed(QUERY, use_tqdm=False)[0].outputs and typed.request_id == one.request_id
    assert EmbeddingOutput(torch.ones(2)) == EmbeddingOutput(torch.ones(2)) != ClassificationOutput(torch.ones(2))
    with pytest.raises(ValueError, match="1-D embedding vector"):
        EmbeddingOutput.from_base(PoolingOutput(torch.ones(2, 3)))
    for call in (minilm_llm.embed, minilm_llm.encode):
        with pytest.raises(ValueError, match="You must pass at least one prompt"):
            call([], use_tqdm=False)
    ids = [101, 7592, 102]
    got = minilm_llm.embed([[np.int64(t) for t in ids]], use_tqdm=False)[0]
    assert got.outputs == minilm_llm.embed([ids], use_tqdm=False)[0].outputs and got.prompt_token_ids == ids


def test_outputs_built_as_vllm_builds_them():
    """vLLM 0.34's constructors: PoolingRequestOutput(request_id, outputs, prompt_token_ids, num_cached_tokens,
    finished) positionally, EmbeddingOutput / ClassificationOutput from lists of floats, by position or name."""
    from polyvec.outputs import ClassificationOutput, EmbeddingOutput, PoolingOutput

    r = PoolingRequestOutput("id", PoolingOutput(torch.ones(3)), [1, 2, 3], 5, False)
    assert (r.num_cached_tokens, r.finished, r.num_input_tokens) == (5, False, 0)
    with pytest.raises(TypeError):
        PoolingRequestOutput("id", PoolingOutput(torch.ones(3)), [1, 2, 3], 5, False, 3)  # type: ignore[misc]
    for e in (EmbeddingOutput([0.5, 0.25]), EmbeddingOutput(embedding=[0.5, 0.25])):
        assert e.embedding == [0.5, 0.25] and e.hidden_size == 2 and e == EmbeddingOutput(torch.tensor([0.5, 0.25]))
    for c in (ClassificationOutput([0.75, 0.25]), ClassificationOutput(probs=[0.75, 0.25])):
        assert c.probs == [0.75, 0.25] and c.num_classes == 2


def test_encode_picks_token_embed_and_honours_task(minilm_llm):
    out = minilm_llm.encode(QUERY, use_tqdm=False)[0]
    assert isinstance(out, PoolingRequestOutput) and out.task == "token_embed"
    assert out.outputs.data.shape == (len(out.prompt_token_ids), 384)
    pooled = minilm_llm.encode(QUERY, pooling_task="embed", use_tqdm=False)[0]
    assert pooled.outputs.data.shape == (384,)
    via_params = minilm_llm.encode(QUERY, PoolingParams(task="embed"), use_tqdm=False)[0]
    assert torch.equal(via_params.outputs.data, pooled.outputs.data)
    assert torch.equal(minilm_llm.token_embed(QUERY, use_tqdm=False)[0].outputs.data, out.outputs.data)


def test_a_list_of_tasks_is_keyed_by_task_even_of_one(minilm_llm):
    """pooling_task=["embed"] gives {"embed": tensor}, as any list does; options that reshape one token_embed
    output, or that only embed_sparse reads, are refused for a list rather than dropped or crashing."""
    one = minilm_llm.encode("wing flutter", pooling_task=["embed"], use_tqdm=False)[0].outputs.data
    alone = minilm_llm.embed("wing flutter", use_tqdm=False)[0].outputs.data
    assert set(one) == {"embed"} and torch.equal(one["embed"], alone)
    for option, message in [
        ({"token_encoding": "int8"}, "token_encoding applies to one token_embed task, not a list of tasks"),
        ({"pool_factor": 2}, "pool_factor applies to one token_embed task, not a list of tasks"),
        ({"sparse_top_k": 3}, "sparse_top_k applies to embed_sparse, which is not among"),
    ]:
        with pytest.raises(ValueError, match=message):
            minilm_llm.encode("x", PoolingParams(**option), pooling_task=["token_embed"], use_tqdm=False)


def test_token_prompts_carry_their_segments(minilm_llm):
    """vLLM's TokensPrompt token_type_ids (a tokenized pair) are the pair's segments, as the text pair gives them;
    they were dropped, so the second segment was read as the first."""
    pair = ("what is flutter", "wing flutter is an oscillation")
    enc = minilm_llm.engine.tokenizer.encode_prompts([pair], 512, True)[0]
    assert 1 in enc.token_type_ids
    want = minilm_llm.token_embed([pair], use_tqdm=False)[0].outputs.data
    prompt = {"prompt_token_ids": enc.input_ids, "token_type_ids": enc.token_type_ids}
    assert torch.equal(minilm_llm.token_embed(prompt, use_tqdm=False)[0].outputs.data, want)
    with pytest.raises(ValueError, match="prompt 0: token_type_ids must be one integer >= 0 per token id"):
        minilm_llm.embed({"prompt_token_ids": [101, 102], "token_type_ids": [0]}, use_tqdm=False)
    with pytest.raises(ValueError, match="window_overlap=254 must be less than half of max_model_len=256"):
        LLM(minilm_llm.model_config.model, long_input="window", window_overlap=254)
    assert LLM(minilm_llm.model_config.model, enforce_eager=True).supported_tasks  # vLLM's keyword (a TypeError)


def test_unsupported_task_names_supported_ones(minilm_llm):
    with pytest.raises(ValueError, match=r"Unsupported task: 'classify' is not .*it supports: embed, token_embed"):
        minilm_llm.classify(QUERY, use_tqdm=False)
    with pytest.raises(ValueError, match="it supports: embed, token_embed"):
        minilm_llm.token_classify(QUERY, use_tqdm=False)
    assert not minilm_llm.engine.has_unfinished_requests()


def test_score_pairings_equal_cosine(minilm_llm, st_minilm):
    from sentence_transformers.util import cos_sim

    ref = cos_sim(st_minilm.encode([QUERY], convert_to_tensor=True), st_minilm.encode(DOCS, convert_to_tensor=True))[0]
    one_n = [o.outputs.score for o in minilm_llm.score(QUERY, DOCS, use_tqdm=False)]
    assert torch.allclose(torch.tensor(one_n), ref, atol=1e-5)
    one_one = minilm_llm.score(QUERY, DOCS[1], use_tqdm=False)
    assert len(one_one) == 1 and abs(one_one[0].outputs.score - ref[1].item()) < 1e-5
    n_n = [o.outputs.score for o in minilm_llm.score([QUERY, QUERY, QUERY], DOCS, use_tqdm=False)]
    assert torch.allclose(torch.tensor(n_n), ref, atol=1e-5)
    with pytest.raises(ValueError, match="data_1 has 2 items and data_2 has 3"):  # the arguments' names
        minilm_llm.score([QUERY, QUERY], DOCS, use_tqdm=False)
    # a bad item named as the caller passed it (it was 'prompt 2', its place in the joined list)
    with pytest.raises(ValueError, match=r"^data_2 item 1: token id 999999 is out of vocabulary"):
        minilm_llm.score(QUERY, ["fine", [999999]], use_tqdm=False)
    with pytest.raises(ValueError, match=r"^data_1 item 1: token id"):
        minilm_llm.score([QUERY, [999999]], ["a", "b"], use_tqdm=False)
    # vLLM's prompt_token_ids of an embedding model's pair: the two sides joined by the tokenizer's pad token
    q, d = (minilm_llm.embed(t, use_tqdm=False)[0].prompt_token_ids for t in (QUERY, DOCS[1]))
    assert one_one[0].prompt_token_ids == [*q, 0, *d]  # [PAD] is 0


def test_per_prompt_params_and_activation_off(minilm_llm):
    raw_tokens = minilm_llm.token_embed(QUERY, PoolingParams(normalize=False), use_tqdm=False)[0].outputs.data
    outs = minilm_llm.embed([QUERY, QUERY], [PoolingParams(), PoolingParams(use_activation=False)], use_tqdm=False)
    assert torch.allclose(outs[1].outputs.data, raw_tokens.mean(0), atol=1e-5)  # MEAN of raw token states
    assert torch.allclose(outs[0].outputs.data, F.normalize(raw_tokens.mean(0), dim=-1), atol=1e-6)


def test_pooler_config_overrides_pooling_and_activation(minilm_path, minilm_llm):
    raw_tokens = minilm_llm.token_embed(QUERY, PoolingParams(normalize=False), use_tqdm=False)[0].outputs.data
    cls = LLM(str(minilm_path), dtype="float32", pooler_config=PoolerConfig(pooling_type="CLS"))
    assert torch.allclose(
        cls.embed(QUERY, use_tqdm=False)[0].outputs.data, F.normalize(raw_tokens[0], dim=-1), atol=1e-6
    )
    assert cls.model_config.sources["pooling_type"] == "pooler_config"
    mx = LLM(str(minilm_path), dtype="float32", pooler_config=PoolerConfig(pooling_type="MAX", use_activation=False))
    assert torch.allclose(mx.embed(QUERY, use_tqdm=False)[0].outputs.data, raw_tokens.amax(0), atol=1e-6)


def test_matryoshka_dimensions_through_hf_overrides(minilm_path, minilm_llm):
    m = LLM(str(minilm_path), dtype="float32", hf_overrides={"matryoshka_dimensions": [64, 384]})
    raw = minilm_llm.embed(QUERY, PoolingParams(use_activation=False), use_tqdm=False)[0].outputs.data
    out = m.embed(QUERY, PoolingParams(dimensions=64), use_tqdm=False)[0].outputs.data
    assert out.shape == (64,) and torch.allclose(out, F.normalize(raw[:64], dim=-1), atol=1e-6)
    tok = m.token_embed(QUERY, PoolingParams(dimensions=64), use_tqdm=False)[0].outputs.data
    assert tok.shape[1] == 64 and torch.allclose(tok.norm(dim=-1), torch.ones(tok.shape[0]), atol=1e-5)
    with pytest.raises(ValueError, match="Matryoshka dimensions: 64, 384"):
        m.embed(QUERY, PoolingParams(dimensions=100), use_tqdm=False)


def test_sentence_transformers_dense_and_concatenated_pooling(tmp_path, minilm_path, cranfield_texts):
    """An ST model with cls+mean pooling and two Dense layers (tanh, then a residual identity layer)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Transformer

    torch.manual_seed(3)
    modules = [
        Transformer(str(minilm_path), max_seq_length=128),
        Pooling(384, pooling_mode=("cls", "mean")),
        Dense(768, 96, activation_function=torch.nn.Tanh()),
        Dense(96, 48, activation_function=torch.nn.Identity(), use_residual=True),
        Normalize(),
    ]
    st = SentenceTransformer(modules=modules, device="cpu").eval()
    st.save(str(tmp_path / "st"))
    texts = cranfield_texts[:12]
    ref = st.encode(texts, convert_to_tensor=True, normalize_embeddings=True)
    llm = LLM(str(tmp_path / "st"), dtype="float32")
    assert llm.model_config.st_pooling == ("CLS", "MEAN") and llm.model_config.max_model_len == 128
    got = torch.stack([o.outputs.data for o in llm.embed(texts, use_tqdm=False)])
    assert got.shape == (12, 48) and cosine_rows(got, ref).min() >= 0.9999
    # the Dense layers multiply one row per sequence: a text alone gives the same bits as in the batch
    alone = llm.embed(texts[:1], use_tqdm=False)[0].outputs.data
    assert torch.equal(alone, got[0])


def test_prompt_validation(minilm_llm):
    with pytest.raises(ValueError, match="at least one prompt"):  # vLLM refuses an empty list
        minilm_llm.embed([], use_tqdm=False)
    with pytest.raises(TypeError, match="prompt 1 must be a string"):
        minilm_llm.embed(["ok", 3.5], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt 0 has no tokens"):
        minilm_llm.embed([[]], use_tqdm=False)
    with pytest.raises(ValueError, match=r"token ids must be integers in 0..30521"):
        minilm_llm.embed([[101, 99999, 102]], use_tqdm=False)
    with pytest.raises(ValueError, match="dict without 'prompt' or 'prompt_token_ids'"):
        minilm_llm.embed({"text": "x"}, use_tqdm=False)
    # each names the prompt and what is wrong (a tokenizer TypeError, or "prompt 1: (token ids ...)", before)
    cases = [
        (["ok", "a\ud800b"], "prompt 1: character 1 is a lone surrogate"),
        (["ok", ("a", "b\udc00")], "prompt 1: character 1 is a lone surrogate"),
        (["ok", {"prompt": None}], "prompt 1 is NoneType: a prompt is a text"),
        (["ok", ["x", "y"]], r"prompt 1: 'x' is not a token id \(token ids must be integers in 0..30521\)"),
    ]
    for prompts, message in cases:
        with pytest.raises(ValueError, match=message):
            minilm_llm.embed(prompts, use_tqdm=False)
    with pytest.raises(TypeError, match="prompts must be a prompt or a list of prompts, not None"):
        minilm_llm.embed(None, use_tqdm=False)
    import numpy as np

    flat = minilm_llm.embed(list(np.array([101, 7592, 102])), use_tqdm=False)  # numpy's integers: one prompt
    assert len(flat) == 1 and flat[0].prompt_token_ids == [101, 7592, 102]
    assert not minilm_llm.engine.has_unfinished_requests()


def test_constructor_arguments(minilm_path):
    with pytest.raises(TypeError, match="unexpected arguments: bogus"):
        LLM(str(minilm_path), bogus=1)
    with pytest.raises(ValueError, match="polyvec runs pooling models only"):
        LLM(str(minilm_path), runner="generate")
    with pytest.raises(ValueError, match="tensor_parallel_size=2 is not supported"):
        LLM(str(minilm_path), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="max_num_batched_tokens=100 is smaller than max_model_len=256"):
        LLM(str(minilm_path), max_num_batched_tokens=100)
    with pytest.raises(ValueError, match="dtype must be auto or one of float32, bfloat16, float16"):
        LLM(str(minilm_path), dtype="int4")
    llm = LLM(str(minilm_path), runner="pooling", trust_remote_code=True, dtype="bfloat16")
    assert llm.model_config.dtype == torch.bfloat16
    out = llm.embed(QUERY, use_tqdm=False)[0].outputs.data
    assert out.dtype == torch.float32  # pooling and heads run in float32
    ref = LLM(str(minilm_path), dtype="float32").embed(QUERY, use_tqdm=False)[0].outputs.data
    assert cosine_rows(out[None], ref[None]).item() >= 0.99


def test_auto_dtype_is_bfloat16_where_the_cpu_runs_it_faster(minilm_path, monkeypatch):
    """AVX512-BF16 / AMX in the flags and a bfloat16 matmul measured clearly faster than float32; an Intel Xeon
    reporting AVX512-BF16 ran it well below float32's speed, where auto had picked it."""
    from polyvec.config import resolve_dtype
    from polyvec.platforms import cpu, get_platform

    expected = torch.bfloat16 if cpu.bf16_is_faster() else torch.float32
    assert resolve_dtype("auto", get_platform(torch.device("cpu"))) == expected
    assert LLM(str(minilm_path)).model_config.dtype == expected
    for flags, speedup, want in ((True, 0.6, torch.float32), (True, 2.0, torch.bfloat16), (False, 3.0, torch.float32)):
        cpu.bf16_is_faster.cache_clear()
        monkeypatch.setattr(cpu, "cpu_has_native_bf16", lambda flags=flags: flags)
        monkeypatch.setattr(cpu, "bf16_speedup", lambda speedup=speedup: speedup)
        assert resolve_dtype("auto", get_platform(torch.device("cpu"))) == want, (flags, speedup)
    cpu.bf16_is_faster.cache_clear()


def test_a_chosen_bfloat16_slower_than_float32_is_said(monkeypatch, caplog):
    """dtype bfloat16 asked for where this CPU runs it slower than float32 (a Xeon with AVX512-BF16 and no AMX:
    about half the speed) is kept, with a warning that says so; float32, auto and a faster bfloat16 say nothing."""
    from polyvec.config import resolve_dtype
    from polyvec.platforms import cpu, get_platform

    platform = get_platform(torch.device("cpu"))
    try:
        for flags, speedup, dtype, warned in (
            (True, 0.6, "bfloat16", True),
            (False, 3.0, torch.bfloat16, True),
            (True, 0.6, "float32", False),
            (True, 0.6, "auto", False),
            (True, 2.0, "bfloat16", False),
        ):
            cpu.bf16_is_faster.cache_clear()
            monkeypatch.setattr(cpu, "cpu_has_native_bf16", lambda flags=flags: flags)
            monkeypatch.setattr(cpu, "bf16_speedup", lambda speedup=speedup: speedup)
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="polyvec.platforms.cpu"):
                chosen = resolve_dtype(dtype, platform)
            assert chosen == (torch.float32 if dtype in ("float32", "auto") else torch.bfloat16)
            said = [r.getMessage() for r in caplog.records if "not faster than float32" in r.getMessage()]
            assert bool(said) == warned, (flags, speedup, dtype, said)
            if said:
                assert ("no AVX512-BF16 or AMX" in said[0]) == (not flags), said
    finally:
        cpu.bf16_is_faster.cache_clear()


def test_bfloat16_stays_within_0999_of_float32(minilm_path, minilm_llm, cranfield_texts):
    bf16 = LLM(str(minilm_path), dtype="bfloat16")
    a = torch.stack([o.outputs.data for o in bf16.embed(cranfield_texts, use_tqdm=False)])
    b = torch.stack([o.outputs.data for o in minilm_llm.embed(cranfield_texts, use_tqdm=False)])
    assert cosine_rows(a, b).min() >= 0.999
    for x, y in zip(
        bf16.token_embed(cranfield_texts[:10], use_tqdm=False),
        minilm_llm.token_embed(cranfield_texts[:10], use_tqdm=False),
    ):
        assert cosine_rows(x.outputs.data, y.outputs.data).min() >= 0.999


def test_progress_bar_callable(minilm_llm):
    seen = []

    class Bar:
        def __init__(self, total, **kw):
            seen.append(total)

        def update(self, n):
            seen.append(n)

        def close(self):
            seen.append("closed")

    minilm_llm.embed(DOCS, use_tqdm=Bar)
    assert seen[0] == 3 and sum(x for x in seen[1:-1]) == 3 and seen[-1] == "closed"


def test_cli_embed_main_job(tmp_path):
    corpus = DATA / "cranfield" / "corpus.jsonl"  # the README's offline example
    result = subprocess.run(
        [sys.executable, "-m", "polyvec", "embed", str(corpus), "--limit", "40", "--quiet"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "embedded 40 texts" in result.stdout and "tokens/s" in result.stdout
    assert "nearest neighbour of text 0" in result.stdout


def test_iter_encode_streams_in_order_with_bounded_memory(minilm_llm, cranfield_texts):
    texts = cranfield_texts * 3
    ref = minilm_llm.embed(texts, use_tqdm=False)
    queued = []
    add = minilm_llm.engine.add_requests

    def watched(requests):
        add(requests)
        queued.append(len(minilm_llm.engine.scheduler))

    minilm_llm.engine.add_requests = watched
    try:
        got = list(minilm_llm.iter_encode((t for t in texts), max_in_flight=20))
    finally:
        minilm_llm.engine.add_requests = add
    assert len(got) == len(texts)
    for a, b in zip(ref, got):
        assert a.prompt_token_ids == b.prompt_token_ids
        assert torch.allclose(a.outputs.data, b.outputs.data, atol=1e-6)
    assert max(queued) <= 20 and len(queued) >= len(texts) // 20
    tokens = list(minilm_llm.iter_encode(texts[:5], pooling_task="token_embed"))
    assert [t.outputs.data.shape[0] for t in tokens] == [len(t.prompt_token_ids) for t in tokens]
    stream = minilm_llm.iter_encode(texts, max_in_flight=8)
    next(stream)
    stream.close()  # the consumer stops early: nothing stays queued
    assert not minilm_llm.engine.has_unfinished_requests()


def test_empty_string_is_an_input_and_zero_tokens_is_an_error(minilm_llm, st_minilm):
    out = minilm_llm.embed(["", "x", "   "], use_tqdm=False)
    assert [len(o.prompt_token_ids) for o in out] == [2, 3, 2]  # [CLS] [SEP] for the empty ones
    ref = torch.from_numpy(st_minilm.encode([""], normalize_embeddings=True))[0]
    assert torch.nn.functional.cosine_similarity(out[0].outputs.data, ref, dim=0) > 0.9999
    with pytest.raises(ValueError, match="input 1 has no tokens after tokenization"):
        minilm_llm.engine.process(["ok", "\u200b"], None, "embed", add_special_tokens=False)
    with pytest.raises(ValueError, match="prompt 0 has no tokens"):
        minilm_llm.embed({"prompt_token_ids": []}, use_tqdm=False)
    assert not minilm_llm.engine.has_unfinished_requests()


def test_cli_embed_keeps_blank_lines_as_rows(tmp_path):
    import numpy as np

    texts = tmp_path / "texts.txt"
    texts.write_text("first line\n\nthird line\n")
    out = tmp_path / "vectors.npy"
    result = subprocess.run(
        [sys.executable, "-m", "polyvec", "embed", str(texts), "--quiet", "--output", str(out), "--dtype", "float32"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "embedded 3 texts" in result.stdout and np.load(out).shape == (3, 384)


def test_engine_settings_of_the_wrong_type_are_refused(minilm_path):
    """max_model_len=True kept one token, max_num_batched_tokens=0 silently meant the default, a callable
    hf_overrides failed as "not iterable", a NaN sparse_threshold gave empty vectors."""
    for kwargs, message in [
        ({"max_model_len": True}, "max_model_len must be a positive integer, got True"),
        ({"max_model_len": "1k"}, "max_model_len must be a positive integer, got '1k'"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be a positive integer, got 0"),
        ({"hf_overrides": lambda config: config}, "hf_overrides must be a dict of config fields, got function"),
    ]:
        with pytest.raises(ValueError, match=message):
            LLM(str(minilm_path), **kwargs)
    with pytest.raises(ValueError, match="sparse_threshold must be a non-negative number, got nan"):
        PoolingParams(sparse_threshold=float("nan")).verify("embed_sparse", LLM(str(minilm_path)).model_config,
                                                            ("embed_sparse",))  # fmt: skip


def test_vllm_keywords_lora_request_and_integer_settings(minilm_llm):
    """vLLM code passes lora_request=None to every pooling call: accepted; an adapter is refused by name. A
    setting of the wrong type is refused by name (a str max_num_seqs failed in a comparison naming nothing)."""
    import pytest

    from polyvec.config import EngineConfig

    want = minilm_llm.embed(["wing flutter"], use_tqdm=False)[0].outputs.embedding
    assert minilm_llm.embed(["wing flutter"], lora_request=None, use_tqdm=False)[0].outputs.embedding == want
    assert minilm_llm.score("a", ["b"], lora_request=None, use_tqdm=False)[0].outputs.score > -1
    for call in (minilm_llm.embed, minilm_llm.encode, minilm_llm.token_embed):
        with pytest.raises(ValueError, match="lora_request is not supported"):
            call(["x"], lora_request=object(), use_tqdm=False)
    for name, value in (("max_num_seqs", "4"), ("max_num_batched_tokens", 512.0), ("num_threads", True)):
        with pytest.raises(ValueError, match=f"{name} must be an integer, got {value!r}"):
            EngineConfig(**{name: value})


def test_calls_on_one_llm_interleave_and_failures_leave_nothing_queued(minilm_path):
    """Another call on the same LLM while an iter_encode stream is open runs the stream's queued requests too:
    their outputs wait for the stream (it spun for ever on outputs the other call had thrown away). A progress
    bar that fails to start leaves nothing queued (the requests went in before it)."""
    llm = LLM(str(minilm_path), dtype="float32", max_num_seqs=2)
    texts = [f"passage {i} about wing flutter" for i in range(12)]
    want = [o.outputs.data for o in llm.embed(texts, use_tqdm=False)]
    it = llm.iter_encode(iter(texts), max_in_flight=10)
    other = llm.iter_encode(iter(texts[::-1]), max_in_flight=4)
    got = [next(it).outputs.data, next(other).outputs.data]
    assert llm.embed("query", use_tqdm=False)[0].outputs.data.shape == (384,)  # runs the streams' requests too
    got += [o.outputs.data for o in it] + [o.outputs.data for o in other]
    for g, w in zip(got[:1] + got[2:13], want):
        assert torch.allclose(g, w, atol=1e-6)
    for g, w in zip([got[1]] + got[13:], want[::-1]):
        assert torch.allclose(g, w, atol=1e-6)
    assert not llm.engine.has_unfinished_requests() and not llm._finished

    def bar(total):  # not tqdm's signature
        return None

    with pytest.raises(TypeError, match="desc"):
        llm.embed(["a", "b"], use_tqdm=bar)
    assert not llm.engine.has_unfinished_requests()
    assert [len(o.prompt_token_ids) for o in llm.iter_encode("hello")] == [3]  # one prompt, not its characters
    assert [o.prompt_token_ids for o in llm.iter_encode([101, 7592, 102])] == [[101, 7592, 102]]  # token ids: one
    with pytest.raises(TypeError, match="prompt 5 must be a string"):  # counted over the whole stream
        list(llm.iter_encode(iter(["a", "b", "c", "d", "e", 7]), max_in_flight=4))
    assert not llm.engine.has_unfinished_requests() and not llm._finished


def test_score_takes_tokenization_kwargs_and_one_pooling_params(minilm_llm):
    """vLLM's LLM.score(..., tokenization_kwargs=...) (a TypeError); a list of PoolingParams is refused by name."""
    cut = minilm_llm.score("a b c d e", ["f g h i j"], tokenization_kwargs={"truncation": True, "max_length": 3})
    q, d = (minilm_llm.embed(t, truncate_prompt_tokens=3, use_tqdm=False)[0] for t in ("a b c d e", "f g h i j"))
    want = torch.nn.functional.cosine_similarity(q.outputs.data, d.outputs.data, dim=0).item()
    assert cut[0].outputs.score == pytest.approx(want, abs=1e-5) and len(cut[0].prompt_token_ids) == 3 + 1 + 3
    with pytest.raises(TypeError, match="score\\(\\) takes one PoolingParams for every pair, not list"):
        minilm_llm.score("a", ["b"], pooling_params=[PoolingParams()])


def test_do_lower_case_of_tokenization_kwargs_overrides_the_models(tmp_path, minilm_path):
    """vLLM's tokenization_kwargs do_lower_case lowercases texts before tokenizing (or, false, leaves a lowercasing
    model's texts alone); it was ignored with a warning. A tokenizer without a lowercasing normalizer makes it
    visible: "Hello" is [UNK] in MiniLM's lowercase vocabulary."""
    import json
    import shutil

    folder = tmp_path / "cased"
    shutil.copytree(minilm_path, folder, ignore=shutil.ignore_patterns("model.safetensors"))
    (folder / "model.safetensors").symlink_to(minilm_path / "model.safetensors")
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok["normalizer"]["lowercase"] = False
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    config = json.loads((folder / "tokenizer_config.json").read_text())  # transformers' BERT reads this one
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "do_lower_case": False}))
    llm = LLM(str(folder), dtype="float32")
    assert llm.embed("Hello", use_tqdm=False)[0].prompt_token_ids == [101, 100, 102]
    lower = llm.embed(["Hello"], tokenization_kwargs={"do_lower_case": True}, use_tqdm=False)
    assert lower[0].prompt_token_ids == [101, 7592, 102]
    assert torch.equal(lower[0].outputs.data, llm.embed("hello", use_tqdm=False)[0].outputs.data)
    cfg = json.loads((folder / "sentence_bert_config.json").read_text())
    (folder / "sentence_bert_config.json").write_text(json.dumps({**cfg, "do_lower_case": True}))
    lowering = LLM(str(folder), dtype="float32")
    assert lowering.embed("Hello", use_tqdm=False)[0].prompt_token_ids == [101, 7592, 102]
    kept = lowering.embed("Hello", tokenization_kwargs={"do_lower_case": False}, use_tqdm=False)[0]
    assert kept.prompt_token_ids == [101, 100, 102]
    # include_prompt false: the prompt left out of pooling is counted lowercased too, as sentence-transformers
    # counts it (its cased length, 4 tokens, was left out where the lowercased prompt has 8)
    from sentence_transformers import SentenceTransformer

    pooling = json.loads((folder / "1_Pooling" / "config.json").read_text())
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({**pooling, "include_prompt": False}))
    (folder / "config_sentence_transformers.json").write_text(json.dumps({"prompts": {"query": "Xylophonist query: "}}))
    st = SentenceTransformer(str(folder), device="cpu")  # do_lower_case read from sentence_bert_config.json
    want = torch.as_tensor(st.encode(["what is a wing"], prompt_name="query"))
    (folder / "sentence_bert_config.json").write_text(json.dumps(cfg))  # here: the call's do_lower_case instead
    prompted = LLM(str(folder), dtype="float32")
    got = prompted.embed(["what is a wing"], PoolingParams(input_type="query"),
                         tokenization_kwargs={"do_lower_case": True}, use_tqdm=False)[0]  # fmt: skip
    assert got.prompt_token_ids == st.tokenize(["xylophonist query: what is a wing"])["input_ids"][0].tolist()
    assert torch.nn.functional.cosine_similarity(got.outputs.data, want[0], dim=0) >= 0.9999


def test_calls_from_several_threads_share_one_llm(minilm_path):
    """Two threads' calls on one LLM failed ('requests of this call were lost'): a call counted only what its
    own steps finished, and two steps could run at once. One step at a time now, and each call takes its
    outputs from the mailbox whoever's step finished them; every result equals the call made alone."""
    import threading

    from polyvec import LLM

    llm = LLM(str(minilm_path), dtype="float32", max_num_seqs=2)  # many small steps: calls interleave
    big = [f"doc {i} " + "word " * (i % 50) for i in range(200)]
    small = ["hello", "a wing in a slipstream", "heat"]
    want_big = torch.stack([o.outputs.data for o in llm.embed(big, use_tqdm=False)])
    want_small = [o.outputs.data for o in llm.token_embed(small, use_tqdm=False)]
    want_scores = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
    errors: list[BaseException] = []
    got: dict[str, Any] = {}

    def run(name: str, call) -> None:
        try:
            got[name] = call()
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    calls = {
        "big": lambda: torch.stack([o.outputs.data for o in llm.embed(big, use_tqdm=False)]),
        **{f"small{i}": lambda: [o.outputs.data for o in llm.token_embed(small, use_tqdm=False)] for i in range(6)},
        "score": lambda: [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)],
        "iter": lambda: [o.outputs.data for o in llm.iter_encode(small, max_in_flight=2, pooling_task="token_embed")],
    }
    threads = [threading.Thread(target=run, args=item) for item in calls.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert torch.allclose(got["big"], want_big, atol=1e-6)
    for name in (*(f"small{i}" for i in range(6)), "iter"):
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got[name], want_small, strict=True)), name
    assert got["score"] == pytest.approx(want_scores, abs=1e-6)


def test_iter_encode_names_a_bad_prompt_by_its_place_in_the_input(minilm_path):
    from polyvec import LLM

    llm = LLM(str(minilm_path), dtype="float32", truncation="error")
    bad = [f"text {i}" for i in range(7)] + ["word " * 600] + ["x"] * 3
    with pytest.raises(ValueError, match="^prompt 7 has 602 tokens"):
        list(llm.iter_encode(bad, max_in_flight=4))


def test_score_names_a_bad_item_by_its_side(minilm_llm):
    """A non-prompt item was named by its place in the joined list of both sides ('prompt 2' for data_2's
    second item); a side that is no text nor list failed as 'float object is not iterable'."""
    with pytest.raises(TypeError, match="^data_2 item 1 must be a string"):
        minilm_llm.score(QUERY, [DOCS[0], 5], use_tqdm=False)
    with pytest.raises(TypeError, match="^data_1 must be a text, a prompt or a list of them, not float"):
        minilm_llm.score(3.5, DOCS, use_tqdm=False)
    scores = minilm_llm.score(QUERY, (d for d in DOCS), use_tqdm=False)  # any iterable side, read once
    assert len(scores) == len(DOCS)
