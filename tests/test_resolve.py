"""Model resolution: local folders, the offline and error paths, and real downloads from a loopback hub.

Downloads run `huggingface_hub` for real against `tests/fakehub.py` through `HF_ENDPOINT`, in child processes
(huggingface_hub reads the endpoint at import, and this process is forced offline by conftest.py).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from polyvec import LLM, resolve
from polyvec.resolve import ModelNotFoundError, files_to_download, resolve_model_path
from tests.conftest import DATA, REPO
from tests.fakehub import FakeHub

CORPUS = str(DATA / "cranfield" / "corpus.jsonl")


def test_offline_unknown_id_names_the_fix_and_only_installed_packages(tmp_path, monkeypatch):
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model_path("no-such-org/no-such-model", download_dir=str(tmp_path))
    msg = str(info.value)
    assert "\n" not in msg and "'no-such-org/no-such-model'" in msg and "HF_HUB_OFFLINE=1" in msg
    shipped = "(models in installed packages, used when no revision is given: sentence-transformers/all-MiniLM-L6-v2)"
    assert shipped in msg
    monkeypatch.setattr(resolve, "_installed", lambda dist: False)
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model_path("no-such-org/no-such-model", download_dir=str(tmp_path))
    assert "installed packages" not in str(info.value)
    # The packaged default model is not found through a package that is not installed.
    with pytest.raises(ModelNotFoundError, match="HF_HUB_OFFLINE"):
        resolve_model_path("sentence-transformers/all-MiniLM-L6-v2", download_dir=str(tmp_path))


def test_hub_id_resolves_from_hugging_face_cache(tmp_path, minilm_path):
    """A standard HF cache entry (models--org--name/snapshots/<rev>) is found offline."""
    rev = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--acme--mini"
    shutil.copytree(minilm_path, repo / "snapshots" / rev)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    found = resolve_model_path("acme/mini", download_dir=str(tmp_path))
    assert found == repo / "snapshots" / rev
    llm = LLM("acme/mini", download_dir=str(tmp_path), dtype="float32")
    assert llm.embed("hello", use_tqdm=False)[0].outputs.data.shape == (384,)


def test_folders_that_are_not_checkpoints(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="is a folder but not a checkpoint: it has no config.json"):
        resolve_model_path(tmp_path / "empty")
    with pytest.raises(ModelNotFoundError, match="is not a folder \\(no such path\\)"):
        resolve_model_path(str(tmp_path / "missing" / "model"))
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(ModelNotFoundError, match="is not a folder: pass a checkpoint folder"):
        resolve_model_path(str(tmp_path / "file.txt"))


def test_files_to_download_keeps_what_the_loader_reads():
    repo = [
        "config.json",
        "modules.json",
        "tokenizer.json",
        "vocab.txt",
        "README.md",
        "model.safetensors",
        "pytorch_model.bin",
        "tf_model.h5",
        "onnx/model.onnx",
        "onnx/config.json",
        "openvino/x.xml",
        "1_Pooling/config.json",
        "2_Dense/config.json",
        "2_Dense/pytorch_model.bin",
        "sharded/model-00001-of-00002.safetensors",
        "sharded/model-00002-of-00002.safetensors",
        "sharded/model.safetensors.index.json",
        "artifact.metadata",
        "merges.txt",
    ]
    assert files_to_download(repo) == sorted(
        [
            "config.json",
            "modules.json",
            "tokenizer.json",
            "vocab.txt",
            "model.safetensors",
            "1_Pooling/config.json",
            "2_Dense/config.json",
            "2_Dense/pytorch_model.bin",
            "sharded/model-00001-of-00002.safetensors",
            "sharded/model-00002-of-00002.safetensors",
            "sharded/model.safetensors.index.json",
            "artifact.metadata",
        ]
    )


def _hub_env(tmp_path: Path, url: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return {
        **env,
        "HF_ENDPOINT": url,
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_OFFLINE": "0",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        **extra,
    }


@pytest.fixture(scope="module")
def hub_repo(tmp_path_factory, minilm_path) -> Path:
    """MiniLM as a hub repo, with files polyvec must not fetch beside it."""
    repo = tmp_path_factory.mktemp("hub") / "minilm"
    shutil.copytree(minilm_path, repo)
    (repo / "onnx").mkdir()
    (repo / "onnx" / "model.onnx").write_bytes(b"\0" * 1000)
    (repo / "pytorch_model.bin").write_bytes(b"\0" * 1000)  # safetensors are there: never fetched
    (repo / "README.md").write_text("# mini\n")
    return repo


def test_cli_downloads_a_hub_id_then_runs_from_the_cache(tmp_path, hub_repo):
    cmd = [
        sys.executable,
        "-m",
        "polyvec",
        "embed",
        CORPUS,
        "--model",
        "acme/minilm",
        "--limit",
        "4",
        "--quiet",
        "--dtype",
        "float32",
    ]
    with FakeHub({"acme/minilm": hub_repo}) as hub:
        out = subprocess.run(
            cmd, env=_hub_env(tmp_path, hub.url), cwd=REPO, capture_output=True, text=True, timeout=300
        )
        fetched = sorted(
            r.split("/resolve/", 1)[1].split("/", 1)[1]
            for r in hub.requests
            if r.startswith("GET ") and "/resolve/" in r
        )
    assert out.returncode == 0, out.stderr
    assert "embedded 4 texts" in out.stdout
    assert "downloading acme/minilm from the Hugging Face hub" in out.stderr
    assert fetched == sorted(
        [
            "1_Pooling/config.json",
            "config.json",
            "config_sentence_transformers.json",
            "data_config.json",
            "model.safetensors",
            "modules.json",
            "sentence_bert_config.json",
            "special_tokens_map.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "vocab.txt",
        ]
    )
    snapshot = next((tmp_path / "hf" / "hub" / "models--acme--minilm" / "snapshots").iterdir())
    assert (snapshot / "model.safetensors").read_bytes() == (hub_repo / "model.safetensors").read_bytes()
    # The hub is gone and downloads are off: the cached copy is used.
    again = subprocess.run(
        cmd,
        env=_hub_env(tmp_path, "http://127.0.0.1:9", HF_HUB_OFFLINE="1"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr
    assert "embedded 4 texts" in again.stdout and "downloading" not in again.stderr


def test_download_errors_are_one_line_naming_the_id_and_the_fix(tmp_path, hub_repo):
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    dead_url = f"http://127.0.0.1:{closed.getsockname()[1]}"  # bound, never listening: connection refused
    script = """
