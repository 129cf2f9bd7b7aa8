"""The scheduler on its own: token budget, sequence cap, fairness, length grouping, abort."""

from __future__ import annotations

import random
from dataclasses import dataclass

from polyvec.engine.scheduler import Scheduler


@dataclass
class Req:
    request_id: str
    n: int

    @property
    def num_tokens(self) -> int:
        return self.n


def drain(s: Scheduler) -> list[list[Req]]:
    batches = []
    while s.has_unfinished():
        batches.append(s.schedule())
    return batches


def test_budget_and_cap_respected_and_everything_scheduled_once():
    rng = random.Random(0)
    s = Scheduler(max_num_batched_tokens=512, max_num_seqs=8)
    reqs = [Req(str(i), rng.randint(1, 512)) for i in range(300)]
    for r in reqs:
        s.add(r)
    batches = drain(s)
    seen = [r.request_id for b in batches for r in b]
    assert sorted(seen, key=int) == [r.request_id for r in reqs]
    for b in batches:
        assert 1 <= len(b) <= 8
        assert sum(r.n for r in b) <= 512


def test_oldest_request_always_in_next_batch():
    s = Scheduler(max_num_batched_tokens=100, max_num_seqs=4)
    for i, n in enumerate([90, 5, 5, 5, 80, 10]):
        s.add(Req(str(i), n))
    while s.has_unfinished():
        oldest = s.waiting[0].request_id
        batch = s.schedule()
        assert oldest in [r.request_id for r in batch]
        assert sum(r.n for r in batch) <= 100


def test_groups_similar_lengths():
    s = Scheduler(max_num_batched_tokens=10_000, max_num_seqs=4)
    lengths = [100, 10, 101, 11, 99, 12, 102, 13]
    for i, n in enumerate(lengths):
        s.add(Req(str(i), n))
    first, second = s.schedule(), s.schedule()
    assert sorted(r.n for r in first) == [99, 100, 101, 102]
    assert sorted(r.n for r in second) == [10, 11, 12, 13]


def test_batch_keeps_arrival_order():
    s = Scheduler(max_num_batched_tokens=10_000, max_num_seqs=16)
    for i, n in enumerate([5, 3, 9, 1]):
        s.add(Req(str(i), n))
    assert [r.request_id for r in s.schedule()] == ["0", "1", "2", "3"]


def test_request_as_large_as_budget_runs_alone():
    s = Scheduler(max_num_batched_tokens=256, max_num_seqs=8)
    s.add(Req("a", 256))
    s.add(Req("b", 1))
    assert [r.request_id for r in s.schedule()] == ["a"]
    assert [r.request_id for r in s.schedule()] == ["b"]


def test_abort_drops_waiting_requests():
    s = Scheduler(max_num_batched_tokens=100, max_num_seqs=1)
    for i in range(5):
        s.add(Req(str(i), 10))
    assert s.abort({"1", "3", "zzz"}) == 2
    assert [b[0].request_id for b in drain(s)] == ["0", "2", "4"]


def test_empty_queue():
    assert Scheduler(10, 1).schedule() == []
