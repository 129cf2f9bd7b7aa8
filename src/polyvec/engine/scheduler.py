"""Which requests, or chunks of them, go into the next forward pass (pure Python, no torch).

A batch holds at most `max_num_batched_tokens` real tokens and `max_num_seqs` sequences.

- Requests already part-way through a chunked prefill (causal models) continue first, oldest first, so
  a long prompt advances every step and its KV cache is freed as soon as possible.
- Then waiting requests, in arrival order (or, with the priority policy, by `priority`, lower first, then
  arrival): the first one that can start anchors the batch (under fcfs none waits for ever), and the rest of
  the batch is filled, inside a look-ahead window of the queue, with the requests closest to it in length
  (attention pads encoder batches to their longest sequence).
- A causal request longer than what is left of the budget gets a chunk of it and continues next step
  (chunked prefill). Encoder requests are never chunked: the engine keeps `max_model_len` within the
  budget, so each fits in a batch of its own.
- A request that keeps a KV cache reserves its whole length in `kv_cache_tokens` when it starts and
  frees it when it finishes; when the cache is full it waits in the queue rather than failing, and no
  younger request takes cache before it.
- With prefix caching, a request's leading tokens whose keys and values are cached are not scheduled at
  all (`prefix_probe`), and two new requests whose next uncached block is the same are not started in the
  same step: the second waits one step and then finds the block cached, so a shared prefix is computed once.
"""

from __future__ import annotations

import heapq
import threading
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar


class Schedulable(Protocol):
    request_id: str
    num_computed_tokens: int  # tokens already in the request's KV cache and pooling state
    chunkable: bool  # a causal model's request: may be split across steps

    @property
    def num_tokens(self) -> int: ...


# The caller's request type: the scheduler reads only the `Schedulable` attributes, and hands the same
# objects back in its chunks, typed as the caller's (the engine's `Request`).
R = TypeVar("R", bound=Schedulable)


def _priority(request: Schedulable) -> int:
    return getattr(request, "priority", 0)


@dataclass
class ScheduledChunk(Generic[R]):
    """Tokens [start, start + num_tokens) of a request; those before `start` are in its KV cache."""

    request: R
    start: int
    num_tokens: int

    @property
    def is_first(self) -> bool:
        return self.start == 0

    @property
    def is_last(self) -> bool:
        return self.start + self.num_tokens == self.request.num_tokens

    @property
    def is_whole(self) -> bool:
        return self.is_first and self.is_last


# prefix_probe(request) → (tokens whose KV is cached, key of the next uncached block or None)
PrefixProbe = Callable[[R], tuple[int, Hashable | None]]


