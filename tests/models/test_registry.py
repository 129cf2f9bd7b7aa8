"""Building a model: from the meta device to real tensors without the imports and work a start does not need."""

from __future__ import annotations

import subprocess
import sys

import torch
from torch import nn

from polyvec.models.registry import _materialize
from tests.conftest import REPO


def test_loading_imports_neither_dynamo_nor_sympy(minilm_path, mpnet_path):
    """Random init of embeddings and `to_empty` on meta tensors import torch._dynamo and sympy, most of a
    MiniLM load's time. Neither is needed to load and run a model."""
    code = (
        "import sys; from polyvec import LLM\n"
        f"for path in [{str(minilm_path)!r}, {str(mpnet_path)!r}]:\n"
        "    LLM(path, dtype='float32').encode(['a short text'], pooling_task='token_embed', use_tqdm=False)\n"
        "print(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "[]"


def test_materialize_keeps_shapes_dtypes_and_sharing():
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, dtype=torch.bfloat16))
        model[1].weight = model[0].weight  # tied, as decoders' lm_head and embed_tokens can be
        model.register_buffer("table", torch.zeros(3), persistent=False)
    _materialize(model, "cpu")
    assert all(t.device.type == "cpu" for t in [*model.parameters(), *model.buffers()])
    assert model[1].weight is model[0].weight and isinstance(model[0].weight, nn.Parameter)
    assert model[1].bias.dtype == torch.bfloat16 and model[1].bias.shape == (10,)
    assert model.table.shape == (3,) and not isinstance(model.table, nn.Parameter)
