"""The scheduler on its own: token budget, sequence cap, fairness, length grouping, abort, chunked prefill,
KV cache reservations and prefix-cache deduplication."""

from __future__ import annotations

import random
from dataclasses import dataclass

from polyvec.engine.scheduler import ScheduledChunk, Scheduler


@dataclass
class Req:
    request_id: str
    n: int
    chunkable: bool = False
    num_computed_tokens: int = 0
    priority: int = 0
    prefix: tuple[int, str | None] = (0, None)  # what the prefix probe answers for it

    @property
    def num_tokens(self) -> int:
        return self.n


def reqs(batch: list[ScheduledChunk]) -> list[Req]:
    assert all(c.is_whole for c in batch)
    return [c.request for c in batch]


def drain(s: Scheduler, finish: bool = True) -> list[list[ScheduledChunk]]:
    batches = []
    while s.has_unfinished():
        batch = s.schedule()
        assert batch, "no progress"
        batches.append(batch)
        if finish:
            for c in batch:
                if c.is_last:
                    s.release(c.request.request_id)
    return batches


def test_budget_and_cap_respected_and_everything_scheduled_once():
    rng = random.Random(0)
    s = Scheduler(max_num_batched_tokens=512, max_num_seqs=8)
    reqs_ = [Req(str(i), rng.randint(1, 512)) for i in range(300)]
    for r in reqs_:
        s.add(r)
    batches = [reqs(b) for b in drain(s)]
    seen = [r.request_id for b in batches for r in b]
    assert sorted(seen, key=int) == [r.request_id for r in reqs_]
    for b in batches:
        assert 1 <= len(b) <= 8
        assert sum(r.n for r in b) <= 512


def test_oldest_request_always_in_next_batch():
    s = Scheduler(max_num_batched_tokens=100, max_num_seqs=4)
    for i, n in enumerate([90, 5, 5, 5, 80, 10]):
        s.add(Req(str(i), n))
    while s.has_unfinished():
        oldest = s.waiting[0].request_id
        batch = reqs(s.schedule())
        assert oldest in [r.request_id for r in batch]
        assert sum(r.n for r in batch) <= 100


def test_groups_similar_lengths():
    s = Scheduler(max_num_batched_tokens=10_000, max_num_seqs=4)
    lengths = [100, 10, 101, 11, 99, 12, 102, 13]
    for i, n in enumerate(lengths):
        s.add(Req(str(i), n))
    first, second = reqs(s.schedule()), reqs(s.schedule())
    assert sorted(r.n for r in first) == [99, 100, 101, 102]
    assert sorted(r.n for r in second) == [10, 11, 12, 13]


def test_batch_keeps_arrival_order():
    s = Scheduler(max_num_batched_tokens=10_000, max_num_seqs=16)
    for i, n in enumerate([5, 3, 9, 1]):
        s.add(Req(str(i), n))
    assert [r.request_id for r in reqs(s.schedule())] == ["0", "1", "2", "3"]


def test_request_as_large_as_budget_runs_alone():
    s = Scheduler(max_num_batched_tokens=256, max_num_seqs=8)
    s.add(Req("a", 256))
    s.add(Req("b", 1))
    assert [r.request_id for r in reqs(s.schedule())] == ["a"]
    assert [r.request_id for r in reqs(s.schedule())] == ["b"]


def test_abort_drops_waiting_requests():
    s = Scheduler(max_num_batched_tokens=100, max_num_seqs=1)
    for i in range(5):
        s.add(Req(str(i), 10))
    assert s.abort({"1", "3", "zzz"}) == 2
    assert [b[0].request.request_id for b in drain(s)] == ["0", "2", "4"]


def test_empty_queue():
    assert Scheduler(10, 1).schedule() == []


