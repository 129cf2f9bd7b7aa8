"""polyvec on Ray Data, on a local Ray cluster of two nodes (a head and a worker, each a raylet process on this
machine): every task's column (embed, token_embed, classify, token_classify, embed_sparse, several at once)
equals the single-process output row by row; a killed engine actor loses and
duplicates nothing; `polyvec embed --ray` end to end."""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import ray.data

from polyvec import LLM
from polyvec.integrations.ray import ROW_BATCH_SIZE, TOKEN_BATCH_SIZE, default_batch_size, encode_dataset

TOPICS = ["boundary layers", "wing flutter", "heat transfer"]
TEXTS = [f"passage {i} about " + " and ".join(TOPICS[: 1 + i % 3]) for i in range(120)]


def rows_by_id(path):
    table = pq.read_table(path)
    return {r["id"]: r for r in table.to_pylist()}, table


@pytest.mark.parametrize("task", ["embed", "token_embed", ["token_embed", "embed"]])
def test_columns_equal_single_process(cluster, tmp_path, minilm_path, minilm_llm, task):
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    ds = ray.data.from_items([{"id": str(i), "text": t} for i, t in enumerate(TEXTS)])
    out = encode_dataset(ds, str(minilm_path), task=task, dtype="float32", batch_size=16)
    out.write_parquet(str(tmp_path / "out"))
    rows, table = rows_by_id(str(tmp_path / "out"))
    assert sorted(rows, key=int) == [str(i) for i in range(len(TEXTS))]
    tasks = [task] if isinstance(task, str) else task
    for t in tasks:
        want = minilm_llm.encode(TEXTS, pooling_task=t, use_tqdm=False)
        for i, o in enumerate(want):
            got = np.asarray(rows[str(i)][t], dtype=np.float32)
            assert got.shape == tuple(o.outputs.data.shape), (t, i)
            assert np.allclose(got, o.outputs.data.numpy(), atol=1e-5), (t, i)
    if "token_embed" in tasks:  # plain Arrow: a list of fixed-size lists, no padding
        assert str(table.schema.field("token_embed").type) == "list<element: fixed_size_list<element: float>[384]>"


def test_title_column_joined_by_the_engines(cluster, tmp_path, minilm_path, minilm_llm):
    items = [{"id": str(i), "title": f"title {i}" if i % 2 else None, "text": t} for i, t in enumerate(TEXTS[:20])]
    out = encode_dataset(ray.data.from_items(items), str(minilm_path), title_column="title", dtype="float32",
                         batch_size=8)  # fmt: skip
    out.write_parquet(str(tmp_path / "out"))
    rows, _ = rows_by_id(str(tmp_path / "out"))
    joined = [f"title {i} {t}" if i % 2 else t for i, t in enumerate(TEXTS[:20])]
    assert [rows[str(i)]["text"] for i in range(20)] == joined
    for i, o in enumerate(minilm_llm.embed(joined, use_tqdm=False)):
        assert np.allclose(rows[str(i)]["embed"], o.outputs.data.numpy(), atol=1e-5), i


def test_default_batch_size():
    """Per-token outputs in smaller batches (their output is large), one vector a row in larger ones."""
    assert default_batch_size("embed") == default_batch_size(["embed", "embed_sparse"]) == ROW_BATCH_SIZE
    assert default_batch_size("classify") == ROW_BATCH_SIZE > TOKEN_BATCH_SIZE
    assert default_batch_size("token_embed") == default_batch_size(["token_embed", "embed"]) == TOKEN_BATCH_SIZE
    assert default_batch_size("token_classify") == TOKEN_BATCH_SIZE


def test_sparse_column(cluster, tmp_path, splade_path):
    ds = ray.data.from_items([{"id": str(i), "text": t} for i, t in enumerate(TEXTS[:24])])
    encode_dataset(ds, str(splade_path), task="embed_sparse", dtype="float32", batch_size=8).write_parquet(
        str(tmp_path / "out")
    )
    rows, _ = rows_by_id(str(tmp_path / "out"))
    want = LLM(str(splade_path), dtype="float32").embed_sparse(TEXTS[:24], use_tqdm=False)
    for i, o in enumerate(want):
        v = o.outputs.data
        idx = v.nonzero().squeeze(1)
        assert rows[str(i)]["embed_sparse"]["indices"] == idx.tolist()
        assert np.allclose(rows[str(i)]["embed_sparse"]["values"], v[idx].numpy(), atol=1e-5)


