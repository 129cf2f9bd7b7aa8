"""The CPU platform's fallbacks: with polyvec's native kernels off, oneDNN off, or both, results still match
sentence-transformers, and the paths really are the fallbacks."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from polyvec import LLM
from polyvec.layers.layernorm import LayerNorm
from polyvec.layers.linear import PackedLinear
from polyvec.platforms import KernelOptions
from tests.helpers import cosine_rows

TEXTS = ["", "a short query", "Hello, World!"]


@pytest.mark.parametrize(
    "options",
    [KernelOptions(native=False), KernelOptions(onednn=False), KernelOptions(native=False, onednn=False)],
    ids=str,
)
def test_fallbacks_match_sentence_transformers(minilm_path, st_minilm, cranfield_texts, options):
    llm = LLM(str(minilm_path), dtype="float32", kernels=options)
    runner = llm.engine.runner
    assert runner.packed_attention is False if not options.native else runner.packed_attention is not None
    assert not runner.pad_to_bucket or (options.native and options.onednn)
    layers = llm.engine.runner.model.encoder.layers
    packed = [m for m in layers.modules() if isinstance(m, PackedLinear)]
    assert bool(packed) is options.onednn
    if not options.onednn:
        assert all(type(m) is nn.Linear for m in (layers[0].qkv, layers[0].ffn_up))
    assert not any(m.native for m in llm.engine.runner.model.modules() if isinstance(m, LayerNorm)) or options.native
    texts = cranfield_texts[:16] + TEXTS
    got = torch.stack([o.outputs.data for o in llm.embed(texts, use_tqdm=False)])
    ref = torch.from_numpy(st_minilm.encode(texts, normalize_embeddings=True))
    assert cosine_rows(got, ref).min() >= 0.9999
    tokens = llm.token_embed(texts[:4], use_tqdm=False)
    ref_tokens = st_minilm.encode(texts[:4], output_value="token_embeddings")
    for out, r in zip(tokens, ref_tokens):
        assert out.outputs.data.shape == r.shape and cosine_rows(out.outputs.data, r).min() >= 0.9999


def test_kernel_options_from_the_environment(monkeypatch):
    monkeypatch.setenv("POLYVEC_DISABLE_ONEDNN", "1")
    monkeypatch.setenv("POLYVEC_DISABLE_AMX", "1")
    monkeypatch.delenv("POLYVEC_DISABLE_KERNELS", raising=False)
    assert KernelOptions.from_env() == KernelOptions(native=True, onednn=False, amx=False)


def test_the_bfloat16_measure_runs_on_one_thread_and_gives_the_threads_back():
    """dtype auto's measure runs one thread, the dtypes interleaved (on two threads a busy neighbour swung it
    across the 1.2 line from one start to the next); the process keeps its own thread count."""
    from polyvec.platforms import cpu

    before = torch.get_num_threads()
    seen = []
    real = torch.Tensor.__matmul__

    def matmul(a, b):
        seen.append((a.dtype, torch.get_num_threads()))
        return real(a, b)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "__matmul__", matmul)
        assert cpu.bf16_speedup(rounds=3) > 0
    assert torch.get_num_threads() == before
    assert {t for _, t in seen} == {1} and len(seen) == 2 + 2 * 3
    assert [d for d, _ in seen[2:4]] == [torch.float32, torch.bfloat16]  # alternated


_FORK = """
import os, signal, sys
import torch
from polyvec import LLM
llm = LLM({model!r}, dtype="float32")
if {embed_first}:
    parent = llm.embed(["hello world"] * 4, use_tqdm=False)[0].outputs.data
pid = os.fork()
if pid == 0:
    signal.alarm(60)  # the hang: the child's first parallel op waited for the parent's OpenMP pool
    child = llm.embed(["hello world"] * 4, use_tqdm=False)[0].outputs.data
    x = torch.randn(256, 384) @ torch.randn(384, 1536)  # torch itself too, not only polyvec's calls
    os._exit(0 if {embed_first} == 0 or torch.equal(child, parent) else 5)
_, status = os.waitpid(pid, 0)
print(os.WIFSIGNALED(status), os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1)
"""


@pytest.mark.parametrize("embed_first", [0, 1])
def test_a_process_forked_after_loading_a_model_embeds(minilm_path, embed_first):
    """Load once, fork workers (gunicorn --preload, DataLoader or multiprocessing workers): loading alone started
    torch's OpenMP pool, and the forked child hung at its first parallel op (sentence-transformers' children
    did not). Children run torch on one thread, as DataLoader's workers do."""
    import subprocess
    import sys

    script = _FORK.format(model=str(minilm_path), embed_first=embed_first)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["False", "0"], run.stdout