def test_long_causal_prompt_is_chunked_and_interleaved_with_short_requests():
    s = Scheduler(max_num_batched_tokens=16, max_num_seqs=8, kv_cache_tokens=1000)
    s.add(Req("long", 55, chunkable=True))
    for i in range(4):
        s.add(Req(f"short{i}", 5, chunkable=True))
    batches = drain(s)
    assert all(sum(c.num_tokens for c in b) <= 16 for b in batches)
    long_chunks = [c for b in batches for c in b if c.request.request_id == "long"]
    # Contiguous chunks covering the prompt exactly once, in order.
    assert [c.start for c in long_chunks] == [
        sum(x.num_tokens for x in long_chunks[:k]) for k in range(len(long_chunks))
    ]
    assert sum(c.num_tokens for c in long_chunks) == 55 and long_chunks[-1].is_last
    assert len(long_chunks) >= 4
    # Short requests ran whole, and before the long prompt was done.
    shorts = [(k, c) for k, b in enumerate(batches) for c in b if c.request.request_id.startswith("short")]
    assert all(c.is_whole for _, c in shorts)
    assert min(k for k, _ in shorts) < len(batches) - 1


def test_encoder_requests_are_never_chunked():
    s = Scheduler(max_num_batched_tokens=16, max_num_seqs=8)
    s.add(Req("a", 10))
    s.add(Req("b", 10))
    assert [reqs(b)[0].request_id for b in drain(s)] == ["a", "b"]


def test_requests_wait_for_kv_cache_instead_of_failing():
    s = Scheduler(max_num_batched_tokens=16, max_num_seqs=8, kv_cache_tokens=60)
    s.add(Req("x", 50, chunkable=True))  # needs a cache (longer than the budget)
    s.add(Req("y", 40, chunkable=True))  # also needs one; both do not fit at once
    first = s.schedule()
    assert [c.request.request_id for c in first] == ["x"] and s.kv_used == 50
    seen_y_before_x_done = False
    x_done = False
    while s.has_unfinished():
        batch = s.schedule()
        ids = [c.request.request_id for c in batch]
        if "y" in ids and not x_done:
            seen_y_before_x_done = True
        for c in batch:
            if c.is_last:
                s.release(c.request.request_id)
                x_done = x_done or c.request.request_id == "x"
        assert s.kv_used <= 60
    assert not seen_y_before_x_done
    assert s.kv_used == 0


def test_a_request_waiting_for_kv_cache_is_not_passed_by_younger_ones():
    """The oldest request refused for want of cache: younger ones that need cache wait behind it (they took it
    step after step, and it ran only when their chunks happened to free enough at once). A younger request that
    needs no cache (it fits in the step) still runs."""
    s = Scheduler(max_num_batched_tokens=64, max_num_seqs=8, kv_cache_tokens=200)
    s.add(Req("first", 65, chunkable=True))
    s.add(Req("big", 150, chunkable=True))  # 65 + 150 > 200: waits for "first" to finish
    finished: list[str] = []
    for step in range(40):
        s.add(Req(f"later{step}", 65, chunkable=True))
        s.add(Req(f"short{step}", 8, chunkable=True))  # one step, no cache reserved
        for c in s.schedule():
            if c.is_last:
                s.release(c.request.request_id)
                finished.append(c.request.request_id)
        assert s.kv_used <= 200
        if "big" in finished:
            break
    assert "big" in finished, finished
    before = finished[: finished.index("big")]
    assert [r for r in before if r.startswith("later")] == [], before  # none of the later cache holders first
    assert "first" in before and any(r.startswith("short") for r in before)


def test_prefix_hits_skip_cached_tokens_and_shared_prefixes_start_one_at_a_time():
    s = Scheduler(
        max_num_batched_tokens=1000,
        max_num_seqs=8,
        kv_cache_tokens=10_000,
        cache_every_causal=True,
        prefix_probe=lambda r: r.prefix,
    )
    s.add(Req("a", 40, chunkable=True, prefix=(0, "block0")))
    s.add(Req("b", 40, chunkable=True, prefix=(0, "block0")))  # same first block, not cached yet
    s.add(Req("c", 40, chunkable=True, prefix=(0, "other")))
    first = s.schedule()
    assert [c.request.request_id for c in first] == ["a", "c"]
    s.waiting[0].prefix = (32, None)  # "a" ran: b's first 32 tokens are cached now
    (second,) = s.schedule()
    assert second.request.request_id == "b" and second.start == 32 and second.num_tokens == 8 and second.is_last