def test_killed_actor_loses_and_duplicates_nothing(cluster, tmp_path, minilm_path, minilm_llm):
    texts = [f"{TEXTS[i % len(TEXTS)]} {i}" for i in range(1500)]
    ds = ray.data.from_items([{"id": str(i), "text": t} for i, t in enumerate(texts)])
    out = encode_dataset(ds, str(minilm_path), task="embed", dtype="float32", batch_size=8)
    killed: list[int] = []

    def kill_one_engine():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not killed:
            for p in psutil.process_iter(["pid", "cmdline"]):
                try:
                    if "MapBatches(PolyvecEncoder)" in " ".join(p.info["cmdline"] or []) and p.cpu_percent(0.5) > 20:
                        os.kill(p.info["pid"], signal.SIGKILL)  # an engine busy encoding, killed mid-job
                        killed.append(p.info["pid"])
                        return
                except (psutil.Error, ProcessLookupError):
                    continue
            time.sleep(0.2)

    killer = threading.Thread(target=kill_one_engine)
    killer.start()
    out.write_parquet(str(tmp_path / "out"))
    killer.join()
    assert killed, "no engine actor was found busy to kill"
    rows, table = rows_by_id(str(tmp_path / "out"))
    assert table.num_rows == len(texts) and sorted(rows, key=int) == [str(i) for i in range(len(texts))]
    want = minilm_llm.embed(texts, use_tqdm=False)
    for i, o in enumerate(want):
        assert np.allclose(rows[str(i)]["embed"], o.outputs.data.numpy(), atol=1e-5)


