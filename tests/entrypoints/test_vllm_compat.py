"""vLLM's command lines, `LLM(...)` arguments, `PoolerConfig` and `tokenization_kwargs` (vLLM 0.34's names and
meanings), as a user who pastes them from vLLM's documentation meets them."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch

from polyvec import LLM, PoolerConfig
from polyvec.entrypoints.cli import CommandError, build_parser, main, vllm_options
from polyvec.entrypoints.vllm_compat import check, expand_dotted, vllm_argv
from tests.conftest import MINILM
from tests.helpers import cosine_rows

QUERY = "what similarity laws must be obeyed when constructing aeroelastic models"


def parse(*argv: str):
    return build_parser().parse_args(expand_dotted(["serve", MINILM, *argv]))


def test_dotted_json_options_fold_into_one_object():
    argv = ["--pooler-config.task", "embed", "--pooler-config.seq_pooling_type=CLS", "--hf-overrides.a.b", "[1, 2]"]
    out = expand_dotted(["serve", "m", *argv, "--pooler-config", '{"use_activation": false}'])
    assert out[:2] == ["serve", "m"]
    folded = {out[i]: json.loads(out[i + 1]) for i in range(2, len(out), 2)}
    assert folded["--pooler-config"] == {"task": "embed", "seq_pooling_type": "CLS", "use_activation": False}
    assert folded["--hf-overrides"] == {"a": {"b": [1, 2]}}
    with pytest.raises(ValueError, match="--pooler-config is not valid JSON"):
        expand_dotted(["--pooler-config", "{task: embed}"])


def test_a_json_flag_from_its_environment_variable_is_named_so(monkeypatch):
    """A bad JSON value set in POLYVEC_POOLER_CONFIG was reported as --pooler-config's alone, a flag the command
    line did not have."""
    from polyvec.entrypoints.vllm_compat import json_arg

    monkeypatch.setenv("POLYVEC_POOLER_CONFIG", "{bad")
    with pytest.raises(ValueError, match=r"^--pooler-config \(from POLYVEC_POOLER_CONFIG\) is not valid JSON"):
        json_arg("pooler_config", "{bad")
    with pytest.raises(ValueError, match=r"^--pooler-config is not valid JSON"):  # the command line's own value
        json_arg("pooler_config", "{worse")
    monkeypatch.setenv("POLYVEC_HF_OVERRIDES", "[1]")
    with pytest.raises(ValueError, match=r"^--hf-overrides \(from POLYVEC_HF_OVERRIDES\) must be a JSON object"):
        json_arg("hf_overrides", "[1]")


def test_a_pasted_vllm_command_line_parses_and_warns_once(caplog):
    args = parse(
        "--runner", "pooling", "--convert", "auto", "--dtype", "half", "--trust-remote-code",
        "--gpu-memory-utilization", "0.3", "--enforce-eager", "--seed", "0", "--max-model-len", "256",
        "--served-model-name", "mini", "--tensor-parallel-size", "1", "--disable-log-stats",
        "--hf-overrides", '{"matryoshka_dimensions": [128, 256]}', "--pooler-config.seq_pooling_type", "CLS",
        "--uvicorn-log-level", "warning", "--enable-request-id-headers",
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="polyvec"):
        options = vllm_options(args)
    assert options["hf_overrides"] == {"matryoshka_dimensions": [128, 256]}
    assert options["pooler_config"] == PoolerConfig(seq_pooling_type="CLS")
    assert args.dtype == "half" and args.enforce_eager and args.enable_request_id_headers
    warned = [r.getMessage() for r in caplog.records if "no effect" in r.getMessage()]
    assert len(warned) == 1
    for flag in ("--trust-remote-code", "--gpu-memory-utilization", "--seed", "--disable-log-stats"):
        assert flag in warned[0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-tp", "2"], "tensor_parallel_size=2 is not supported"),
        (["--pipeline-parallel-size", "2"], "pipeline_parallel_size=2 is not supported"),
        (["--runner", "generate"], "polyvec runs pooling models only"),
        (["--ssl-keyfile", "k.pem"], "terminate TLS in a proxy"),
        (["--pooler-config", '{"normalize": true}'], "Parameter `normalize` was removed; use `use_activation`"),
        (["--pooler-config", '{"pooling": "CLS"}'], "unknown pooler config field(s): pooling"),
        (["--pooler-config.task", "score"], "`score` task was removed; use classify instead."),
        (["--hf-overrides", "[1]"], "--hf-overrides must be a JSON object"),
        (["--task", "generate"], "task='generate' is not supported: polyvec runs pooling models only"),
        (["--task", "score", "--pooler-config.task", "embed"], "task='score' and pooler_config task='embed' disagree"),
        (["--task", "embed", "--convert", "classify"], "task='embed' and convert='classify' disagree"),
        (["--disable-sliding-window"], "disable_sliding_window is not supported: polyvec applies the model's"),
    ],
)
def test_flags_that_would_change_results_are_refused(argv, message):
    with pytest.raises(
        (CommandError, ValueError), match=message.replace("(", r"\(").replace(")", r"\)").replace("`", ".")
    ):
        vllm_options(parse(*argv))


def test_multimodal_flags_of_a_vllm_command_line():
    args = parse(
        "--limit-mm-per-prompt.image", "1", "--mm-processor-kwargs", '{"max_pixels": 602112}',
        "--mm-processor-kwargs.min_pixels", "3136", "--allowed-media-domains", "example.com", "img.example.org",
        "--max-image-pixels", "1000000", "--max-request-image-pixels", "0",
    )  # fmt: skip
    options = vllm_options(args)
    assert options["limit_mm_per_prompt"] == {"image": 1}
    assert options["mm_processor_kwargs"] == {"max_pixels": 602112, "min_pixels": 3136}
    assert options["allowed_media_domains"] == ["example.com", "img.example.org"]
    assert options["max_image_pixels"] == 1_000_000 and args.max_request_image_pixels == 0
    defaults = vllm_options(parse())
    assert defaults["allowed_media_domains"] is None and defaults["limit_mm_per_prompt"] is None
    assert defaults["max_image_pixels"] == 50_000_000 and parse().max_request_image_pixels == 256_000_000
    with pytest.raises((CommandError, ValueError), match="--limit-mm-per-prompt must be a JSON object"):
        vllm_options(parse("--limit-mm-per-prompt", "2"))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gpu-memory-utilization", "abc"], "argument --gpu-memory-utilization: invalid float value: 'abc'"),
        (["--seed", "1.5"], "argument --seed: invalid int value: '1.5'"),
        (["--gpu-memory-utilization", "5"], "gpu_memory_utilization must be in (0, 1], got 5.0"),
    ],
)
def test_malformed_values_of_flags_with_no_effect_are_refused(capsys, argv, message):
    """vLLM parses these flags and refuses a malformed value; polyvec ignores them, but not their errors."""
    try:
        vllm_options(parse(*argv))
    except SystemExit as exc:  # argparse: the one line on stderr, exit 2
        assert exc.code == 2 and message in capsys.readouterr().err
    except (CommandError, ValueError) as exc:
        assert message in str(exc)
    else:
        raise AssertionError(f"{argv} was accepted")
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\], got 5.0"):
        check({"gpu_memory_utilization": 5.0})
    with pytest.raises(ValueError, match="seed must be an integer, got '3'"):
        check({"seed": "3"})
    assert check({"gpu_memory_utilization": 0.3, "seed": 0}) == ["gpu_memory_utilization", "seed"]


def test_vllm_spellings_of_a_command_line(capsys):
    """vLLM's parser reads `--max_model_len` as `--max-model-len`, `-O3` as `--optimization-level 3` and
    `serve --model M` as `serve M`; no flag is read as a longer one it prefixes (`--model` is not `--model-impl`)."""
    argv, moved = vllm_argv(["serve", "--max_model_len", "128", "--model", MINILM, "-O3", "--hf_overrides.a_b=1"])
    assert moved and argv == ["serve", MINILM, "--max-model-len", "128", "--optimization-level", "3",
                              "--hf-overrides.a_b=1"]  # fmt: skip
    args = build_parser().parse_args(expand_dotted(argv))
    assert args.model == MINILM and args.max_model_len == 128 and json.loads(args.hf_overrides) == {"a_b": 1}
    assert "optimization_level" in check(vars(args))  # named in the no-effect warning
    for spelling in (["-O", "2"], ["-O=2"], ["--optimization_level", "2"]):
        assert build_parser().parse_args(vllm_argv(["serve", MINILM, *spelling])[0]).optimization_level == "2"
    assert vllm_argv(["serve", "--model=m"]) == (["serve", "m"], True)
    assert vllm_argv(["embed", "f.jsonl", "--model", "m"]) == (["embed", "f.jsonl", "--model", "m"], False)
    for argv in (["serve", MINILM, "--model-imp", "x"], ["serve", MINILM, "--max-model", "5"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
        assert "unrecognized arguments" in capsys.readouterr().err
    code = main(["serve", "--model", "/nonexistent/model", "--port", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "--model is vLLM's deprecated form" in err and "'/nonexistent/model' is not a folder" in err


def test_more_of_vllm_034s_flags(monkeypatch, caplog):
    """Flags of vLLM 0.34's `vllm serve` that stopped a pasted command line ("unrecognized arguments", or a value
    refused): accepted with no effect and named in the warning, or read as vLLM reads them."""
    monkeypatch.setenv("HF_TOKEN", "before")  # undone after the test, whatever the code sets
    args = parse(
        "--max-model-len", "auto", "--kv-cache-memory-bytes", "4G", "--hf-token", "hf_x", "--config-format", "hf",
        "--generation-config", "auto", "--max-logprobs", "5", "--enable-log-outputs", "--response-role", "x",
        "--middleware", "m.M", "--no-enable-flash-late-interaction",
        "--pooler-config.enable_flash_late_interaction", "false",
    )  # fmt: skip
    assert args.max_model_len is None and args.kv_cache_memory_bytes == 4 << 30
    with caplog.at_level(logging.WARNING, logger="polyvec"):
        options = vllm_options(args)
    assert options["pooler_config"] == PoolerConfig(enable_flash_late_interaction=False)
    import os

    assert os.environ["HF_TOKEN"] == "hf_x"
    warned = next(r.getMessage() for r in caplog.records if "no effect" in r.getMessage())
    for flag in ("--config-format", "--generation-config", "--max-logprobs", "--middleware", "--response-role"):
        assert flag in warned, flag
    assert parse("--max-model-len", "-1").max_model_len is None and parse("--hf-token").hf_token is True


def test_llm_max_model_len_auto(minilm_path):
    assert LLM(str(minilm_path), max_model_len=-1).model_config.max_model_len == 256  # vLLM's auto: the model's


def test_check_returns_only_given_flags():
    assert check({"seed": None, "trust_remote_code": False, "tensor_parallel_size": 1}) == []
    assert check({"seed": 3, "trust_remote_code": True}) == ["trust_remote_code", "seed"]


def test_pooler_config_fields_of_vllm_034():
    assert PoolerConfig(pooling_type="cls").seq_pooling_type == "CLS"
    assert PoolerConfig(pooling_type="ALL").tok_pooling_type == "ALL"
    with pytest.raises(ValueError, match="Cannot set both `pooling_type` and `seq_pooling_type`"):
        PoolerConfig(pooling_type="CLS", seq_pooling_type="MEAN")
    with pytest.raises(ValueError, match="seq_pooling_type='ALL' is not valid"):
        PoolerConfig(seq_pooling_type="ALL")
    with pytest.raises(ValueError, match="task='rerank' is not valid"):
        PoolerConfig(task="rerank")
    with pytest.raises(ValueError, match="max_embed_len must be a positive integer"):
        PoolerConfig(max_embed_len=0)
    args = parse("--pooler-config.logit_mean", "0.5", "--pooler-config.logit_sigma", "2")
    assert vllm_options(args)["pooler_config"] == PoolerConfig(logit_mean=0.5, logit_sigma=2)
    with pytest.raises(ValueError, match="logit_sigma cannot be 0"):
        PoolerConfig(logit_sigma=0.0)
    with pytest.raises(ValueError, match="logit_mean must be a finite number, got 'x'"):
        PoolerConfig(logit_mean="x")  # type: ignore[arg-type]


def test_llm_takes_pooler_config_as_vllm_does(minilm_path, minilm_llm):
    cls = LLM(str(minilm_path), dtype="float32", pooler_config={"seq_pooling_type": "CLS", "task": "embed"})
    hidden = minilm_llm.token_embed(QUERY, PoolingParams_no_activation(), use_tqdm=False)[0].outputs.data
    got = cls.encode(QUERY, use_tqdm=False)[0].outputs.data  # the instance task, embed, with CLS pooling
    assert got.shape == (384,)
    assert cosine_rows(got[None], torch.nn.functional.normalize(hidden[:1], dim=-1)).item() >= 0.9999
    with pytest.raises(ValueError, match="Unsupported task: 'classify'"):
        LLM(str(minilm_path), dtype="float32", pooler_config={"task": "classify"})


def test_vllms_old_task_argument_means_what_it_meant(minilm_path, minilm_llm, caplog):
    """`task=` (vLLM before runner/convert): the task of a request naming none, and for classify or score a
    classifier (convert), not an argument with no effect."""
    with caplog.at_level(logging.WARNING, logger="polyvec"):
        llm = LLM(str(minilm_path), dtype="float32", task="embed")
    assert any("deprecated form of pooler_config task='embed'" in r.getMessage() for r in caplog.records)
    got = llm.encode(QUERY, use_tqdm=False)[0].outputs.data  # embed, where a model's own default is token_embed
    assert got.shape == (384,) and minilm_llm.encode(QUERY, use_tqdm=False)[0].outputs.data.ndim == 2
    assert torch.allclose(got, minilm_llm.embed(QUERY, use_tqdm=False)[0].outputs.data, atol=1e-5)
    with pytest.raises(ValueError, match="convert='classify' needs a causal LM or sequence classifier checkpoint"):
        LLM(str(minilm_path), dtype="float32", task="score")  # a classifier asked of an embedding model
    args = parse("--task", "embedding", "--pooler-config.seq_pooling_type", "CLS")
    assert vllm_options(args)["pooler_config"] == PoolerConfig(seq_pooling_type="CLS", task="embed")
    args = parse("--task", "classify")
    assert vllm_options(args)["pooler_config"] == PoolerConfig(task="classify") and args.convert == "classify"


def PoolingParams_no_activation():
    from polyvec import PoolingParams

    return PoolingParams(use_activation=False)


def test_chunked_processing_is_windows_and_max_embed_len_caps_input(minilm_path, minilm_llm):
    long_text = " ".join(["aeroelastic flutter of a swept wing"] * 80)  # ~480 tokens, over max_model_len 256
    llm = LLM(str(minilm_path), dtype="float32", pooler_config={"enable_chunked_processing": True})
    assert llm.engine.engine_config.long_input == "window"
    out = llm.embed(long_text, use_tqdm=False)[0]
    assert out.num_input_tokens > 256 == minilm_llm.model_config.max_model_len
    capped = LLM(
        str(minilm_path), dtype="float32", pooler_config={"enable_chunked_processing": True, "max_embed_len": 300}
    )
    with pytest.raises(ValueError, match="300"):
        capped.embed(long_text, use_tqdm=False)


def test_tokenization_kwargs_of_vllm_034(minilm_llm):
    ids = minilm_llm.embed(QUERY, use_tqdm=False)[0].prompt_token_ids
    cut = minilm_llm.embed(QUERY, tokenization_kwargs={"truncate_prompt_tokens": 5}, use_tqdm=False)[0]
    assert cut.prompt_token_ids[:4] == ids[:4] and len(cut.prompt_token_ids) == 5
    whole = minilm_llm.embed(QUERY, tokenization_kwargs={"truncate_prompt_tokens": -1}, use_tqdm=False)[0]
    assert whole.prompt_token_ids == ids
    bare = minilm_llm.embed(QUERY, tokenization_kwargs={"add_special_tokens": False}, use_tqdm=False)[0]
    assert bare.prompt_token_ids == ids[1:-1]
    kwargs = {"truncate_prompt_tokens": 5, "truncation_side": "left"}
    left = minilm_llm.embed(QUERY, tokenization_kwargs=kwargs, use_tqdm=False)[0]
    assert left.prompt_token_ids == [ids[0], *ids[-4:]]
    with pytest.raises(ValueError, match="truncation_side must be 'left' or 'right'"):
        minilm_llm.embed(QUERY, tokenization_kwargs={"truncation_side": "up"}, use_tqdm=False)


def test_model_config_names_of_vllm(minilm_path, minilm_llm):
    assert minilm_llm.model_config.embedding_size == 384
    half = LLM(str(minilm_path), dtype="half", tokenizer=str(minilm_path))
    assert half.model_config.dtype == torch.float16
    with pytest.raises(ValueError, match="no tokenizer.json"):
        LLM(str(minilm_path), tokenizer=str(minilm_path / "1_Pooling"))


def test_multi_modal_data_is_refused_not_dropped(minilm_llm):
    with pytest.raises(ValueError, match="prompt 1 carries multi_modal_data"):
        minilm_llm.embed(["a", {"prompt": "b", "multi_modal_data": {"image": object()}}], use_tqdm=False)


def test_late_chunking_pools_spans_of_the_whole_document(minilm_llm, cranfield_texts):
    """vLLM 0.34's late chunking: contextual token vectors (special tokens included) mean-pooled per span of
    chunk_size tokens, then normalized; each chunk knows its token and character span."""
    from polyvec import LateChunkingParams, PoolingParams

    text = next(t for t in cranfield_texts if 60 < len(t.split()) < 150)  # under max_model_len (256 tokens)
    params = PoolingParams(late_chunking_params=LateChunkingParams(chunk_size=16))
    out = minilm_llm.encode(text, params, pooling_task="token_embed", use_tqdm=False)[0]
    raw = minilm_llm.token_embed(text, PoolingParams(use_activation=False), use_tqdm=False)[0].outputs.data
    want = torch.nn.functional.normalize(torch.stack([p.mean(0) for p in raw.split(16)]), dim=-1)
    assert out.outputs.data.shape == want.shape and torch.allclose(out.outputs.data, want, atol=1e-6)
    meta = out.late_chunking
    assert meta.chunk_size == 16 and meta.input_tokens == raw.shape[0] == len(out.prompt_token_ids)
    assert [c.token_range for c in meta.chunks][:2] == [(0, 16), (16, 32)]
    first = meta.chunks[0].char_range
    assert first[0] == 0 and text[first[0] : first[1]].split()[0] == text.split()[0]
    plain = minilm_llm.encode(
        text,
        PoolingParams(use_activation=False, late_chunking_params=LateChunkingParams(chunk_size=16)),
        pooling_task="token_embed",
        use_tqdm=False,
    )[0]
    assert torch.allclose(plain.outputs.data, torch.stack([p.mean(0) for p in raw.split(16)]), atol=1e-6)
    assert params.late_chunking_params is not None and params.use_activation is None  # the caller's, untouched
    # normalize=False as use_activation=False (it was ignored, and normalize=True refused as a conflict)
    for spelled, unit in (({"normalize": False}, False), ({"normalize": True}, True)):
        got = minilm_llm.token_embed(text, PoolingParams(**spelled, late_chunking_params=LateChunkingParams(16)),
                                     use_tqdm=False)[0].outputs.data  # fmt: skip
        assert torch.allclose(got, want if unit else plain.outputs.data, atol=1e-6)
    with pytest.raises(ValueError, match="late chunking needs the whole document's tokens"):
        next(minilm_llm.iter_encode([text], params, pooling_task="token_embed"))  # it ignored the chunking
    with pytest.raises(ValueError, match="return_tokens applies to embed_sparse"):
        minilm_llm.encode(text, PoolingParams(return_tokens=True), pooling_task="token_embed", use_tqdm=False)
    # a special-token-only chunk has no characters: chunk_size 1 puts [CLS] alone
    single = minilm_llm.encode(
        "wing", PoolingParams(late_chunking_params=LateChunkingParams(1)), pooling_task="token_embed", use_tqdm=False
    )[0]
    assert [c.char_range for c in single.late_chunking.chunks] == [None, (0, 4), None]
    lc = PoolingParams(late_chunking_params=LateChunkingParams(4))
    for bad, prompt, task, message in [
        (lc, text, "embed", "Late chunking requires token_embed"),
        # dimensions as for any token_embed request (refused as "dimension reduction" before, whatever the model)
        (dataclasses.replace(lc, dimensions=8), text, "token_embed", "dimensions=8 is not allowed"),
        (dataclasses.replace(lc, truncate_prompt_tokens=8), text, "token_embed", "truncation"),
        (lc, [101, 102], "token_embed", "plain-text input"),
        (lc, "", "token_embed", "nonempty plain-text"),
        (dataclasses.replace(lc, step_tag_id=1010), text, "token_embed", "requires all token rows"),
        (dataclasses.replace(lc, long_input="window"), text, "token_embed", "no long_input windows"),
        (PoolingParams(late_chunking_params={"chunk_size": 4}), text, "token_embed", "must be LateChunkingParams"),
        (lc, "wing " * 400, "token_embed", "402 tokens, more than max_model_len=256: late chunking reads the whole"),
    ]:
        with pytest.raises(ValueError, match=message):
            minilm_llm.encode(prompt, bad, pooling_task=task, use_tqdm=False)
    with pytest.raises(ValueError, match="chunk_size must be a positive integer"):
        LateChunkingParams(chunk_size=True)
    assert not minilm_llm.engine.has_unfinished_requests()


def test_error_messages_carry_vllms_key_words(minilm_path, minilm_llm):
    """What vLLM users' code and tests match on, beside polyvec's own wording."""
    with pytest.raises(ValueError, match="Unsupported task: 'classify'"):
        minilm_llm.classify(QUERY, use_tqdm=False)
    with pytest.raises(ValueError, match="token id 99999 is out of vocabulary") as caught:
        minilm_llm.embed([[101, 99999, 102]], use_tqdm=False)
    assert "ids of another tokenizer, such as tiktoken's? send the texts" in str(caught.value)  # LangChain's
    strict = LLM(str(minilm_path), dtype="float32", truncation="error")
    with pytest.raises(ValueError, match="maximum context length"):
        strict.embed("wing " * 400, use_tqdm=False)


def test_embed_follows_a_token_embed_pooling_task(minilm_path, minilm_llm, pylate_model):
    """vLLM 0.34's `LLM.embed` runs the model's pooling task: token matrices for a ColBERT model or
    `PoolerConfig(task="token_embed")` (it was a TaskError, or one vector), and `score` is then MaxSim."""
    colbert = LLM(str(pylate_model[1]), dtype="float32")
    (out,) = colbert.embed(["a wing in a slipstream"], use_tqdm=False)
    want = colbert.token_embed(["a wing in a slipstream"], use_tqdm=False)[0].outputs.data
    assert out.outputs.data.dim() == 2 and torch.equal(out.outputs.data, want)
    tokens = LLM(str(minilm_path), dtype="float32", pooler_config=PoolerConfig(task="token_embed"))
    (out,) = tokens.embed(["flutter of a wing"], use_tqdm=False)
    assert out.outputs.data.shape == (len(out.prompt_token_ids), 384)
    (score,) = tokens.score("wing flutter", ["flutter of a wing"], use_tqdm=False)
    q = tokens.token_embed(["wing flutter"], use_tqdm=False)[0].outputs.data
    assert abs(score.outputs.score - float((q @ out.outputs.data.T).max(dim=1).values.sum())) < 1e-4  # MaxSim
    assert minilm_llm.embed(["flutter"], use_tqdm=False)[0].outputs.data.dim() == 1  # an embed model: one vector


def test_score_caps_from_extra_kwargs_offline(minilm_llm):
    """vLLM 0.34 reads max_tokens_per_query / _per_doc offline from PoolingParams.extra_kwargs (ignored before)."""
    from polyvec import PoolingParams

    capped = PoolingParams(extra_kwargs={"max_tokens_per_query": 1, "max_tokens_per_doc": 2})
    (got,) = minilm_llm.score("wing flutter analysis", ["heat transfer in a boundary layer"], pooling_params=capped,
                              use_tqdm=False)  # fmt: skip
    (want,) = minilm_llm.score("wing", ["heat transfer"], use_tqdm=False)
    assert abs(got.outputs.score - want.outputs.score) < 1e-6
    with pytest.raises(ValueError, match=r"max_tokens_per_doc \(256\) must be less than max_model_len \(256\)"):
        minilm_llm.score("a", "b", pooling_params=PoolingParams(extra_kwargs={"max_tokens_per_doc": 256}))


def test_offline_api_details_of_vllm_034(minilm_path, tmp_path):
    """PoolingParams' first positional field is use_activation and clone() is deep; LateChunkingParams bounds
    chunk_size and refuses blank text; TokensPrompt / TextPrompt import from polyvec; LLM() takes vLLM's other
    offline keywords (a warning when set)."""
    from polyvec import LateChunkingParams, PoolingParams, TextPrompt, TokensPrompt

    p = PoolingParams(False, 8)
    assert p.use_activation is False and p.dimensions == 8
    q = PoolingParams(extra_kwargs={"a": [1]})
    q.clone().extra_kwargs["a"].append(2)
    assert q.extra_kwargs == {"a": [1]}
    with pytest.raises(ValueError, match="less than 2\\*\\*63"):
        LateChunkingParams(2**64)
    llm = LLM(str(minilm_path), dtype="float32", skip_tokenizer_init=False, hf_token=None, attention_config=None,
              enable_extensible_kv_cache=None, quantization_config=None, allowed_local_media_path="")  # fmt: skip
    late = PoolingParams(late_chunking_params=LateChunkingParams(4))
    # whitespace is text, as in vLLM: [CLS] [SEP], one chunk without characters (it was refused)
    (blank,) = llm.encode("   ", late, pooling_task="token_embed", use_tqdm=False)
    assert blank.outputs.data.shape == (1, 384) and blank.late_chunking.strategy == "fixed_tokens"
    assert [c.char_range for c in blank.late_chunking.chunks] == [None]
    with pytest.raises(ValueError, match="no tokens"):  # without special tokens it has none
        llm.encode("   ", late, pooling_task="token_embed", tokenization_kwargs={"add_special_tokens": False})
    # a model's default instruction prompt would shift every chunk off its text: refused by name (it failed as
    # "a fast tokenizer with offsets aligned" on a fast tokenizer)
    import shutil

    prompted = shutil.copytree(minilm_path, tmp_path / "prompted")
    (prompted / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": {"query": "query: ", "document": ""}, "default_prompt_name": "query"})
    )
    with pytest.raises(ValueError, match="Late chunking does not support an instruction prompt"):
        LLM(str(prompted), dtype="float32").encode("wing flutter", late, pooling_task="token_embed")
    for kwargs in ({"truncation": True}, {"padding": True}, {"do_lower_case": True}, {"pad_prompt_tokens": 8}):
        with pytest.raises(ValueError, match="does not support input padding, truncation"):  # they were ignored
            llm.encode("abc", late, pooling_task="token_embed", tokenization_kwargs=kwargs)
    # tokenization_kwargs padding="max_length" pads as vLLM does (it was ignored with a warning)
    (padded,) = llm.embed("wing", tokenization_kwargs={"padding": "max_length", "max_length": 8, "truncation": True})
    assert padded.prompt_token_ids == [101, 3358, 102, 0, 0, 0, 0, 0]
    # max_length is the padded length without truncation too (it padded up to max_model_len, 256)
    (padded,) = llm.embed("wing", tokenization_kwargs={"padding": "max_length", "max_length": 6}, use_tqdm=False)
    assert padded.prompt_token_ids == [101, 3358, 102, 0, 0, 0]
    outs = llm.embed([TextPrompt(prompt="wing"), TokensPrompt(prompt_token_ids=[101, 3358, 102])], use_tqdm=False)
    assert torch.allclose(outs[0].outputs.data, outs[1].outputs.data, atol=1e-6)


def test_chat_template_flag_and_special_tokens(tmp_path, minilm_path, capsys):
    """A --chat-template that looks like a path and is not there stops the server (it became the template's
    text); the template's special tokens include special_tokens_map.json's, as transformers reads them."""
    from types import SimpleNamespace

    from polyvec.entrypoints.server.serving import ServerState

    code = main(["serve", str(minilm_path), "--chat-template", str(tmp_path / "nope.jinja")])
    assert code == 2 and "looks like a file path, but it cannot be read" in capsys.readouterr().err
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|end|>"}}))
    state = SimpleNamespace(
        model_config=SimpleNamespace(tokenizer_path=tmp_path / "tokenizer.json"), _special_tokens=None
    )
    # special_tokens_map.json's win where both name one, as transformers 5 loads them
    assert ServerState.special_tokens(state) == {"bos_token": "<s>", "eos_token": "</s>"}  # type: ignore[arg-type]


def test_late_chunking_on_a_colbert_model_is_refused_by_its_reason(pylate_model):
    """A ColBERT model's rows are not the text's tokens (a marker token added, skiplist tokens dropped): its
    late chunking is refused saying so (the message spoke of late-interaction scoring, which it was not)."""
    from polyvec import LateChunkingParams, PoolingParams

    colbert = LLM(str(pylate_model[1]), dtype="float32")
    params = PoolingParams(late_chunking_params=LateChunkingParams(2))
    with pytest.raises(ValueError, match="ColBERT model's query and document recipe"):
        colbert.token_embed("a wing in a slipstream", params, use_tqdm=False)


def test_late_chunking_on_an_engine_that_windows_long_input(minilm_path, minilm_llm):
    """An engine whose long input goes in windows still reads a late-chunked document whole: a short one as
    elsewhere, a long one refused (its windows' chunk rows were merged as token rows: wrong vectors)."""
    from polyvec import LateChunkingParams, PoolingParams

    windowed = LLM(str(minilm_path), dtype="float32", long_input="window")
    params = PoolingParams(late_chunking_params=LateChunkingParams(4))
    short = windowed.token_embed("flutter of a heated wing", params, use_tqdm=False)[0].outputs.data
    assert torch.equal(
        short, minilm_llm.token_embed("flutter of a heated wing", params, use_tqdm=False)[0].outputs.data
    )
    with pytest.raises(ValueError, match="402 tokens, more than max_model_len=256: late chunking reads the whole"):
        windowed.token_embed("wing " * 400, params, use_tqdm=False)
    assert windowed.token_embed("wing " * 400, use_tqdm=False)[0].outputs.data.shape[0] == 402  # windows as usual


def test_padding_false_with_several_tasks_and_a_colbert_model(minilm_llm, pylate_model):
    """padding=False is vLLM's "do not pad", also for several tasks (refused as max_length); max_length on a
    ColBERT model is refused (the marker went in after padding: max_model_len + 1 tokens, an IndexError)."""
    (out,) = minilm_llm.encode(
        "wing", pooling_task=["embed", "token_embed"], tokenization_kwargs={"padding": False}, use_tqdm=False
    )
    assert set(out.outputs.data) == {"embed", "token_embed"}
    colbert = LLM(str(pylate_model[1]), dtype="float32")
    with pytest.raises(ValueError, match="padding='max_length' does not apply to a ColBERT model"):
        colbert.token_embed("wing", tokenization_kwargs={"padding": "max_length"}, use_tqdm=False)


def test_cohere_input_types_a_model_declares_are_its_prompts(minilm_path, minilm_llm, tmp_path):
    """A model with prompts named search_query / search_document (nomic-style) gets them for those input types, as
    vLLM reads task instructions by name (they became "query" / "document", found no prompt: the bare text)."""
    import json
    import shutil

    from polyvec import PoolingParams

    folder = shutil.copytree(minilm_path, tmp_path / "cohere-prompts")
    prompts = {"search_query": "search_query: ", "search_document": "search_document: ", "query": "q: "}
    (folder / "config_sentence_transformers.json").write_text(json.dumps({"prompts": prompts}))
    llm = LLM(str(folder), dtype="float32")
    for name, prefix in (
        ("search_query", "search_query: "),
        ("search_document", "search_document: "),
        ("query", "q: "),
    ):
        got = llm.embed("wing flutter", PoolingParams(input_type=name), use_tqdm=False)[0].outputs.data
        want = minilm_llm.embed(prefix + "wing flutter", use_tqdm=False)[0].outputs.data
        assert torch.allclose(got, want, atol=1e-6), name