class Scheduler(Generic[R]):
    def __init__(
        self,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        lookahead: int = 2048,
        *,
        kv_cache_tokens: int = 0,
        cache_every_causal: bool = False,
        prefix_probe: PrefixProbe[R] | None = None,
        policy: str = "fcfs",
    ):
        self.policy = policy
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.lookahead = max(lookahead, max_num_seqs)
        self.kv_cache_tokens = kv_cache_tokens
        self.cache_every_causal = cache_every_causal
        self.prefix_probe = prefix_probe
        self.kv_used = 0
        self._reserved: dict[str, int] = {}
        # A server aborts from its event loop while the engine thread releases finished requests.
        self._kv_lock = threading.Lock()
        # Requests of the batch being run: one aborted meanwhile keeps its KV reservation until the step ends
        # (its chunk is running on it; vLLM frees an aborted request's blocks between steps too).
        self._in_flight: set[str] = set()
        self._deferred: set[str] = set()
        self.waiting: deque[R] = deque()
        self.running: list[R] = []  # started, not yet fully scheduled (chunked prefill)

    def add(self, request: R) -> None:
        self.add_all([request])

    def add_all(self, requests: Iterable[R]) -> None:
        """Queue requests: last (fcfs), or under the priority policy after every waiting request of their
        `priority` or lower (lower values first, ties in arrival order): one merge of the sorted queue with the
        call's requests, linear in the queue (inserting one by one was quadratic: seconds on the event loop)."""
        if self.policy != "priority":
            self.waiting.extend(requests)
            return
        new = sorted(requests, key=_priority)  # stable: a call's requests keep their order
        if new and self.waiting and _priority(new[0]) < _priority(self.waiting[-1]):
            self.waiting = deque(heapq.merge(self.waiting, new, key=_priority))  # ties: the queue's first
        else:
            self.waiting.extend(new)

    def abort(self, request_ids: set[str]) -> int:
        """Drop waiting and part-way requests (e.g. their client went away); returns how many."""
        before = len(self.waiting) + len(self.running)
        self.waiting = deque(r for r in self.waiting if r.request_id not in request_ids)
        self.running = [r for r in self.running if r.request_id not in request_ids]
        with self._kv_lock:
            running = request_ids & self._in_flight
            self._deferred |= running
        for rid in request_ids - running:
            self.release(rid)
        return before - len(self.waiting) - len(self.running)

    def hold(self, request_ids: set[str]) -> None:
        """Requests about to run outside a scheduled step (a batch's chunks run again after a fault): as for a
        step's, an abort meanwhile keeps their reservations until the run ends (`end_step`)."""
        with self._kv_lock:
            self._in_flight = set(request_ids)

    def aborted_in_step(self) -> set[str]:
        """The requests of the running batch aborted while it ran."""
        with self._kv_lock:
            return set(self._deferred)

    def end_step(self) -> None:
        """The scheduled batch ran (or failed): release what was aborted while it ran."""
        with self._kv_lock:
            deferred, self._deferred, self._in_flight = self._deferred, set(), set()
        for rid in deferred:
            self.release(rid)

    def release(self, request_id: str) -> None:
        """The request finished (or failed): give back its KV cache reservation."""
        with self._kv_lock:
            self.kv_used -= self._reserved.pop(request_id, 0)

    def holds_cache(self, request_id: str) -> bool:
        return request_id in self._reserved

    def needs_cache(self, request: R, remaining: int, budget: int) -> bool:
        return request.chunkable and (self.cache_every_causal or remaining > budget or request.num_computed_tokens > 0)

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or bool(self.running)

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> list[ScheduledChunk[R]]:
        chunks: list[ScheduledChunk[R]] = []
        budget, seqs = self.max_num_batched_tokens, self.max_num_seqs
        still_running = []
        for r in self.running:
            if budget and seqs:
                n = min(r.num_tokens - r.num_computed_tokens, budget)
                chunks.append(ScheduledChunk(r, r.num_computed_tokens, n))
                budget, seqs = budget - n, seqs - 1
                if r.num_computed_tokens + n < r.num_tokens:
                    still_running.append(r)
            else:
                still_running.append(r)
        self.running = still_running
        if budget and seqs and self.waiting:
            chunks += self._admit(budget, seqs)
        for c in chunks:
            c.request.num_computed_tokens = c.start + c.num_tokens
        with self._kv_lock:
            self._in_flight = {c.request.request_id for c in chunks}
        return chunks

    def _admit(self, budget: int, seqs: int) -> list[ScheduledChunk[R]]:
        window = [self.waiting.popleft() for _ in range(min(self.lookahead, len(self.waiting)))]
        cached: list[int] = [0] * len(window)
        keys: list[Hashable | None] = [None] * len(window)
        if self.prefix_probe is not None:
            for i, r in enumerate(window):
                if r.chunkable and r.num_computed_tokens == 0:
                    cached[i], keys[i] = self.prefix_probe(r)
        remaining = [r.num_tokens - r.num_computed_tokens - c for r, c in zip(window, cached)]
        chosen: dict[int, int] = {}  # window index → tokens scheduled
        chosen_keys: set[Hashable] = set()
        # the oldest request refused for want of KV cache: no younger one takes cache before it (a stream of later
        # requests would keep it waiting for as long as they come; vLLM stops at such a request likewise)
        kv_blocked = len(window)

        def try_take(i: int, allow_chunk: bool) -> bool:
            nonlocal budget, seqs, kv_blocked
            r, n = window[i], remaining[i]
            if n > budget:
                if not (allow_chunk and r.chunkable):
                    return False
                n = budget
            if keys[i] is not None and keys[i] in chosen_keys:
                return False  # same uncached prefix block as a request already in this batch
            if self.needs_cache(r, remaining[i], budget):
                if i > kv_blocked:
                    return False
                with self._kv_lock:
                    if self.kv_used + r.num_tokens > self.kv_cache_tokens:
                        kv_blocked = min(kv_blocked, i)
                        return False  # wait for the cache to free up
                    self.kv_used += r.num_tokens
                    self._reserved[r.request_id] = r.num_tokens
            chosen[i] = n
            if keys[i] is not None:
                chosen_keys.add(keys[i])
            budget, seqs = budget - n, seqs - 1
            return True

        anchor = next((i for i in range(len(window)) if try_take(i, allow_chunk=True)), None)
        if anchor is not None and budget and seqs:
            # Fill with the requests closest in length to the anchor (older first on ties); under the priority
            # policy, a higher priority's before any lower one's
            rank = (lambda i: _priority(window[i])) if self.policy == "priority" else (lambda i: 0)
            order = sorted(
                (i for i in range(len(window)) if i != anchor),
                key=lambda i: (rank(i), abs(remaining[i] - remaining[anchor]), i),
            )
            shortest = min((remaining[i] for i in order), default=0)
            for i in order:
                if not budget or not seqs or shortest > budget:
                    break
                try_take(i, allow_chunk=False)

        chunks: list[ScheduledChunk[R]] = []
        for i in sorted(chosen):
            r, n = window[i], chosen[i]
            start = r.num_computed_tokens + cached[i]
            chunks.append(ScheduledChunk(r, start, n))
            if start + n < r.num_tokens:
                self.running.append(r)
        self.waiting.extendleft(reversed([r for i, r in enumerate(window) if i not in chosen]))
        return chunks