def test_abort_drops_a_request_part_way_through_its_prefill():
    s = Scheduler(max_num_batched_tokens=16, max_num_seqs=8, kv_cache_tokens=100)
    s.add(Req("long", 50, chunkable=True))
    s.schedule()
    s.end_step()  # its first chunk ran
    assert s.kv_used == 50 and s.running
    assert s.abort({"long"}) == 1
    assert not s.has_unfinished() and s.kv_used == 0


def test_an_abort_during_a_step_releases_the_cache_when_the_step_ends():
    """The batch being run keeps the KV reservations of its requests until it ends, even if they are aborted."""
    s = Scheduler(max_num_batched_tokens=16, max_num_seqs=8, kv_cache_tokens=100)
    s.add(Req("long", 50, chunkable=True))
    s.schedule()
    assert s.abort({"long"}) == 1 and not s.has_unfinished()
    assert s.kv_used == 50 and s.aborted_in_step() == {"long"}
    s.end_step()
    assert s.kv_used == 0 and s.aborted_in_step() == set()


def test_the_priority_policy_serves_lower_values_first_and_ties_in_arrival_order():
    """vLLM's --scheduling-policy priority: a waiting request's `priority` orders the queue (lower first, equal
    ones as they came); fcfs, the default, keeps arrival order whatever the priorities."""
    arrivals = [("a", 5), ("b", 0), ("c", 5), ("d", -3), ("e", 0), ("f", 2**63 - 1), ("g", -(2**63))]
    for policy, want in (
        ("priority", ["g", "d", "b", "e", "a", "c", "f"]),
        ("fcfs", ["a", "b", "c", "d", "e", "f", "g"]),
    ):
        s = Scheduler(max_num_batched_tokens=100, max_num_seqs=1, policy=policy)
        for name, priority in arrivals:
            s.add(Req(name, 10, priority=priority))
        assert [c.request.request_id for batch in drain(s) for c in batch] == want, policy
    s = Scheduler(max_num_batched_tokens=100, max_num_seqs=1, policy="priority")
    s.add(Req("low", 10, priority=9))
    assert [c.request.request_id for c in s.schedule()] == ["low"]
    s.add(Req("later", 10, priority=9))
    s.add(Req("urgent", 10, priority=-1))  # arrives last, served next
    assert [c.request.request_id for batch in drain(s) for c in batch] == ["urgent", "later"]


def test_the_priority_policy_fills_a_batch_with_higher_priorities_first():
    """The batch's anchor is the first by priority; the rest of the batch was filled by closeness in length
    alone, so lower-priority requests took the step while a higher one waited for the next."""
    s = Scheduler(max_num_batched_tokens=100, max_num_seqs=8, policy="priority")
    s.add(Req("urgent-a", 10, priority=0))
    s.add(Req("urgent-b", 60, priority=0))
    for i in range(9):
        s.add(Req(f"low{i}", 10, priority=9))
    first = [c.request.request_id for c in s.schedule()]
    assert first[:2] == ["urgent-a", "urgent-b"] and first[2:] == ["low0", "low1", "low2"], first


def test_queueing_many_under_the_priority_policy_is_one_merge():
    """A call's requests are merged into the sorted queue at once (one at a time, each walked back from the
    end: quadratic, and on the server's event loop)."""
    s = Scheduler(max_num_batched_tokens=10, max_num_seqs=1, policy="priority")
    s.add_all([Req(f"old{i}", 1, priority=10) for i in range(20_000)])
    s.add_all([Req(f"new{i}", 1, priority=p) for i, p in enumerate([0, 10, 5, 0])])
    order = [r.request_id for r in s.waiting]
    assert order[:3] == ["new0", "new3", "new2"] and order[-1] == "new1" and len(order) == 20_004
    assert order[3:-1] == [f"old{i}" for i in range(20_000)]  # ties: those queued first stay first
