"""Prepacked oneDNN linears (layers/linear.py): where oneDNN has no bf16 matmul, bf16 models keep plain ones."""

from __future__ import annotations

import os
import subprocess
import sys

_AVX2_BF16 = """
import torch, torch.nn.functional as F
from polyvec import LLM
from polyvec.layers.linear import PackedLinear, onednn_bf16
texts = ["wing flutter at supersonic speed", "heat transfer in a laminar boundary layer"]
bf16 = LLM({model!r}, dtype="bfloat16")
ref = LLM({model!r}, dtype="float32")
x = torch.stack([o.outputs.data.float() for o in bf16.embed(texts, use_tqdm=False)])
y = torch.stack([o.outputs.data for o in ref.embed(texts, use_tqdm=False)])
modules = bf16.engine.runner.model.modules()
packed = sum(isinstance(m, PackedLinear) and m.weight.dtype == torch.bfloat16 for m in modules)
print(onednn_bf16(), packed, F.cosine_similarity(x, y).min().item())
"""


def test_bfloat16_where_onednn_has_no_bf16_matmul(minilm_path):
    """oneDNN capped to AVX2 (as on AVX2-only laptops and desktops, where it has no bf16 path): dtype bfloat16
    crashed at load packing its first weight (mkldnn_reorder_linear_weight: bf16 path needs ...); it runs on
    plain linears now, as close to float32 as bf16 is."""
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2")
    script = _AVX2_BF16.format(model=str(minilm_path))
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    supported, packed, cosine = run.stdout.split()
    assert (supported, packed) == ("False", "0")
    assert float(cosine) > 0.999