def test_cli_embed_on_ray(cluster, tmp_path, minilm_path, minilm_llm):
    """The plain command's columns (`id` as the string it is, `text` with the title, a column per task) and
    vectors; every model flag reaches the engines; --output is refused when missing or not empty. Lines split at
    "\\n" only: a text may hold U+2028 or U+0085 unescaped (Ray's text reader split the line there)."""
    corpus = tmp_path / "corpus.jsonl"
    rows = [{"_id": f"{i:03d}", "title": f"t{i}", "text": t} for i, t in enumerate(TEXTS[:40])]
    rows[3]["text"], rows[4]["text"] = "first\u2028second line", "next\x85line"
    lines = [json.dumps(r, ensure_ascii=False) for r in rows]
    corpus.write_text("\n".join(lines[:20] + [""] + lines[20:]) + "\n", encoding="utf-8")
    flags = ["--model", str(minilm_path), "--dtype", "float32", "--pooling-task", "token_embed+embed", "--batch-size",
             "16", "--pooler-config", '{"pooling_type": "CLS"}']  # fmt: skip
    cmd = [sys.executable, "-m", "polyvec", "embed", str(corpus), "--ray", cluster.address, *flags,
           "--output", str(tmp_path / "out")]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "encoded 40 rows (token_embed+embed) on Ray" in r.stdout
    plain = [sys.executable, "-m", "polyvec", "embed", str(corpus), *flags, "--output", str(tmp_path / "p.parquet")]
    assert subprocess.run(plain, capture_output=True, timeout=300).returncode == 0
    table, want_table = pq.read_table(str(tmp_path / "out")), pq.read_table(str(tmp_path / "p.parquet"))
    assert table.schema == want_table.schema and table.column_names == ["id", "text", "token_embed", "embed"]
    table = table.sort_by("id")
    for name in ("id", "text"):  # ids stay strings ("007", not 7); title and text joined, as polyvec embed reads
        assert table.column(name).to_pylist() == want_table.column(name).to_pylist()
    got = table.column("embed").combine_chunks().values.to_numpy().reshape(40, 384)
    assert np.allclose(got, want_table.column("embed").combine_chunks().values.to_numpy().reshape(40, 384), atol=1e-5)
    cls = LLM(str(minilm_path), dtype="float32", pooler_config={"pooling_type": "CLS"})  # the model flags reach Ray
    want = cls.embed(table.column("text").to_pylist(), use_tqdm=False)
    assert np.allclose(got, np.stack([o.outputs.data.numpy() for o in want]), atol=1e-5)
    assert not np.allclose(
        got[0],
        minilm_llm.embed(table.column("text").to_pylist()[:1], use_tqdm=False)[0].outputs.data.numpy(),
        atol=1e-3,
    )
    # the same corpus as Parquet (BEIR's Hugging Face copies): its title column joined as well (it was dropped)
    pq.write_table(pa.table({k: [r[k] for r in rows] for k in ("_id", "title", "text")}), tmp_path / "c.parquet")
    pcmd = [sys.executable, "-m", "polyvec", "embed", str(tmp_path / "c.parquet"), "--ray", cluster.address, *flags,
            "--pooling-task", "embed", "--output", str(tmp_path / "pout")]  # fmt: skip
    r = subprocess.run(pcmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    from_parquet = pq.read_table(str(tmp_path / "pout")).sort_by("id")
    assert from_parquet.column("text").to_pylist() == want_table.column("text").to_pylist()
    got_parquet = from_parquet.column("embed").combine_chunks().values.to_numpy().reshape(40, 384)
    assert np.allclose(got_parquet, got, atol=1e-5)
    r = subprocess.run([c for c in cmd if c not in ("--output", str(tmp_path / "out"))], capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2 and "give --output DIR" in r.stderr
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)  # again: it would add every row twice
    assert r.returncode == 2 and f"--output {tmp_path / 'out'} is not empty" in r.stderr
    assert pq.read_table(str(tmp_path / "out")).num_rows == 40


def _error_line(stderr: str) -> str:
    """polyvec's own error line: Ray's processes may log after it (a gcs_server line on a loaded machine)."""
    lines = [line for line in stderr.splitlines() if line.startswith("polyvec:")]
    return lines[-1] if lines else stderr.splitlines()[-1]


def test_cli_embed_on_ray_text_files_pools_and_errors(cluster, tmp_path, minilm_path, minilm_llm):
    """A text file keeps its blank lines and numbers its rows; threads that fill a node leave room for the read
    and write tasks (the job used to wait for CPUs for ever); bad input is one line and exit code 2."""
    import pyarrow as pa

    lines = ["wing flutter", "", "heat transfer", "boundary layers"]
    (tmp_path / "t.txt").write_text("\n".join(lines) + "\n")
    base = [sys.executable, "-m", "polyvec", "embed", "--ray", cluster.address, "--model", str(minilm_path), "--dtype",
            "float32", "--quiet"]  # fmt: skip
    # two engines of a thread each: each node's one CPU (a thread per actor asked for what the node has); the
    # driver only plans and waits, so it does not import torch (it did, ~1.4 s of every job)
    probe = "import sys; from polyvec.entrypoints.cli import main; rc = main(); print('torch', 'torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", f"{probe}; sys.exit(rc)", *base[3:], str(tmp_path / "t.txt"), "--actors",
                        "2", "--threads-per-actor", "1", "--output", str(tmp_path / "o")], capture_output=True,
                       text=True, timeout=180)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "encoded 4 rows (embed) on Ray" in r.stdout and "torch False" in r.stdout, r.stdout
    table = pq.read_table(str(tmp_path / "o")).sort_by("id")
    assert table.column("id").to_pylist() == ["0", "1", "2", "3"] and table.column("text").to_pylist() == lines
    want = np.stack([o.outputs.data.numpy() for o in minilm_llm.embed(lines, use_tqdm=False)])
    assert np.allclose(table.column("embed").combine_chunks().values.to_numpy().reshape(4, 384), want, atol=1e-5)

    # Parquet on nodes of one CPU (Ray's newer reader lists files in a task of a whole CPU: it waited for ever)
    pq.write_table(pa.table({"id": [7, 8], "text": ["wing flutter", "heat"]}), tmp_path / "in.parquet")
    r = subprocess.run([*base, str(tmp_path / "in.parquet"), "--output", str(tmp_path / "p")], capture_output=True,
                       text=True, timeout=180)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    table = pq.read_table(str(tmp_path / "p")).sort_by("id")
    assert table.column("id").to_pylist() == ["7", "8"] and table.column("text").to_pylist() == ["wing flutter", "heat"]

    pq.write_table(pa.table({"id": ["a", "b"], "text": ["x", None]}), tmp_path / "null.parquet")
    (tmp_path / "noid.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "body.jsonl").write_text('{"_id": "a", "body": "x"}\n{"_id": "b", "body": 5}\n')
    for args, message in [
        (["null.parquet"], "the Ray job failed: ValueError: a row of column 'text' is not a text: None"),
        (
            ["body.jsonl", "--text-column", "body"],
            'the Ray job failed: ValueError: the JSON line \'{"_id": "b", "body": 5}\' has no text in field \'body\'',
        ),
        (["noid.jsonl"], "a JSON line without '_id' or 'id' (--ray needs ids)"),
        (["t.txt", "--threads-per-actor", "2"], "2 threads per actor is more than a node's 1 CPUs"),
        (["t.txt", "--limit", "0"], "argument --limit: must be at least 1, got 0"),
        (["missing.jsonl"], "cannot read missing.jsonl: no such file or folder"),
        # a traceback, or a wait for ever, before
        (["t.txt", "--gpus-per-actor", "1"], "1 GPU(s) per actor asked of a cluster with 0 GPU(s)"),
        (["t.txt", "--ray", "bogus_address"], "--ray bogus_address: not an address"),
        (["t.txt", "--ray", "127.0.0.1:1"], "--ray 127.0.0.1:1: no Ray answers there"),
    ]:
        args[0] = str(tmp_path / args[0]) if args[0] != "missing.jsonl" else args[0]
        r = subprocess.run([*base, *args, "--output", str(tmp_path / "bad")], capture_output=True, text=True,
                           timeout=180)  # fmt: skip
        assert r.returncode == 2 and message in r.stderr, r.stderr[-2000:]
        assert "Traceback" not in _error_line(r.stderr)
        assert "ERROR" not in r.stderr, r.stderr[-2000:]  # Ray Data's two log lines of the same error, before
    (tmp_path / "file").write_text("")
    r = subprocess.run([*base, str(tmp_path / "t.txt"), "--output", str(tmp_path / "file" / "o")], capture_output=True,
                       text=True, timeout=180)  # fmt: skip
    assert r.returncode == 2 and f"cannot write {tmp_path / 'file' / 'o'}" in _error_line(r.stderr), r.stderr
    # JSON lines under .ndjson (read as raw lines before), an id twice (written twice, unlike polyvec embed)
    (tmp_path / "dup.ndjson").write_text('{"_id": "a", "text": "x"}\n{"_id": "a", "text": "y"}\n')
    r = subprocess.run([*base, str(tmp_path / "dup.ndjson"), "--output", str(tmp_path / "dup")], capture_output=True,
                       text=True, timeout=180)  # fmt: skip
    assert r.returncode == 2 and "the corpus repeats the id 'a' (2 rows)" in _error_line(r.stderr), r.stderr
    assert not (tmp_path / "dup").exists() and not list(tmp_path.glob(".dup.partial-*"))  # nothing left
    # a job failing part-way (a null text in the second of two Parquet files) left the first file's rows, looking
    # whole; the output is written beside and renamed once whole now
    (tmp_path / "two").mkdir()
    pq.write_table(pa.table({"id": ["p", "q"], "text": ["fine", "also fine"]}), tmp_path / "two" / "a.parquet")
    pq.write_table(pa.table({"id": ["r", "s"], "text": ["x", None]}), tmp_path / "two" / "b.parquet")
    (tmp_path / "out2").mkdir()  # an empty folder is taken as the place to write
    r = subprocess.run([*base, str(tmp_path / "two"), "--output", str(tmp_path / "out2"), "--batch-size", "1"],
                       capture_output=True, text=True, timeout=180)  # fmt: skip
    assert r.returncode == 2 and "is not a text: None" in _error_line(r.stderr), r.stderr[-2000:]
    assert not list((tmp_path / "out2").iterdir()) and not list(tmp_path.glob(".out2.partial-*"))
    # CSV with --text-column (the column was looked for in the table read from it, which names it text); a
    # Parquet id that is null is refused, not written as "None"
    (tmp_path / "c.csv").write_text("id,text,body\na,alpha,the body of a\nb,beta,the body of b\n")
    r = subprocess.run([*base, str(tmp_path / "c.csv"), "--text-column", "body", "--output", str(tmp_path / "csv")],
                       capture_output=True, text=True, timeout=180)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert pq.read_table(str(tmp_path / "csv")).sort_by("id").column("text").to_pylist() == [
        "the body of a", "the body of b"]  # fmt: skip
    pq.write_table(pa.table({"id": ["x1", None], "text": ["one", "two"]}), tmp_path / "nullid.parquet")
    r = subprocess.run([*base, str(tmp_path / "nullid.parquet"), "--output", str(tmp_path / "nid")],
                       capture_output=True, text=True, timeout=180)  # fmt: skip
    assert r.returncode == 2 and "a row's 'id' is NoneType None, not an id" in _error_line(r.stderr), r.stderr


def test_pool_plan_leaves_room_for_reading_and_writing(cluster):
    from polyvec.integrations.ray import plan_pool

    # two nodes of one CPU: an engine per node of one thread, each reserving half the node
    assert plan_pool(None, None) == (2, 1, 0.5)
    assert plan_pool(None, 1) == (2, 1, 0.5)
    assert plan_pool(4, None) == (4, 1, 0.25)  # two on each node, within what the node can give
    with pytest.raises(ValueError, match="2 threads per actor is more than a node's 1 CPUs"):
        plan_pool(None, 2)


def test_encode_dataset_checks_its_arguments_when_called(cluster):
    """A typo in a keyword or an unknown `rows` is refused at the call (rows='plane' ran as 'keep'; an LLM
    keyword typo failed every actor once the job ran)."""
    from polyvec.integrations.ray import LLM_ARGS, encode_dataset

    ds = ray.data.from_items([{"text": "a"}])
    with pytest.raises(ValueError, match="rows must be one of keep, plain, jsonl, not 'plane'"):
        encode_dataset(ds, "m", rows="plane")
    with pytest.raises(TypeError, match="unexpected arguments .*: batchsize"):
        encode_dataset(ds, "m", batchsize=2)
    assert LLM_ARGS == set(inspect.signature(LLM.__init__).parameters) - {"self", "model", "kwargs"}


def test_actors_without_gpus_run_cpu_engines():
    """An actor that reserves no GPU still sees every GPU of its node (Ray leaves CUDA_VISIBLE_DEVICES alone at
    num_gpus=0): device "auto" would have loaded the model onto GPU 0, which Ray never gave it."""
    from polyvec.integrations import engine_device

    assert engine_device({"dtype": "float32"}, 0) == {"dtype": "float32", "device": "cpu"}
    assert engine_device({"device": "auto"}, 0) == {"device": "cpu"}
    assert engine_device({"device": "auto"}, 1) == {"device": "auto"}
    assert engine_device({}, 0.5) == {}
    assert engine_device({"device": "cuda:1"}, 0) == {"device": "cuda:1"}


@pytest.mark.parametrize("first_stage", ["muvera", "dense", "sparse"])
def test_index_dataset_equals_a_local_build(cluster, tmp_path, minilm_path, minilm_llm, first_stage):
    from polyvec.index import Index
    from polyvec.integrations.ray import index_dataset
    from tests.helpers import save_tiny_m3

    if first_stage == "sparse":  # a model with token and sparse vectors (bge-m3's layout, tiny and seeded)
        minilm_llm = LLM(str(save_tiny_m3(tmp_path / "m3", minilm_path)), dtype="float32")
    ids = [f"d{i}" for i in range(len(TEXTS))]
    queries = ["wing flutter", "heat transfer in boundary layers"]
    with Index.create(tmp_path / "local", minilm_llm, first_stage=first_stage) as local:
        local.add(TEXTS, ids)
        local.optimize()
        want = local.search(queries, k=5, prefetch=len(ids), hnsw_ef=512)
    ds = ray.data.from_items([{"_id": d, "text": t} for d, t in zip(ids, TEXTS)])  # BEIR's id column
    with Index.create(tmp_path / "ray", minilm_llm, first_stage=first_stage) as index:
        assert index_dataset(ds, index, dtype="float32", batch_size=16) == len(ids)
        assert len(index) == len(ids)
        index.optimize()
        got = index.search(queries, k=5, prefetch=len(ids), hnsw_ef=512)
    for g, w in zip(got, want):
        assert [h.id for h in g] == [h.id for h in w]
        assert np.allclose([h.score for h in g], [h.score for h in w], atol=1e-4)


@pytest.mark.parametrize(
    ("task", "model_cls"),
    [("classify", "BertForSequenceClassification"), ("token_classify", "BertForTokenClassification")],
)
def test_classifier_columns(cluster, tmp_path, minilm_path, task, model_cls):
    from tests.helpers import TINY, save_tiny_model

    folder = save_tiny_model(model_cls, "BertConfig", tmp_path / "model", minilm_path, num_labels=3, **TINY)
    ds = ray.data.from_items([{"id": str(i), "text": t} for i, t in enumerate(TEXTS[:32])])
    encode_dataset(ds, str(folder), task=task, dtype="float32", batch_size=8).write_parquet(str(tmp_path / "out"))
    rows, _ = rows_by_id(str(tmp_path / "out"))
    want = LLM(str(folder), dtype="float32").encode(TEXTS[:32], pooling_task=task, use_tqdm=False)
    for i, o in enumerate(want):
        got = np.asarray(rows[str(i)][task], dtype=np.float32)
        assert got.shape == tuple(o.outputs.data.shape) and np.allclose(got, o.outputs.data.numpy(), atol=1e-5)


def test_json_rows_read_ids_as_polyvec_embed_does():
    """The engines' JSONL reader takes ids as the plain command's reader does: a string or an integer."""
    from polyvec.integrations.ray import _json_rows

    assert _json_rows(['{"_id": 7, "text": "a"}', "", '{"id": "b", "text": "c"}'], "text") == (["7", "b"], ["a", "c"])
    for line in ('{"_id": null, "text": "a"}', '{"id": [1], "text": "a"}'):
        with pytest.raises(ValueError, match=r"not a string"):
            _json_rows([line], "text")
