"""The model runner's packing: token counts rounded up to oneDNN-friendly buckets by dummy sequences, whose
kernels the warm-up compiles."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from polyvec.engine.model_runner import bucket_padding
from polyvec.platforms.cpu import PRIMITIVE_CACHE_CAPACITY


@pytest.mark.parametrize("tokens", [1, 7, 8, 11, 255, 256, 1000, 4000, 4097, 8100, 8192, 16383])
def test_bucket_padding_rounds_up_by_at_most_a_16th(tokens):
    pad = sum(bucket_padding(tokens, 512))
    padded = tokens + pad
    step = max(8, (1 << (tokens.bit_length() - 1)) // 16)
    assert padded % step == 0 and 0 <= pad < step
    assert pad <= max(7, tokens // 16)


def test_bucket_padding_splits_dummies_at_the_model_length():
    assert bucket_padding(4000, 512) == [96]  # 4000 → 4096 (steps of 128 between 2048 and 4096)
    assert bucket_padding(4000, 40) == [40, 40, 16]
    assert bucket_padding(8192, 512) == []


def test_few_bucket_sizes_over_all_batch_sizes():
    """The point of buckets: polyvec's oneDNN primitive cache holds every shape a model needs, the four
    projections of every bucket size up to the largest default token budget (8,192), two entries each (the
    inner product and its nested matmul), with room for heads."""
    sizes = {n + sum(bucket_padding(n, 512)) for n in range(1, 8193)}
    assert len(sizes) <= 115
    assert 2 * 4 * len(sizes) <= PRIMITIVE_CACHE_CAPACITY - 48


def test_padded_batches_change_no_output(minilm_llm, cranfield_texts):
    runner = minilm_llm.engine.runner
    assert runner.pad_to_bucket, "oneDNN and the packed kernel are there on CPU"
    texts = cranfield_texts[:13]  # a token count that is not a bucket size
    assert sum(bucket_padding(sum(len(o.prompt_token_ids) for o in minilm_llm.embed(texts, use_tqdm=False)), 256)) > 0
    padded_e = torch.stack([o.outputs.data for o in minilm_llm.embed(texts, use_tqdm=False)])
    padded_t = [o.outputs.data for o in minilm_llm.token_embed(texts, use_tqdm=False)]
    runner.pad_to_bucket = False
    try:
        plain_e = torch.stack([o.outputs.data for o in minilm_llm.embed(texts, use_tqdm=False)])
        plain_t = [o.outputs.data for o in minilm_llm.token_embed(texts, use_tqdm=False)]
    finally:
        runner.pad_to_bucket = True
    assert (padded_e - plain_e).abs().max() <= 1e-6
    for a, b in zip(padded_t, plain_t):
        assert a.shape == b.shape and (a - b).abs().max() <= 1e-6


_AFTER_WARMUP = """
import random, sys
from polyvec import LLM
llm = LLM(sys.argv[1], dtype=sys.argv[2])
assert llm.engine.runner.pad_to_bucket, "oneDNN and the packed kernel are there on CPU"
sizes = list(llm.engine.warmup())
print("WARM-UP DONE", len(sizes), flush=True)
rng = random.Random(0)
for _ in range(int(sys.argv[3])):  # batches of every size, as a server sees them
    n = rng.choice([1, 2, 3, 5, 8, 13, 21, 34])
    llm.embed([" ".join(["word"] * rng.randint(3, 500)) for _ in range(n)], use_tqdm=False)
print("END", flush=True)
"""


@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_no_kernel_is_compiled_after_the_warm_up(minilm_path, dtype):
    """oneDNN reports every primitive it builds (ONEDNN_VERBOSE): after the warm-up, batches of any size find
    theirs in the cache, so no step pays for a compile and memory stops growing."""
    out = subprocess.run(
        [sys.executable, "-c", _AFTER_WARMUP, str(minilm_path), dtype, "60"],
        env={**os.environ, "ONEDNN_VERBOSE": "profile_create", "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    before, _, after = out.stdout.partition("WARM-UP DONE")
    assert "END" in after
    sizes = int(after.split()[0])
    assert sizes >= 90  # up to the default token budget: 4,096 (float32) or 8,192 (bfloat16) tokens
    compiled = [line for line in before.splitlines() if "create:cache_miss" in line and "inner_product" in line]
    # four projections per size; with AMX, sizes of at most 64 rows run polyvec's own kernel instead
    assert len(compiled) >= 4 * (sizes - 8), "the warm-up compiles the projections of every bucket size"
    late = [line for line in after.splitlines() if "create:cache_miss" in line]
    assert late == [], f"{len(late)} primitives compiled after the warm-up, e.g. {late[:2]}"
