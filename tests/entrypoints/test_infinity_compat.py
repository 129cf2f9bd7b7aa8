"""An `infinity_emb v2` command line run as `polyvec serve` (or `polyvec v2`): Infinity's names for polyvec's
settings, its pooling flag, those refused by name and those with no effect (one warning)."""

from __future__ import annotations

import logging

import pytest
import torch
from infinity_client import Client
from infinity_client.api.default import embeddings
from infinity_client.models import OpenAIEmbeddingInputText

from polyvec.entrypoints.cli import CommandError, build_parser, infinity_options, main, model_options, tei_argv
from polyvec.entrypoints.vllm_compat import expand_dotted, vllm_argv
from tests.conftest import MINILM
from tests.entrypoints.server.conftest import Server


def parse(*argv: str):
    """The arguments as `main` reads them (`infinity_options` is serve's first check)."""
    args = build_parser().parse_args(expand_dotted(tei_argv(vllm_argv(list(argv))[0])))
    infinity_options(args)
    return args


def test_infinitys_command_line_and_its_flags_with_no_effect(caplog):
    with caplog.at_level(logging.WARNING, logger="polyvec"):
        args = parse("v2", "--model-id", MINILM, "--port", "7997", "--batch-size", "32", "--pooling-method", "cls",
                     "--engine", "torch", "--no-model-warmup", "--compile", "--url-prefix", "", "--served-model-name",
                     "bge", "--embedding-dtype", "float32")  # fmt: skip
    assert (args.model, args.port, args.max_num_seqs, args.served_model_name) == (MINILM, 7997, 32, ["bge"])
    assert model_options(args)["pooler_config"].seq_pooling_type == "CLS"  # as TEI's --pooling cls
    warned = [r.getMessage() for r in caplog.records if "Infinity flags" in r.getMessage()]
    assert warned == ["Infinity flags with no effect in polyvec: --engine, --model-warmup, --compile"]
    plain = parse("serve", MINILM, "--pooling-method", "auto")  # auto: the model's own pooling
    assert model_options(plain)["pooler_config"] is None and plain.max_num_seqs == 256
    # its switches' --no- forms, and uvicorn's trace among its log levels
    assert parse("v2", "--model-id", MINILM, "--no-preload-only", "--log-level", "trace").log_level == "debug"


def test_what_polyvec_cannot_do_is_refused_by_name(capsys):
    with pytest.raises(CommandError, match="--url-prefix /v1 is not supported: polyvec serves Infinity's routes"):
        parse("v2", "--model-id", MINILM, "--url-prefix", "/v1")
    with pytest.raises(CommandError, match="--embedding-dtype int8 is not supported"):
        parse("v2", "--model-id", MINILM, "--embedding-dtype", "int8")
    with pytest.raises(CommandError, match="--pooling cls and --pooling-method mean: give one of them"):
        parse("serve", MINILM, "--pooling", "cls", "--pooling-method", "mean")
    with pytest.raises(SystemExit):  # Infinity's model per device
        parse("v2", "--model-id", MINILM, "--device-id", "0,1")
    assert "a server runs on one device" in capsys.readouterr().err
    # Infinity serves one model per --model-id and TEI refuses a second: the first was dropped without a word
    assert main(["v2", "--model-id", MINILM, "--model-id", "BAAI/bge-reranker-base"]) == 2
    assert "--model-id given twice" in capsys.readouterr().err
    assert main(["v2", "--model-id", MINILM, "--pooling-method", "mean", "--replicas", "2"]) == 2
    assert "--pooling-method is a single-server flag" in capsys.readouterr().err  # it named TEI's --pooling


@pytest.mark.parametrize("replicas", [[], ["--replicas", "2"]])
def test_preload_only_loads_the_model_and_exits(minilm_path, caplog, replicas):
    """With replicas too (they started Ray Serve and served: a Docker build step that never ended)."""
    with caplog.at_level(logging.INFO, logger="polyvec"):
        assert main(["v2", "--model-id", str(minilm_path), "--preload-only", "--log-level", "info", *replicas]) == 0
    assert any("--preload-only: exiting" in r.getMessage() for r in caplog.records)


def test_an_infinity_command_line_serves_its_client(minilm_path, minilm_llm):
    s = Server("--model-id", str(minilm_path), "--batch-size", "8", "--pooling-method", "auto", "--engine", "torch",
               "--no-bettertransformer", "--served-model-name", "bge")  # fmt: skip
    try:
        texts = ["wing flutter", "heat transfer"]
        got = embeddings.sync_detailed(client=Client(base_url=s.url), body=OpenAIEmbeddingInputText(input_=texts))
        assert got.status_code == 200 and got.parsed.model == "bge", got.content
        for item, out in zip(got.parsed.data, minilm_llm.embed(texts, use_tqdm=False)):
            assert torch.allclose(torch.tensor(item.embedding), out.outputs.data, atol=1e-5)
    finally:
        assert s.stop() == 0