import json, os, sys
from polyvec.resolve import ModelNotFoundError, resolve_model_path
out = {}
for name, model, revision in json.loads(sys.argv[1]):
    if name == "unreachable":
        import huggingface_hub.constants as c
        c.ENDPOINT = os.environ["DEAD_URL"]
    try:
        resolve_model_path(model, revision=revision)
        out[name] = "resolved"
    except ModelNotFoundError as exc:
        out[name] = str(exc)
print(json.dumps(out))
"""
    cases = [
        ("typo", "acme/minilmm", None),
        ("gated", "acme/gated", None),
        ("revision", "acme/minilm", "v9"),
        ("invalid", "acme/bad name!", None),
        ("unreachable", "acme/minilm", None),
    ]
    with FakeHub({"acme/minilm": hub_repo, "acme/gated": hub_repo}, gated={"acme/gated"}, token="hf_sekret") as hub:
        env = _hub_env(tmp_path, hub.url, DEAD_URL=dead_url)
        out = subprocess.run(
            [sys.executable, "-c", script, json.dumps(cases)], env=env, capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, out.stderr
        msgs = json.loads(out.stdout)
        with_token = subprocess.run(
            [sys.executable, "-c", script, json.dumps(cases[1:2])],
            env={**env, "HF_TOKEN": "hf_sekret"},
            capture_output=True,
            text=True,
            timeout=300,
        )
    closed.close()
    assert json.loads(with_token.stdout) == {"gated": "resolved"}, with_token.stderr
    assert all("\n" not in m for m in msgs.values())
    assert "'acme/minilmm' was not found on the Hugging Face hub: check the id" in msgs["typo"]
    assert "'acme/gated' is gated" in msgs["gated"] and "HF_TOKEN" in msgs["gated"]
    assert "has no revision 'v9'" in msgs["revision"]
    assert "'acme/bad name!' is neither a local folder nor a hub id" in msgs["invalid"]
    assert "could not be reached" in msgs["unreachable"] and "'acme/minilm'" in msgs["unreachable"]
    # the models that need no hub are named there too, as offline (they were not)
    assert "used when no revision is given: sentence-transformers/all-MiniLM-L6-v2" in msgs["unreachable"]


def test_cli_failure_is_one_line_without_traceback(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "polyvec", "embed", CORPUS, "--model", "no-such-org/no-such-model"],
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert lines[0].startswith("polyvec: error: model 'no-such-org/no-such-model'")


def test_a_lora_adapter_on_the_hub_brings_its_base_model(tmp_path, hub_repo, minilm_path):
    """An adapter repo (adapter_config.json naming a base repo, as vidore/colqwen2-v1.0 does): both are
    downloaded, the adapter merged; offline afterwards, both come from the cache."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModel

    adapter = tmp_path / "adapter"
    model = peft.get_peft_model(AutoModel.from_pretrained(minilm_path), peft.LoraConfig(r=2, target_modules=["query"]))
    model.save_pretrained(adapter)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": "acme/minilm"}))
    cmd = [sys.executable, "-m", "polyvec", "embed", CORPUS, "--model", "acme/minilm-lora", "--limit", "2", "--quiet"]
    with FakeHub({"acme/minilm": hub_repo, "acme/minilm-lora": adapter}) as hub:
        out = subprocess.run(
            cmd, env=_hub_env(tmp_path, hub.url), cwd=REPO, capture_output=True, text=True, timeout=300
        )
        fetched = {r.split("/resolve/", 1)[1] for r in hub.requests if r.startswith("GET ") and "/resolve/" in r}
    assert out.returncode == 0, out.stderr
    assert "embedded 2 texts" in out.stdout
    assert any(f.endswith("/adapter_model.safetensors") for f in fetched)
    assert any(f.endswith("/model.safetensors") for f in fetched)  # the base's weights
    offline = _hub_env(tmp_path, "http://127.0.0.1:9", HF_HUB_OFFLINE="1")
    again = subprocess.run(cmd, env=offline, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr


def test_a_hub_that_never_answers_is_unreachable_not_a_hang(tmp_path):
    """A hub (a stuck proxy, a firewall dropping packets) that accepts the connection and never answers held
    `polyvec serve MODEL` for ever, silent: the repo lookup had no timeout. It now times out as huggingface_hub's
    metadata requests do (HF_HUB_ETAG_TIMEOUT) and says the hub could not be reached."""
    import threading
    import time

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])  # accepted, never answered
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    script = (
        "from polyvec.resolve import ModelNotFoundError, resolve_model_path\n"
        "try:\n    resolve_model_path('acme/silent')\nexcept ModelNotFoundError as exc:\n    print(exc)\n"
    )
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    start = time.monotonic()
    try:
        out = subprocess.run([sys.executable, "-c", script], env=_hub_env(tmp_path, url, HF_HUB_ETAG_TIMEOUT="2"),
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        listener.close()
    assert "could not be reached" in out.stdout and "'acme/silent'" in out.stdout, (out.stdout, out.stderr[-2000:])
    assert time.monotonic() - start < 60


def test_a_download_does_not_wait_on_a_stalled_tree_listing(tmp_path, hub_repo):
    """After the repo lookup, snapshot_download listed the repo's tree with no timeout: a hub stalling there
    hung the start for ever. The files are fetched one by one now, each request timed out, without the listing."""
    script = "from polyvec.resolve import resolve_model_path; print(resolve_model_path('acme/minilm'))"
    with FakeHub({"acme/minilm": hub_repo}) as hub:
        hub.stall_trees = True
        out = subprocess.run([sys.executable, "-c", script], env=_hub_env(tmp_path, hub.url, HF_HUB_ETAG_TIMEOUT="2"),
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        assert not any("/tree/" in r for r in hub.requests), hub.requests
    folder = Path(out.stdout.strip())
    assert (folder / "config.json").is_file() and (folder / "1_Pooling" / "config.json").is_file()


def test_a_download_takes_every_file_from_one_commit(tmp_path, hub_repo):
    """A branch pushed to while the files download: fetched file by file by branch name, they went to two
    snapshots, neither whole. Every file comes from the commit the repo lookup named, and the branch's ref
    names that snapshot for later starts offline."""

    class MovingHub(FakeHub):
        lookups = 0

        def _check(self, repo_id, rev, auth):
            first, pushed = self.sha(repo_id), "f" * 40
            if rev in (first, pushed):
                return rev
            self.lookups += 1
            return first if self.lookups <= 2 else super()._check(repo_id, rev, auth) and pushed

    script = "from polyvec.resolve import resolve_model_path; print(resolve_model_path('acme/minilm'))"
    with MovingHub({"acme/minilm": hub_repo}) as hub:
        out = subprocess.run([sys.executable, "-c", script], env=_hub_env(tmp_path, hub.url), capture_output=True,
                             text=True, timeout=120)  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        first = hub.sha("acme/minilm")
    folder = Path(out.stdout.strip())
    assert folder.name == first and (folder / "tokenizer.json").is_file() and (folder / "model.safetensors").is_file()
    assert (folder.parent.parent / "refs" / "main").read_text() == first
    assert [p.name for p in folder.parent.iterdir()] == [first]  # one snapshot


def test_a_failed_download_is_finished_by_the_next_start(tmp_path, hub_repo):
    """A download that failed part-way left a snapshot holding config.json, which the next start took for the
    cached model (and failed on its missing tokenizer, for good). The files that mark a checkpoint come last
    now: the next start finds nothing that looks whole, and downloads the rest."""
    from polyvec.resolve import CHECKPOINT_FILES

    class FailingHub(FakeHub):
        broken = True

        def _file(self, repo_id, path, sha):
            if self.broken and path == "tokenizer.json":
                raise RuntimeError("the connection dropped")  # the handler thread dies: no answer
            return super()._file(repo_id, path, sha)

    script = "from polyvec.resolve import resolve_model_path; print(resolve_model_path('acme/minilm'))"
    with FailingHub({"acme/minilm": hub_repo}) as hub:
        env = _hub_env(tmp_path, hub.url, HF_HUB_ETAG_TIMEOUT="2", HF_HUB_DOWNLOAD_TIMEOUT="2")
        failed = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
        assert "could not be reached" in failed.stdout + failed.stderr, (failed.stdout, failed.stderr[-2000:])
        cached = list((tmp_path / "hf").rglob("snapshots/*/*"))
        assert cached and not any(p.name in CHECKPOINT_FILES for p in cached)  # nothing that looks whole
        hub.broken = False
        again = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]
    assert (Path(again.stdout.strip()) / "tokenizer.json").is_file()


def test_a_download_at_a_commit_that_failed_is_not_taken_for_the_model(tmp_path, hub_repo):
    """At a commit sha (no branch ref to write last), a download that failed after config.json and before
    modules.json left a snapshot found through config.json: the next start loaded it as a bare transformers
    model, without its pooling (other vectors), and never finished the download. A snapshot
    being downloaded is marked until every file is there."""

    class FailingHub(FakeHub):
        broken = True

        def _file(self, repo_id, path, sha):
            if self.broken and path == "modules.json":
                raise RuntimeError("the connection dropped")
            return super()._file(repo_id, path, sha)

    script = "import sys; from polyvec.resolve import resolve_model_path; print(resolve_model_path(*sys.argv[1:]))"
    with FailingHub({"acme/minilm": hub_repo}) as hub:
        sha = hub.sha("acme/minilm")
        env = _hub_env(tmp_path, hub.url, HF_HUB_ETAG_TIMEOUT="2", HF_HUB_DOWNLOAD_TIMEOUT="2")
        run = [sys.executable, "-c", script, "acme/minilm", sha]
        failed = subprocess.run(run, env=env, capture_output=True, text=True, timeout=120)
        assert failed.returncode != 0 and "could not be reached" in failed.stderr, failed.stderr[-2000:]
        requests = len(hub.requests)
        hub.broken = False
        again = subprocess.run(run, env=env, capture_output=True, text=True, timeout=120)
        assert len(hub.requests) > requests  # downloaded again, not taken from the partial snapshot
    assert again.returncode == 0, again.stderr[-2000:]
    folder = Path(again.stdout.strip())
    assert (folder / "modules.json").is_file() and not (folder / ".polyvec-downloading").exists()
