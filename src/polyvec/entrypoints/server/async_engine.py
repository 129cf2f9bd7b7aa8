"""One engine loop shared by every HTTP request (continuous batching).

The engine steps in a single background thread; coroutines hand it requests and await asyncio futures.
Tokenization runs in a small thread pool, off the event loop. Requests from many clients join the same
scheduler queue, so they are packed into the same forward passes under the token budget; a request whose
client went away is aborted and dropped from the queue. While the queue is empty the loop warms the engine up
(`Engine.warmup`), one batch size at a time, so requests never wait behind more than one step of it.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

from ...engine.engine import Engine, FinishError
from ...engine.input_processor import PromptError
from ...engine.request import Request
from ...multimodal.image import is_image_prompt, is_remote
from ...outputs import PoolingRequestOutput
from .errors import APIError

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _name_os_thread(name: str) -> None:
    """Give the OS thread the Python thread's name (`top -H`, /proc/PID/task/*/comm); the OpenMP workers a thread
    starts inherit it, so the engine's compute shows up under its name. Linux only; elsewhere nothing."""
    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _resolve(fut: asyncio.Future, value=None, exc: BaseException | None = None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)


def _resolve_all(results: list[tuple[asyncio.Future, Any]]) -> None:
    for fut, value in results:
        _resolve(fut, value)


def _fetches(prompt: Any) -> bool:
    """The prompt has an image to download (an http(s) URL in its multi_modal_data)."""
    data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
    images = data.get("image") if isinstance(data, dict) else None
    return any(is_remote(x) for x in (images if isinstance(images, (list, tuple)) else [images]))


_PROCESS_PART = 256
"""Prompts tokenized in one job of the pool (see AsyncEngine.process)."""


def _text_prompt(prompt: Any) -> bool:
    """Text, a text pair or token ids, without images: tokenized on its own, so a request's prompts can go in
    parts (images share a request's pixel budget)."""
    if isinstance(prompt, dict):
        return not prompt.get("multi_modal_data")
    return isinstance(prompt, (str, tuple, list)) and not is_image_prompt(prompt)


def _dead() -> APIError:
    return APIError(503, "the engine stopped on an internal error; the server needs a restart")


def waiting_requests(waiting: list[Any]) -> int:
    """How many requests the scheduler's waiting entries are: a long input's windows count once, as their
    request, and only while none of them has started (then the request is running)."""
    queued: dict[str, int] = {}
    tops: dict[str, Any] = {}
    for r in waiting:
        top = r.parent or r
        queued[top.request_id] = queued.get(top.request_id, 0) + 1
        tops[top.request_id] = top
    return sum(n == len(tops[rid].windows or (None,)) for rid, n in queued.items())


