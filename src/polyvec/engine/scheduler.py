"""Which waiting requests go into the next forward pass (pure Python, no torch).

A batch holds at most `max_num_batched_tokens` real tokens and `max_num_seqs` sequences. The oldest waiting
request is always taken (no starvation); the rest of the batch is filled, inside a look-ahead window of the
queue, with the requests closest to it in length, because attention pads each batch to its longest
sequence. Encoder requests are never longer than `max_model_len`, which the engine keeps within the budget,
so every request fits in a batch of its own.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol


class Schedulable(Protocol):
    request_id: str

    @property
    def num_tokens(self) -> int: ...


class Scheduler:
    def __init__(self, max_num_batched_tokens: int, max_num_seqs: int, lookahead: int = 2048):
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.lookahead = max(lookahead, max_num_seqs)
        self.waiting: deque[Schedulable] = deque()

    def add(self, request: Schedulable) -> None:
        self.waiting.append(request)

    def abort(self, request_ids: set[str]) -> int:
        """Drop waiting requests (e.g. their client went away); returns how many were dropped."""
        before = len(self.waiting)
        self.waiting = deque(r for r in self.waiting if r.request_id not in request_ids)
        return before - len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.waiting)

    def __len__(self) -> int:
        return len(self.waiting)

    def schedule(self) -> list[Schedulable]:
        if not self.waiting:
            return []
        window = [self.waiting.popleft() for _ in range(min(self.lookahead, len(self.waiting)))]
        lengths = [r.num_tokens for r in window]
        order = sorted(range(len(window)), key=lambda i: (lengths[i], i))
        pos = order.index(0)  # the oldest request, always scheduled
        chosen = [0]
        budget = self.max_num_batched_tokens - lengths[0]
        lo, hi = pos - 1, pos + 1
        while len(chosen) < self.max_num_seqs and (lo >= 0 or hi < len(order)):
            # Take the neighbour (in length order) whose length is closest to the oldest request's.
            take_lo = hi >= len(order) or (lo >= 0 and lengths[0] - lengths[order[lo]] <= lengths[order[hi]] - lengths[0])
            idx = order[lo] if take_lo else order[hi]
            if lengths[idx] > budget:
                if take_lo:  # shorter ones are on the low side; none of them fits either
                    break
                hi = len(order)  # longer ones will not fit; keep trying the shorter side
                continue
            chosen.append(idx)
            budget -= lengths[idx]
            if take_lo:
                lo -= 1
            else:
                hi += 1
        taken = set(chosen)
        self.waiting.extendleft(reversed([r for i, r in enumerate(window) if i not in taken]))
        return [window[i] for i in sorted(chosen)]
