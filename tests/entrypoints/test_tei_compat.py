"""A text-embeddings-router command line run as `polyvec serve`: TEI's names for polyvec's settings, its prompt,
pooling and device flags, and those with no effect (one warning)."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
import torch
import torch.nn.functional as F

from polyvec import LLM, PoolingParams
from polyvec.entrypoints.cli import (
    CommandError,
    build_parser,
    check_tei_pooling,
    main,
    model_options,
    server_options,
    tei_argv,
    tei_device,
)
from polyvec.entrypoints.vllm_compat import expand_dotted, vllm_argv
from tests.conftest import MINILM
from tests.entrypoints.server.conftest import Server, free_port, in_process_server


def parse(*argv: str):
    """The arguments as `main` reads them."""
    return build_parser().parse_args(expand_dotted(tei_argv(vllm_argv(["serve", *argv])[0])))


def test_teis_names_for_polyvecs_settings():
    args = parse(
        "--model-id",
        MINILM,
        "-p",
        "3000",
        "--hostname",
        "0.0.0.0",
        "--max-batch-tokens",
        "4096",
        "--max-batch-requests",
        "64",
        "--max-client-batch-size",
        "8",
        "--payload-limit",
        "2000000",
        "--huggingface-hub-cache",
        "/tmp/hub",
        "--auto-truncate",
        "--max-concurrent-requests",
        "12",
    )
    assert (args.model, args.port, args.host) == (MINILM, 3000, "0.0.0.0")
    assert parse(MINILM, "-p=3001").port == 3001 and parse(MINILM, "-p3002").port == 3002  # clap's forms
    assert (args.max_num_batched_tokens, args.max_num_seqs) == (4096, 64)
    assert (args.max_inputs_per_request, args.max_request_bytes, args.download_dir) == (8, 2_000_000, "/tmp/hub")
    assert (args.truncation, args.max_concurrent_requests) == ("auto", 12)
    assert parse("--model-id=" + MINILM).model == MINILM
    # not given: polyvec's own defaults stay (an alias has no default of its own to put over them)
    plain = parse(MINILM)
    defaults = (plain.max_inputs_per_request, plain.max_request_bytes, plain.host, plain.port)
    assert defaults == (4096, 33554432, "127.0.0.1", 8000)
    assert plain.max_num_seqs == 256 and plain.truncation == "auto"


def test_teis_flags_with_no_effect_warn_once_and_dense_path_is_refused(caplog):
    args = parse(
        MINILM,
        "--tokenization-workers",
        "4",
        "--json-output",
        "--uds-path",
        "/tmp/x",
        "--disable-spans",
        "--otlp-endpoint",
        "http://c:4317",
        "--prometheus-port",
        "9000",
        "--cors-allow-origin",
        "a",
        "b",
    )
    with caplog.at_level(logging.WARNING, logger="polyvec"):
        model_options(args)
    warned = [r.getMessage() for r in caplog.records if "text-embeddings-inference" in r.getMessage()]
    assert len(warned) == 1
    assert "--tokenization-workers" in warned[0] and "--cors-allow-origin" in warned[0]
    assert "--otlp-service-name" not in warned[0]  # not given
    with pytest.raises(CommandError, match="--dense-path is not supported"):
        model_options(parse(MINILM, "--dense-path", "2_Dense_1024"))


def test_teis_pooling_and_device_id():
    assert model_options(parse(MINILM, "--pooling", "cls"))["pooler_config"].seq_pooling_type == "CLS"
    merged = model_options(parse(MINILM, "--pooling", "last-token", "--pooler-config", '{"dimensions": 8}'))
    assert (merged["pooler_config"].seq_pooling_type, merged["pooler_config"].dimensions) == ("LAST", 8)
    assert model_options(parse(MINILM, "--pooling", "splade"))["pooler_config"] is None
    with pytest.raises(CommandError, match="--pooling cls and --pooler-config's pooling type: give one of them"):
        model_options(parse(MINILM, "--pooling", "cls", "--pooler-config", '{"seq_pooling_type": "MEAN"}'))
    code = main(["serve", MINILM, "--pooling", "cls", "--replicas", "1"])
    assert code == 2  # replicas load the model on their own: the check against it would be skipped
    check_tei_pooling("splade", ("embed_sparse", "token_classify"))
    with pytest.raises(CommandError, match="not a ForMaskedLM model"):
        check_tei_pooling("splade", ("embed", "token_embed"))
    with pytest.raises(CommandError, match="--pooling mean is for embedding models"):
        check_tei_pooling("mean", ("classify", "token_classify"))
    args = parse(MINILM, "--device-id", "1")
    tei_device(args)
    assert args.device == "cuda:1"
    args = parse(MINILM, "--device-id", "0")
    tei_device(args)
    assert args.device == "auto"
    with pytest.raises(CommandError, match="give one of them"):
        tei_device(parse(MINILM, "--device-id", "1", "--device", "cpu"))
    with pytest.raises(SystemExit):  # as TEI's parser: one or the other
        parse(MINILM, "--default-prompt-name", "query", "--default-prompt", "q: ")
    options = server_options(parse(MINILM, "--default-prompt", "q: "))
    assert (options["default_prompt"], options["default_prompt_name"]) == ("q: ", None)


@pytest.fixture(scope="module")
def prompted_folder(tmp_path_factory, minilm_path):
    """MiniLM with instruction prompts and its own default ("passage")."""
    folder = tmp_path_factory.mktemp("tei-prompted")
    for entry in minilm_path.iterdir():
        if entry.name != "config_sentence_transformers.json":
            (folder / entry.name).symlink_to(entry.resolve())
    (folder / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": {"query": "query: ", "passage": "passage: "}, "default_prompt_name": "passage"})
    )
    return folder


def embed_ref(llm, texts) -> torch.Tensor:
    return torch.stack([o.outputs.data for o in llm.embed(texts, PoolingParams(), use_tqdm=False)])


def test_a_tei_command_line_serves(prompted_folder, minilm_llm):
    """`--model-id`, `--max-client-batch-size` and `--default-prompt-name` on a real server: the prompt named
    goes before every text (not the model's own default), on /embed, /v1/embeddings and /tokenize."""
    s = Server(
        "--model-id",
        str(prompted_folder),
        "--max-client-batch-size",
        "2",
        "--default-prompt-name",
        "query",
        "--tokenization-workers",
        "4",
        "--json-output",
    )
    try:
        r = s.post("/embed", {"inputs": ["wing flutter", "heat transfer"]})
        assert r.status_code == 200, r.text
        want = embed_ref(minilm_llm, ["query: wing flutter", "query: heat transfer"])
        assert torch.allclose(torch.tensor(r.json()), want, atol=1e-5)
        own_default = embed_ref(minilm_llm, ["passage: wing flutter", "passage: heat transfer"])
        assert not torch.allclose(torch.tensor(r.json()), own_default, atol=1e-3)
        # token ids get it too, as in TEI (decoded, prompted, encoded again)
        ids = minilm_llm.engine.tokenizer.encode_prompts(["wing flutter"], 1 << 62, False)[0].input_ids
        r = s.post("/embed", {"inputs": [ids, "heat transfer"]})
        assert torch.allclose(torch.tensor(r.json()), want, atol=1e-5)
        r = s.post("/v1/embeddings", {"input": "wing flutter"})
        assert torch.allclose(torch.tensor(r.json()["data"][0]["embedding"]), want[0], atol=1e-5)
        r = s.post("/embed", {"inputs": ["a", "b", "c"]})
        assert r.status_code == 422 and r.json()["error"] == "batch size 3 > maximum allowed batch size 2"
        tokens = s.post("/tokenize", {"inputs": "wing", "add_special_tokens": False}).json()[0]
        assert [t["text"] for t in tokens] == ["query", ":", "wing"]
        # a request's own prompt_name still wins
        r = s.post("/embed", {"inputs": "wing flutter", "prompt_name": "passage"})
        assert torch.allclose(torch.tensor(r.json()[0]), embed_ref(minilm_llm, ["passage: wing flutter"])[0], atol=1e-5)
    finally:
        assert s.stop() == 0


def test_default_prompt_text_and_an_unknown_name(prompted_folder, minilm_llm, capsys):
    """--default-prompt's text goes before texts that name no prompt (input_type still picks the model's);
    a --default-prompt-name the model does not declare stops the server in TEI's words."""
    llm = LLM(str(prompted_folder), dtype="float32")
    with in_process_server(llm.engine, default_prompt="search: ") as url:
        r = httpx.post(url + "/embed", json={"inputs": "wing flutter"}, timeout=60)
        assert torch.allclose(torch.tensor(r.json()[0]), embed_ref(minilm_llm, ["search: wing flutter"])[0], atol=1e-5)
        ids = llm.engine.tokenizer.encode_prompts(["wing flutter"], 1 << 62, False)[0].input_ids
        r = httpx.post(url + "/embed", json={"inputs": [ids]}, timeout=60)
        assert torch.allclose(torch.tensor(r.json()[0]), embed_ref(minilm_llm, ["search: wing flutter"])[0], atol=1e-5)
        r = httpx.post(url + "/v1/embeddings", json={"input": "wing flutter", "input_type": "query"}, timeout=60)
        got = torch.tensor(r.json()["data"][0]["embedding"])
        assert torch.allclose(got, embed_ref(minilm_llm, ["query: wing flutter"])[0], atol=1e-5)
        tokens = httpx.post(url + "/tokenize", json={"inputs": "wing", "add_special_tokens": False}).json()[0]
        assert [t["text"] for t in tokens] == ["search", ":", "wing"]
    port = str(free_port())
    code = main(["serve", "--model-id", str(prompted_folder), "--default-prompt-name", "doc", "--port", port])
    err = capsys.readouterr().err
    assert code == 2 and "`default-prompt-name` is set to `doc` but it was not found" in err, err


def test_include_prompt_false_and_the_servers_prompt_ends_with_it(prompted_folder, minilm_path, tmp_path):
    """A model that pools without its prompt (include_prompt false): TEI's prompt_name and token-id inputs with a
    default prompt gave vectors pooled over the prompt too, unlike sentence-transformers; and a server's
    --default-prompt stayed on the engine after the server stopped."""
    from sentence_transformers import SentenceTransformer

    folder = tmp_path / "no-prompt-pooling"
    folder.mkdir()
    for entry in prompted_folder.iterdir():
        if entry.name != "1_Pooling":
            (folder / entry.name).symlink_to(entry.resolve())
    pooling = json.loads((minilm_path / "1_Pooling" / "config.json").read_text())
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({**pooling, "include_prompt": False}))
    st = SentenceTransformer(str(folder), device="cpu")
    want = torch.from_numpy(st.encode(["wing flutter"], prompt_name="query", normalize_embeddings=True))[0]
    llm = LLM(str(folder), dtype="float32")
    before = llm.embed(["wing flutter"], use_tqdm=False)[0].outputs.data
    ids = llm.engine.tokenizer.encode_prompts(["wing flutter"], 1 << 62, False)[0].input_ids
    with in_process_server(llm.engine, default_prompt_name="query") as url:
        for body in ({"inputs": "wing flutter"}, {"inputs": [ids]}, {"inputs": "wing flutter", "prompt_name": "query"},
                     {"inputs": [ids], "prompt_name": "query"}):  # fmt: skip
            r = httpx.post(url + "/embed", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert F.cosine_similarity(torch.tensor(r.json()[0]), want, dim=0) > 0.9999, body
    after = llm.embed(["wing flutter"], use_tqdm=False)[0].outputs.data
    assert torch.equal(before, after)  # the model's own default ("passage") again, offline
