"""`polyvec embed` without Ray: every task to Parquet (the columns `--ray` writes), and clear refusals."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest

from polyvec import LLM
from polyvec.columns import token_rows
from polyvec.entrypoints.cli import build_parser
from tests.conftest import REPO

DOCS = [("d1", "Flutter", "wing flutter at transonic speeds"), ("d2", "", "heat transfer in a boundary layer")]


def embed_cli(*args: str):
    cmd = [sys.executable, "-m", "polyvec", "embed", *args, "--quiet", "--dtype", "float32"]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)


def test_embed_any_task_to_parquet(tmp_path, minilm_path, minilm_llm):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"_id": i, "title": t, "text": x}) + "\n" for i, t, x in DOCS))
    out = tmp_path / "vectors.parquet"
    r = embed_cli(str(corpus), "--model", str(minilm_path), "--pooling-task", "token_embed+embed", "--output", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "encoded (token_embed+embed) 2 texts" in r.stdout and f"written to {out}" in r.stdout
    table = pq.read_table(out)
    assert table.column("id").to_pylist() == ["d1", "d2"]
    texts = table.column("text").to_pylist()
    assert texts[0].startswith("Flutter") and texts[1] == DOCS[1][2]  # title and text, as `--ray` reads them
    want = minilm_llm.encode(texts, pooling_task=["token_embed", "embed"], use_tqdm=False)
    for got, o in zip(token_rows(table.column("token_embed")), want):
        assert np.allclose(got, o.outputs.data["token_embed"].numpy(), atol=1e-5)
    embeds = table.column("embed").combine_chunks().values.to_numpy().reshape(2, 384)
    assert np.allclose(embeds, np.stack([o.outputs.data["embed"].numpy() for o in want]), atol=1e-5)


def test_embed_refuses_what_it_cannot_write(tmp_path, minilm_path):
    texts = tmp_path / "texts.txt"
    texts.write_text("one\ntwo\n")
    r = embed_cli(str(texts), "--model", str(minilm_path), "--pooling-task", "token_embed", "--output",
                  str(tmp_path / "v.npy"))  # fmt: skip
    assert r.returncode == 2 and "give --output FILE.parquet" in r.stderr
    assert not (tmp_path / "v.npy").exists()
    r = embed_cli(str(texts), "--model", str(minilm_path), "--pooling-task", "classify")
    assert r.returncode == 2 and "--pooling-task classify is not supported by this model" in r.stderr
    assert "embed" in r.stderr.rsplit("it supports:", 1)[1]


def test_embed_reads_parquet_and_a_text_column(tmp_path, minilm_path, minilm_llm):
    import pyarrow as pa

    source = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"_id": ["a", "b", "c"], "body": ["wing flutter", "heat transfer", "shock waves"]}), source)
    out = tmp_path / "out.parquet"
    r = embed_cli(str(source), "--model", str(minilm_path), "--text-column", "body", "--limit", "2", "--pooling-task",
                  "token_embed", "--output", str(out))  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    table = pq.read_table(out)
    assert table.column("id").to_pylist() == ["a", "b"]
    assert table.column("text").to_pylist() == ["wing flutter", "heat transfer"]
    want = minilm_llm.token_embed(["wing flutter", "heat transfer"], use_tqdm=False)
    for got, o in zip(token_rows(table.column("token_embed")), want):
        assert np.allclose(got, o.outputs.data.numpy(), atol=1e-5)
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text('{"id": 1, "body": "lift"}\n{"id": 2, "text": "drag"}\n')
    r = embed_cli(str(jsonl), "--model", str(minilm_path), "--text-column", "body")
    assert r.returncode == 2 and "line 2 has no text in field 'body'" in r.stderr
    r = embed_cli(str(source), "--model", str(minilm_path))
    assert r.returncode == 2 and "no column 'text' (give --text-column); it has: _id, body" in r.stderr
    numbers = tmp_path / "numbers.jsonl"  # a BEIR row whose text or title is not a string (a traceback before)
    numbers.write_text('{"_id": "a", "text": "lift"}\n{"_id": "b", "text": 5}\n')
    r = embed_cli(str(numbers), "--model", str(minilm_path))
    assert r.returncode == 2 and "line 2 has a number in field 'text', not a string" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    numbers.write_text('{"_id": "a", "title": ["x"], "text": "lift"}\n')
    r = embed_cli(str(numbers), "--model", str(minilm_path))
    assert r.returncode == 2 and "line 1 has an array in field 'title', not a string" in r.stderr


def test_embed_refuses_a_file_that_is_not_text(tmp_path, minilm_path):
    binary = tmp_path / "vectors.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    r = embed_cli(str(binary), "--model", str(minilm_path))
    assert r.returncode == 2 and f"cannot read {binary}" in r.stderr and "Traceback" not in r.stderr


def test_bad_flags_files_and_settings_are_one_line_and_exit_2(tmp_path, minilm_path, capsys, monkeypatch):
    """Each of these ended in a Python traceback (exit 1) or was accepted and did something else."""
    import pytest

    from polyvec.entrypoints.cli import main

    texts = tmp_path / "two.txt"
    texts.write_text("wing flutter\nheat transfer\n")
    (tmp_path / "arr.jsonl").write_text("[1, 2]\n")
    model = ["--model", str(minilm_path), "--quiet"]
    for argv, message in [
        ([str(tmp_path / "arr.jsonl")], "line 1 is not a JSON object"),
        ([str(texts), "--pooling-task", "embed+embed"], "tasks must be a non-empty list without repeats"),
        ([str(texts), "--output", str(tmp_path / "no" / "x.npy")], "cannot write --output"),
        ([str(texts), "--pooler-config", '{"dimensions": 100}'], "dimensions=100 is not allowed"),
        ([str(texts), "--output", str(tmp_path / "v.csv")], "give FILE.npy (vectors) or FILE.parquet"),  # .npy in it
    ]:
        assert main(["embed", *argv, *model]) == 2, argv
        assert message in capsys.readouterr().err
    for argv, message in [
        (["serve", str(minilm_path), "--log-level", "bogus"], "argument --log-level: invalid choice: 'bogus'"),
        (["eval-retrieval", "--data", str(tmp_path), "--top-k", "-5"], "argument --top-k: must be at least 1"),
        (["index", str(texts), "--index", str(tmp_path / "ix"), "--batch-size", "0"], "--batch-size: must be at"),
        (["search", "q", "--index", str(tmp_path / "ix"), "-k", "0"], "argument -k: must be at least 1, got 0"),
        (["serve", "m", "--port", "99999"], "argument --port: a port is at most 65535"),  # it listened on 34463
        (["serve", "m", "--max-request-bytes", "-1"], "--max-request-bytes: must be at least 1"),  # every 413
        (["serve", "m", "--max-inputs-per-request", "0"], "--max-inputs-per-request: must be at least 1"),
        (["serve", "m", "--max-concurrent-requests", "-1"], "--max-concurrent-requests: must be 0 or more"),
        (["serve", "m", "--request-body-timeout", "nan"], "--request-body-timeout: must be 0 or more"),
        (["serve", "m", "--max-model-len", "1.5K"], "decimals go with k, m, g or t (decimal) only"),
        (["embed", "x", "--device", "bogus"], "argument --device: 'bogus' is not auto, cpu, cuda or cuda:N"),
        (["serve", "m", "--replicas", "0"], "argument --replicas: must be at least 1, got 0"),
        (["serve", "m", "--target-ongoing-requests", "0"], "--target-ongoing-requests: must be more than 0"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err
    monkeypatch.setenv("POLYVEC_PORT", "abc")  # an environment default is checked as the flag would be
    assert main(["serve"]) == 2 and "POLYVEC_PORT='abc' is not a valid value for --port" in capsys.readouterr().err
    monkeypatch.delenv("POLYVEC_PORT")
    monkeypatch.setenv("POLYVEC_LOG_LEVEL", "verbose")  # argparse checks choices on a command line only
    assert main(["serve"]) == 2
    assert "POLYVEC_LOG_LEVEL='verbose' is not one of --log-level's values" in capsys.readouterr().err
    monkeypatch.delenv("POLYVEC_LOG_LEVEL")
    # a list flag from its variable: the words of the value (it was one string, checked letter by letter: any
    # host with one of its letters passed the allow list)
    monkeypatch.setenv("POLYVEC_ALLOWED_MEDIA_DOMAINS", "example.com img.example.org")
    assert build_parser().parse_args(["serve"]).allowed_media_domains == ["example.com", "img.example.org"]
    monkeypatch.delenv("POLYVEC_ALLOWED_MEDIA_DOMAINS")
    llm = LLM(str(minilm_path), allowed_media_domains="example.com")  # one host as a string, in Python
    assert llm.engine.engine_config.allowed_media_domains == ("example.com",)


def test_serve_on_a_port_in_use_is_one_line_before_the_model_loads(minilm_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        r = subprocess.run([sys.executable, "-m", "polyvec", "serve", str(minilm_path), "--port", port],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2, r.stderr  # it loaded the model, then uvicorn logged the bind error, exit 3
    assert r.stderr.strip().splitlines() == [
        f"polyvec: error: cannot serve on 127.0.0.1:{port}: Address already in use"
    ]


def test_embed_prints_the_vectors_width_and_a_true_cosine(tmp_path, minilm_path, capsys):
    """--pooler-config dimensions (Matryoshka) made the command fail filling 384-wide rows; unnormalized vectors
    printed their dot product as a "cosine"."""
    from polyvec.entrypoints.cli import main

    texts = tmp_path / "two.txt"
    texts.write_text("wing flutter\nheat transfer\n")
    base = ["embed", str(texts), "--model", str(minilm_path), "--quiet", "--dtype", "float32"]
    assert main([*base, "--output", str(tmp_path / "v.npy")]) == 0
    cosine = capsys.readouterr().out.split("cosine ")[1].split()[0]
    assert main([*base, "--pooler-config", '{"use_activation": false}']) == 0
    assert capsys.readouterr().out.split("cosine ")[1].split()[0] == cosine
    small = ["--hf-overrides", '{"matryoshka_dimensions": [128]}', "--pooler-config", '{"dimensions": 128}']
    assert main([*base, *small, "--output", str(tmp_path / "s.npy")]) == 0
    assert "dim 128" in capsys.readouterr().out and np.load(tmp_path / "s.npy").shape == (2, 128)


def test_token_counts_as_vllm_writes_them():
    """--max-model-len 8k (vLLM's human-readable counts) was refused as not an integer."""
    from polyvec.entrypoints.cli import build_parser

    for given, want in [("8192", 8192), ("8k", 8000), ("8K", 8192), ("25.6k", 25600)]:
        args = build_parser().parse_args(["serve", "m", "--max-model-len", given, "--max-num-batched-tokens", given])
        assert args.max_model_len == args.max_num_batched_tokens == want


def test_embed_output_is_whole_or_absent(tmp_path, minilm_path):
    """A run stopped part-way (Ctrl-C here) leaves no output (it left a .npy of zero rows, the first row groups of
    a .parquet); a corpus row with a lone surrogate or with no text field, and an output folder that is not there,
    are one line and exit 2 before any encoding (tracebacks, or silently empty texts, before)."""
    import os
    import signal
    import time

    corpus = tmp_path / "big.txt"
    corpus.write_text("".join(f"passage {i} about wing flutter and heat transfer\n" for i in range(6000)))
    out = tmp_path / "v.parquet"
    cmd = [sys.executable, "-m", "polyvec", "embed", str(corpus), "--model", str(minilm_path), "--quiet",
           "--output", str(out), "--pooling-task", "token_embed", "--batch-size", "64"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while (
        time.monotonic() < deadline and proc.poll() is None and not [p for p in os.listdir(tmp_path) if "partial" in p]
    ):
        time.sleep(0.05)  # the first row group is being written under its temporary name
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert sorted(os.listdir(tmp_path)) == ["big.txt"]
    bad = tmp_path / "bad.jsonl"
    for row, message in [
        ({"_id": "a", "text": "wing \ud800 flutter"}, "line 2 has a lone surrogate (U+D800) at character 5, not text"),
        ({"_id": "a", "contents": "wing flutter"}, "line 2 has no 'title' or 'text' field (give --text-column)"),
    ]:
        bad.write_text(json.dumps({"_id": "z", "text": "fine"}) + "\n" + json.dumps(row) + "\n")
        r = embed_cli(str(bad), "--model", str(minilm_path), "--output", str(tmp_path / "x.npy"))
        assert r.returncode == 2 and r.stderr.strip().endswith(message), r.stderr[-2000:]
    (tmp_path / "d.parquet").mkdir()
    for target, message in [
        (tmp_path / "no" / "x.parquet", "no such folder"),
        (tmp_path / "d.parquet", "it is a folder"),
    ]:
        r = embed_cli(str(corpus), "--model", str(minilm_path), "--limit", "4", "--output", str(target))
        assert r.returncode == 2 and r.stderr.strip().endswith(message) and "Traceback" not in r.stderr, r.stderr
    r = embed_cli(str(corpus), "--model", str(minilm_path), "--limit", "4", "--output", str(out))
    assert r.returncode == 0 and pq.read_table(out).num_rows == 4
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl", "big.txt", "d.parquet", "v.parquet"]


def test_jsonl_lines_for_ray_split_as_python_reads_a_file():
    """`polyvec embed FILE.jsonl --ray` splits lines at \\n, \\r\\n and \\r, as `read_corpus` (Python's text mode)
    does, and not at U+2028 / U+0085 inside a JSON string (Ray's text reader did: the job failed)."""
    from polyvec.entrypoints.cli import _jsonl_lines

    data = '{"_id": "1", "text": "a\u2028b"}\r\n\n{"_id": "2", "text": "c\x85d"}\r{"_id": "3", "text": "e"}'
    rows = [json.loads(r["text"]) for r in _jsonl_lines({"bytes": data.encode("utf-8")})]
    assert rows == [{"_id": "1", "text": "a\u2028b"}, {"_id": "2", "text": "c\x85d"}, {"_id": "3", "text": "e"}]


def test_read_corpus_by_suffix_and_what_it_refuses(tmp_path):
    """JSON lines under .ndjson / .json and CSV / TSV files were read as raw lines (a CSV's header a document, a
    quoted newline two); a JSONL row whose text is null was the empty text; a Parquet id of another type was
    stringified ('True'), where a JSONL one is refused."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import pytest

    from polyvec.entrypoints.cli import read_corpus

    rows = '{"_id": "d1", "title": "T", "text": "alpha"}\n{"_id": "d2", "text": "beta"}\n'
    for suffix in (".ndjson", ".json"):
        (tmp_path / f"c{suffix}").write_text(rows)
        assert read_corpus(str(tmp_path / f"c{suffix}")) == (["d1", "d2"], ["T alpha", "beta"])
    (tmp_path / "c.csv").write_text('id,text\n007,"a, quoted\nnewline"\n2,42\n')
    assert read_corpus(str(tmp_path / "c.csv")) == (["007", "2"], ["a, quoted\nnewline", "42"])
    (tmp_path / "c.tsv").write_text('_id\tbody\na\thello world\nb\t"Hello" she said\n')  # TSV: no quoting
    assert read_corpus(str(tmp_path / "c.tsv"), text_column="body") == (["a", "b"], ["hello world", '"Hello" she said'])
    (tmp_path / "n.jsonl").write_text('{"_id": "a", "text": "real"}\n{"_id": "b", "text": null}\n')
    with pytest.raises(ValueError, match="line 2 has null in field 'text' and no title"):
        read_corpus(str(tmp_path / "n.jsonl"))
    (tmp_path / "t.jsonl").write_text('{"_id": "a", "title": null}\n')
    with pytest.raises(ValueError, match="line 1 has null in field 'title'"):
        read_corpus(str(tmp_path / "t.jsonl"))
    (tmp_path / "ok.jsonl").write_text('{"_id": "a", "title": null, "text": "body"}\n')  # a null title alone: fine
    assert read_corpus(str(tmp_path / "ok.jsonl")) == (["a"], ["body"])
    pq.write_table(pa.table({"id": [True, False], "text": ["x", "y"]}), tmp_path / "b.parquet")
    with pytest.raises(ValueError, match="row 0 has bool True in column 'id', not an id"):
        read_corpus(str(tmp_path / "b.parquet"))


def test_environment_variables_are_read_for_their_own_command(monkeypatch, capsys):
    """A bad serve-only variable (POLYVEC_PORT=abc) stopped every command, --version and --help included; empty
    variables were values (POLYVEC_HOST="" listened on every interface); boolean ones took typos for "on";
    negative limits switched them off; --help printed the API keys; vLLM's --no- forms were refused; search's
    --dtype had no variable. Each is now as documented."""
    import pytest

    from polyvec.entrypoints.cli import build_parser, main

    monkeypatch.setenv("POLYVEC_PORT", "abc")
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    with pytest.raises(SystemExit) as done:
        main(["embed", "--help"])
    assert done.value.code == 0
    assert main(["serve"]) == 2 and "POLYVEC_PORT='abc' is not a valid value for --port" in capsys.readouterr().err
    assert build_parser().parse_args(["serve", "--port", "9000"]).port == 9000  # the command line wins
    monkeypatch.delenv("POLYVEC_PORT")

    monkeypatch.setenv("POLYVEC_HOST", "")
    assert build_parser().parse_args(["serve"]).host == "127.0.0.1"
    for value, expected in (("0", False), ("off", False), ("TRUE", True), (" yes ", True), ("", False)):
        monkeypatch.setenv("POLYVEC_ENFORCE_EAGER", value)
        assert build_parser().parse_args(["serve"]).enforce_eager is expected, value
    monkeypatch.setenv("POLYVEC_ENFORCE_EAGER", "maybe")
    assert main(["serve"]) == 2 and "POLYVEC_ENFORCE_EAGER='maybe' is not a boolean" in capsys.readouterr().err
    monkeypatch.setenv("POLYVEC_ENFORCE_EAGER", "1")
    assert build_parser().parse_args(["serve", "--no-enforce-eager"]).enforce_eager is False
    monkeypatch.delenv("POLYVEC_ENFORCE_EAGER")
    parsed = build_parser().parse_args(["serve", "--no-trust-remote-code", "--no-enable-request-id-headers"])
    assert parsed.trust_remote_code is False and parsed.enable_request_id_headers is False

    monkeypatch.setenv("POLYVEC_MAX_TOKENS_PER_REQUEST", "-1")
    assert main(["serve"]) == 2 and "POLYVEC_MAX_TOKENS_PER_REQUEST='-1'" in capsys.readouterr().err
    monkeypatch.delenv("POLYVEC_MAX_TOKENS_PER_REQUEST")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-windows-per-input", "-3"])
    capsys.readouterr()

    monkeypatch.setenv("POLYVEC_API_KEY", "sk-secret1 sk-secret2")
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    shown = capsys.readouterr().out
    assert "sk-secret1" not in shown and "env POLYVEC_API_KEY" in shown
    assert build_parser().parse_args(["serve"]).api_key == ["sk-secret1", "sk-secret2"]

    monkeypatch.setenv("POLYVEC_DTYPE", "float32")
    assert build_parser().parse_args(["search", "--index", "x", "q"]).dtype == "float32"

    # a value with % (a chat template's {% ... %}) broke --help, argparse formatting it
    monkeypatch.setenv("POLYVEC_CHAT_TEMPLATE", "{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(SystemExit) as done:
        main(["serve", "--help"])
    assert done.value.code == 0 and "POLYVEC_CHAT_TEMPLATE" in capsys.readouterr().out
    # vLLM's --enable-x / --disable-x pairs (its EnableDisableAction), as its docs spell --disable-prefix-caching
    parsed = build_parser().parse_args(["serve", "--disable-prefix-caching", "--disable-chunked-prefill",
                                        "--disable-request-id-headers", "--enable-sliding-window"])  # fmt: skip
    assert parsed.enable_prefix_caching is False and parsed.enable_chunked_prefill is False
    assert parsed.enable_request_id_headers is False and parsed.disable_sliding_window is False
    with pytest.raises(SystemExit):  # 0 is no image at all: refused by the parser, not as a model-load failure
        build_parser().parse_args(["serve", "--max-image-pixels", "0"])
    monkeypatch.setenv("POLYVEC_LOG_LEVEL", "verbose")  # vLLM's form of the flag on the command line wins
    from polyvec.entrypoints.cli import check_env

    check_env(build_parser().parse_args(["serve", "--uvicorn-log-level", "debug"]))


def test_ctrl_c_while_torch_imports_is_held_until_the_import_ends():
    """SIGINT inside `import torch` raised KeyboardInterrupt in torch's C++ initialisation: the process aborted
    (std::terminate) or the interrupt was lost and the server started anyway. It is held, then raised."""
    code = """
import os, signal, sys
class Interrupting:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C as torch starts to import
        return None
sys.meta_path.insert(0, Interrupting())
from polyvec.entrypoints.cli import import_torch
try:
    import_torch()
except KeyboardInterrupt:
    restored = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    print("interrupted after the import:", "torch" in sys.modules, restored)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "interrupted after the import: True True", (r.stdout, r.stderr[-2000:])


def test_a_beir_corpus_reads_the_same_as_jsonl_parquet_or_csv(tmp_path):
    """BEIR's title column in a Parquet or CSV corpus (its Hugging Face copies are Parquet) is joined with the
    text as in its JSONL: it was dropped, so the same corpus gave other vectors by format."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    from polyvec.entrypoints.cli import read_corpus

    rows = {"_id": ["d1", "d2", "d3"], "title": ["Wing flutter", "", None], "text": ["at Mach 2", "heat", "shocks"]}
    jsonl = tmp_path / "corpus.jsonl"
    jsonl.write_text("".join(json.dumps(dict(zip(rows, values))) + "\n" for values in zip(*rows.values())))
    pq.write_table(pa.table(rows), tmp_path / "corpus.parquet")
    pacsv.write_csv(pa.table({**rows, "title": ["Wing flutter", "", ""]}), tmp_path / "corpus.csv")
    want = (["d1", "d2", "d3"], ["Wing flutter at Mach 2", "heat", "shocks"])
    for name in ("corpus.jsonl", "corpus.parquet", "corpus.csv"):
        assert read_corpus(str(tmp_path / name)) == want, name
    # another text column: read alone, as in JSONL
    assert read_corpus(str(tmp_path / "corpus.csv"), text_column="title")[1] == ["Wing flutter", "", ""]
    pq.write_table(pa.table({"_id": ["a"], "title": [None], "text": [None]}), tmp_path / "empty.parquet")
    with pytest.raises(ValueError, match="row 0 has no title or text"):
        read_corpus(str(tmp_path / "empty.parquet"))
    pq.write_table(pa.table({"_id": ["a"], "title": [1999], "text": ["x"]}), tmp_path / "year.parquet")
    with pytest.raises(ValueError, match="row 0 has int 1999 in column 'title', not a string"):
        read_corpus(str(tmp_path / "year.parquet"))
