"""Prefix caching on a causal model: a shared instruction prefix is computed once and results do not change."""

from __future__ import annotations

import pytest
import torch

from polyvec import LLM, PoolerConfig
from polyvec.engine.prefix_cache import BLOCK_SIZE, block_hashes
from tests.models.test_decoder_parity import save_decoder


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory, minilm_path):
    folder = tmp_path_factory.mktemp("qwen3-prefix")
    save_decoder("qwen3", "ForCausalLM", folder, minilm_path)
    return folder


def shared_prefix_prompts(n: int = 12, prefix_len: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(1000, 30000, (prefix_len,), generator=g).tolist()
    return [prefix + torch.randint(1000, 30000, (int(k % 7) + 3,), generator=g).tolist() for k in range(n)]


def test_block_hashes_are_chained():
    a = list(range(40))
    b = list(range(16)) + [99] + list(range(17, 40))
    ha, hb = block_hashes(a), block_hashes(b)
    assert len(ha) == 40 // BLOCK_SIZE
    assert ha[0] == hb[0] and ha[1] != hb[1]
    assert block_hashes(a[16:32]) != ha[1:2]  # a block's name depends on what precedes it


@pytest.mark.parametrize("pooling", ["LAST", "MEAN", "CLS", "ALL"])
@pytest.mark.parametrize("budget", [None, 16])
def test_results_unchanged_and_prefix_computed_once(qwen3_folder, pooling, budget):
    ps = shared_prefix_prompts()
    task = "token_embed" if pooling == "ALL" else "embed"
    outs = {}
    for caching in (False, True):
        llm = LLM(
            str(qwen3_folder),
            dtype="float32",
            enable_prefix_caching=caching,
            max_num_batched_tokens=budget,
            pooler_config=PoolerConfig(pooling_type=pooling),
        )
        got = llm.encode([{"prompt_token_ids": p} for p in ps], pooling_task=task, use_tqdm=False)
        outs[caching] = ([o.outputs.data for o in got], llm.engine)
    for plain, cached in zip(outs[False][0], outs[True][0]):
        assert plain.shape == cached.shape
        assert torch.allclose(plain, cached, atol=1e-5), (plain - cached).abs().max()
    plain_engine, cached_engine = outs[False][1], outs[True][1]
    total = sum(len(p) for p in ps)
    assert plain_engine.stats.num_batched_tokens == total
    # Two full blocks (32 of the 40 shared tokens) are computed by the first request only.
    reused = 2 * BLOCK_SIZE * (len(ps) - 1)
    assert cached_engine.prefix_cache.hit_tokens == reused
    # vLLM's num_cached_tokens per output: none for the first, two blocks for each later one
    assert [o.num_cached_tokens for o in got] == [0] + [2 * BLOCK_SIZE] * (len(ps) - 1)
    assert cached_engine.stats.num_batched_tokens == total - reused


def test_prefix_cache_is_bounded(qwen3_folder):
    llm = LLM(str(qwen3_folder), dtype="float32", enable_prefix_caching=True)
    llm.engine.prefix_cache.capacity_blocks = 4
    g = torch.Generator().manual_seed(6)
    ps = [torch.randint(1000, 30000, (50,), generator=g).tolist() for _ in range(10)]
    llm.embed([{"prompt_token_ids": p} for p in ps], use_tqdm=False)
    assert len(llm.engine.prefix_cache) <= 4
    assert llm.engine.scheduler.kv_used == 0  # every request gave its KV reservation back


def test_instruction_prompt_text_reuses_the_cache(qwen3_folder):
    llm = LLM(str(qwen3_folder), dtype="float32")
    instruction = "Instruct: given a question about aerodynamics, retrieve passages that answer it. Query: "
    queries = [instruction + q for q in ("stall angle", "boundary layer suction", "supersonic flutter")]
    first = llm.embed(queries[:1], use_tqdm=False)
    rest = llm.embed(queries[1:], use_tqdm=False)
    assert llm.engine.prefix_cache.hit_tokens > 0
    fresh = LLM(str(qwen3_folder), dtype="float32", enable_prefix_caching=False).embed(queries, use_tqdm=False)
    for a, b in zip(first + rest, fresh):
        assert torch.allclose(a.outputs.data, b.outputs.data, atol=1e-5)


def test_a_request_aborted_between_schedule_and_run_keeps_its_cache_for_that_step(qwen3_folder):
    """A server schedules under its lock and runs outside it; a client that leaves in between aborts its request.
    Its KV reservation is released once the step is over, not before: the chunk of a prefix-cache hit found no
    cache for its context ("a chunk with context needs its sequence's KV cache": the whole batch failed)."""
    llm = LLM(str(qwen3_folder), dtype="float32", max_num_batched_tokens=32, enable_prefix_caching=True)
    e, prefix = llm.engine, list(range(1000, 1064))
    e.add_requests(e.process([{"prompt_token_ids": [*prefix, 5, 6, 7]}], None, "embed", ["warm"]))
    while e.has_unfinished_requests():
        e.step()
    prompts = [{"prompt_token_ids": [*prefix, 8, 9, 10]}, {"prompt_token_ids": list(range(2000, 2020))}]
    e.add_requests(e.process(prompts, None, "embed", ["leaves", "stays"]))
    batch = e.schedule()
    assert [(c.request.request_id, c.start) for c in batch] == [("leaves", 64), ("stays", 0)]  # a cached prefix
    e.abort_requests({"leaves"})
    assert e.scheduler.kv_used > 0  # still held by the running step
    assert [o.request_id for o in e.run(batch)] == ["stays"]
    assert not e.has_unfinished_requests() and e.scheduler.kv_used == 0


def test_a_prefix_load_that_fails_is_loaded_again_when_the_chunk_runs_alone(qwen3_folder, monkeypatch):
    """A batch that raises while a cached prefix is loaded: its chunks run again one at a time (the server's
    recovery, AsyncEngine._after_fault). The request kept a KV cache that was allocated but never filled, so the
    rerun skipped the load and pooled over empty rows: a wrong vector with no error."""
    prefix = list(range(1000, 1064))
    a, b = {"prompt_token_ids": [*prefix, 8, 9, 10]}, {"prompt_token_ids": list(range(2000, 2020))}
    want = LLM(str(qwen3_folder), dtype="float32", enable_prefix_caching=False).embed([a, b], use_tqdm=False)
    engine = LLM(str(qwen3_folder), dtype="float32", enable_prefix_caching=True).engine
    engine.add_requests(engine.process([{"prompt_token_ids": [*prefix, 5, 6, 7]}], None, "embed", ["warm"]))
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_requests(engine.process([a, b], None, "embed", ["a", "b"]))
    batch = engine.schedule()
    assert [(c.request.request_id, c.start) for c in batch] == [("a", 64), ("b", 0)]
    load, calls = engine.prefix_cache.load, []

    def load_once_failing(*args):
        calls.append(args)
        if len(calls) == 1:
            raise MemoryError("injected while loading the cached prefix")
        return load(*args)

    monkeypatch.setattr(engine.prefix_cache, "load", load_once_failing)
    with pytest.raises(MemoryError):
        engine.run(batch)
    got = {o.request_id: o.outputs.data for c in batch for o in engine.run([c])}
    assert len(calls) == 2
    for rid, ref in zip("ab", want):
        assert torch.allclose(got[rid], ref.outputs.data, atol=1e-5), rid


def test_an_abort_while_a_chunk_runs_again_after_a_fault_keeps_its_cache(qwen3_folder, monkeypatch):
    """After a fault the server runs a batch's chunks again one at a time, outside a scheduled step: a client
    leaving meanwhile released the running chunk's KV reservation at once (as the scheduler does for a step's
    requests, it is now kept until the run ends)."""
    from polyvec.entrypoints.server.async_engine import AsyncEngine

    engine = LLM(str(qwen3_folder), dtype="float32", max_num_batched_tokens=20).engine
    async_engine = AsyncEngine(engine, warmup=False)
    engine.add_requests(engine.process([list(range(1000, 1030)), [5, 6, 7]], None, "embed", ["a", "b"]))
    assert engine.step() == []  # a's first 20 tokens, into the KV cache it holds
    batch = engine.schedule()
    assert [(c.request.request_id, c.num_tokens) for c in batch] == [("a", 10), ("b", 3)]
    execute, calls, held = engine.runner.execute, [], []

    def fault_then_abort_a(chunks):
        calls.append([c.request.request_id for c in chunks])
        if len(calls) == 1:
            raise RuntimeError("injected fault")
        if calls[-1] == ["a"]:  # a's chunk running again alone: its client leaves now
            async_engine.abort(["a"])
            held.append(engine.scheduler.holds_cache("a"))
        return execute(chunks)

    monkeypatch.setattr(engine.runner, "execute", fault_then_abort_a)
    try:
        engine.run(batch)
    except RuntimeError as exc:
        outputs, failures = async_engine._after_fault(batch, exc)
    assert calls == [["a", "b"], ["a"], ["b"]] and held == [True] and not failures
    assert [o.request_id for o in outputs] == ["b"] and not engine.scheduler.holds_cache("a")