class AsyncEngine:
    def __init__(
        self,
        engine: Engine,
        tokenizer_threads: int = 2,
        on_batch: Callable[[int, int, float], None] | None = None,
        on_abort: Callable[[int], None] | None = None,
        warmup: bool = True,
    ):
        self.engine = engine
        self.on_batch = on_batch
        self.on_abort = on_abort
        self._cond = threading.Condition()
        self._pending: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._stopping = False
        self._died: BaseException | None = None  # what ended the loop, other than a stop
        self._warmup: Iterator[int] | None = engine.warmup() if warmup else None
        self.warmed_up = threading.Event()
        self._warmup_start: float | None = None
        self._warmup_steps = 0
        if self._warmup is None:
            self.warmed_up.set()
        self._pool = ThreadPoolExecutor(
            max_workers=tokenizer_threads,
            thread_name_prefix="polyvec-tokenize",
            initializer=_name_os_thread,
            initargs=("polyvec-tokens",),
        )
        # Prompts with remote images wait on other hosts: their own threads, so a slow host never holds the
        # tokenizer pool that every other request needs.
        self._fetch_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="polyvec-fetch")
        self._thread = threading.Thread(target=self._loop, name="polyvec-engine", daemon=True)

    # ------------------------------------------------------------------------------------------- control

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=60)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._fetch_pool.shutdown(wait=False, cancel_futures=True)

    @property
    def alive(self) -> bool:
        """The engine loop is running (a health check: false once stopped, or if the loop died)."""
        return self._thread.is_alive() and not self._stopping and self._died is None

    @property
    def queue_depth(self) -> int:
        """Requests none of whose work has started (vllm:num_requests_waiting)."""
        return waiting_requests(list(self.engine.scheduler.waiting))  # one C-level copy: the engine thread appends

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    # ------------------------------------------------------------------------------------------- requests

    async def process(self, prompts, params, task, **kwargs) -> list[Request]:
        """Tokenize and verify in the thread pool (ValueError on bad input). Many text prompts go in parts of
        _PROCESS_PART, each a job of its own: other requests' jobs run between them (a large request held both
        tokenizer threads for seconds), and a request whose client left stops at the next part."""
        loop = asyncio.get_running_loop()
        pool = self._fetch_pool if any(_fetches(p) for p in prompts) else self._pool
        left = threading.Event()

        def job(start: int, end: int) -> list[Request]:
            if left.is_set():  # its client left while it waited for a tokenizer thread: not started
                raise asyncio.CancelledError
            if start == 0 and end == len(prompts):
                return self.engine.process(prompts, params, task, **kwargs)
            part = params[start:end] if isinstance(params, (list, tuple)) else params
            try:
                return self.engine.process(prompts[start:end], part, task, **kwargs)
            except PromptError as exc:  # numbered in the part: renumbered in the request
                raise exc.moved(start) from None

        whole = isinstance(params, (list, tuple)) and len(params) != len(prompts)  # the engine says what is wrong
        parts = len(prompts) > _PROCESS_PART and not whole and all(map(_text_prompt, prompts))
        step = _PROCESS_PART if parts else len(prompts)
        try:
            requests: list[Request] = []
            for start in range(0, len(prompts), max(step, 1)):
                requests += await loop.run_in_executor(pool, job, start, min(start + step, len(prompts)))
            return requests
        except asyncio.CancelledError:
            left.set()
            if self.on_abort is not None:  # dropped before they were queued: counted as the queued ones are
                self.on_abort(len(prompts))
            raise

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run other tokenizer work (/tokenize, /detokenize) in the same thread pool, off the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, partial(fn, *args, **kwargs))

    async def run(self, requests: list[Request]) -> list[PoolingRequestOutput]:
        loop = asyncio.get_running_loop()
        futures = []
        with self._cond:
            if self._stopping:
                raise RuntimeError("the engine is shutting down")
            if self._died is not None:
                raise _dead()
            for r in requests:
                fut = loop.create_future()
                self._pending[r.request_id] = (loop, fut)
                futures.append(fut)
            self.engine.add_requests(requests)
            self._cond.notify()
        try:
            return list(await asyncio.gather(*futures))
        except BaseException:
            self.abort([r.request_id for r in requests])
            raise

    def abort(self, request_ids: list[str]) -> None:
        with self._cond:
            dropped = self.engine.abort_requests(set(request_ids))
            for rid in request_ids:
                entry = self._pending.pop(rid, None)
                if entry is not None:
                    entry[0].call_soon_threadsafe(entry[1].cancel)
        if dropped:
            logger.info("dropped %d queued requests whose client went away", dropped)
            if self.on_abort is not None:
                self.on_abort(dropped)

    # ------------------------------------------------------------------------------------------- the loop

    def _warm_step(self) -> None:
        assert self._warmup is not None
        if self._warmup_start is None:
            self._warmup_start = time.perf_counter()
        try:
            next(self._warmup)
            self._warmup_steps += 1
            return
        except StopIteration:
            logger.info(
                "warm-up: kernels for %d batch sizes compiled in %.1f s",
                self._warmup_steps,
                time.perf_counter() - (self._warmup_start or 0.0),
            )
        except Exception:  # a failed warm-up costs only speed: the shapes compile when batches need them
            logger.exception("warm-up failed; kernels will compile on first use")
        self._warmup = None
        self.warmed_up.set()

    def _after_fault(
        self, batch: list[Any], exc: Exception
    ) -> tuple[list[PoolingRequestOutput], list[tuple[list[str], Exception]]]:
        """A batch raised: its requests run again one at a time, so that only the one at fault fails and the
        others are answered (a decoder's chunk rewrites its own KV rows and pooling state skips rows it has).
        Returns the outputs and, per failure, the request ids to fail and the error."""
        if len(batch) < 2:
            return [], self._fail([(c, exc) for c in batch])
        outputs: list[PoolingRequestOutput] = []
        failures: list[tuple[list[str], Exception]] = []
        failed: set[str] = set()
        for chunk in batch:
            request = chunk.request.parent or chunk.request
            if request.request_id in failed:  # a window whose sibling failed: its request failed already
                with self._cond:
                    self.engine.fail([chunk])
                continue
            try:
                self.engine.scheduler.hold({chunk.request.request_id})  # an abort meanwhile: its KV kept till the end
                outputs += self.engine.run([chunk])
            except FinishError as alone:  # the outputs that need no forward pass came with it
                outputs += alone.finished
                failures += self._fail(alone.failed)
            except Exception as alone:
                failures += self._fail([(chunk, alone)])
            failed.update(i for ids, _ in failures for i in ids)
        logger.info("after the fault, %d of %d requests failed alone", len(failed), len(batch))
        return outputs, failures

    def _fail(self, failed: list[tuple[Any, Exception]]) -> list[tuple[list[str], Exception]]:
        """Drop the requests of failed chunks; per chunk, the request ids to report and the error."""
        with self._cond:
            return [(self.engine.fail([chunk]), error) for chunk, error in failed]

    def _loop(self) -> None:
        """Steps until stopped. Should a step fail outside the forward pass (which fails its requests only), the
        loop ends: every waiting request gets 503, and so do the health checks and the requests after it."""
        _name_os_thread("polyvec-engine")
        try:
            self._steps()
        except BaseException as exc:
            logger.critical("the engine loop stopped", exc_info=True)
            with self._cond:
                self._died = exc
                entries, self._pending = list(self._pending.values()), {}
            for loop, fut in entries:
                loop.call_soon_threadsafe(partial(_resolve, fut, exc=_dead()))

    def _steps(self) -> None:
        while True:
            with self._cond:
                idle = not self.engine.has_unfinished_requests()
                while not self._stopping and idle and self._warmup is None:
                    self._cond.wait()
                    idle = not self.engine.has_unfinished_requests()
                if self._stopping and idle:
                    return
                batch = None if idle else self.engine.schedule()
            if batch is None:
                self._warm_step()
                continue
            now = time.monotonic()
            for c in batch:  # the end of a request's wait in the queue (TEI's queue time)
                first = c.request.parent or c.request
                if first.scheduled_time is None:
                    first.scheduled_time = now
            start = time.perf_counter()
            failures: list[tuple[list[str], Exception]] = []
            try:
                outputs = self.engine.run(batch)
            except FinishError as exc:  # the batch ran: the requests whose outputs failed to form fail alone
                logger.error("%s", exc, exc_info=exc.failed[0][1])
                outputs, failures = exc.finished, self._fail(exc.failed)
            except Exception as exc:  # an engine fault fails its requests only; the loop keeps serving
                logger.exception("engine step failed for %d requests", len(batch))
                outputs, failures = self._after_fault(batch, exc)
            for failed_ids, error in failures:
                with self._cond:
                    entries = [self._pending.pop(rid, None) for rid in failed_ids]
                for entry in entries:
                    if entry is not None:
                        entry[0].call_soon_threadsafe(partial(_resolve, entry[1], exc=error))
            if self.on_batch is not None:
                self.on_batch(sum(c.num_tokens for c in batch), len(batch), time.perf_counter() - start)
            with self._cond:
                entries = [self._pending.pop(o.request_id, None) for o in outputs]
            by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future, Any]]] = {}
            for out, entry in zip(outputs, entries):
                if entry is not None:
                    by_loop.setdefault(entry[0], []).append((entry[1], out))
            for loop, results in by_loop.items():  # one wake-up of each event loop per batch
                loop.call_soon_threadsafe(_resolve_all, results)
