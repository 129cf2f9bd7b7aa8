"""The engine: requests in, pooled outputs out.

`process` turns prompts into verified `Request`s (`input_processor.py`; thread-safe and free of engine state,
so a server can run it off its event loop), `add_requests` queues them, and each `step` runs one scheduled
batch through the model and returns the requests it finished.

Causal models prefill prompts longer than the token budget in chunks across steps (KV cache + pooling
state, see `scheduler.py`), and reuse cached prompt prefixes (`prefix_cache.py`). Inputs longer than
`max_model_len` are, when asked (`long_input="window"`), split into window requests that run like any other
and are combined when the last one finishes (`long_input.py`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import EngineConfig, ModelConfig
from ..layers.pooler import PoolingState
from ..loader import tokenizer_max_length
from ..muvera import MuveraParams, muvera_for
from ..outputs import PoolingOutput, PoolingRequestOutput
from ..pooling_params import PoolingParams
from ..token_codes import encode_tokens
from ..token_pooling import pool_in_blocks
from ..tokenizer import PolyTokenizer, TruncationSide
from .input_processor import InputProcessor, Prompt
from .late_interaction import LateInteractionRecipe
from .long_input import merge_windows
from .model_runner import ModelRunner
from .prefix_cache import PrefixCache
from .request import Request
from .scheduler import ScheduledChunk, Scheduler

__all__ = ["DEFAULT_KV_CACHE_BYTES", "Engine", "EngineStats", "Prompt"]  # Prompt: re-exported for callers

logger = logging.getLogger(__name__)


class FinishError(Exception):
    """A batch ran, but some of its requests' outputs failed to form: `finished` holds the outputs that did
    (the others' of the batch), `failed` each failing request's last chunk and its error."""

    def __init__(self, finished: list[PoolingRequestOutput[PoolingOutput]], failed: list[tuple[Any, Exception]]):
        super().__init__(f"{len(failed)} requests failed after their forward pass: {failed[0][1]!r}")
        self.finished, self.failed = finished, failed


@dataclass
class EngineStats:
    num_batches: int = 0
    num_batched_tokens: int = 0
    num_batched_seqs: int = 0
    busy_seconds: float = 0.0


# Default memory for the KV caches of causal requests being prefilled.
DEFAULT_KV_CACHE_BYTES = 4 << 30


class Engine:
    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig):
        if engine_config.max_num_batched_tokens < model_config.max_model_len and not model_config.is_causal:
            raise ValueError(
                f"max_num_batched_tokens={engine_config.max_num_batched_tokens} is smaller than "
                f"max_model_len={model_config.max_model_len}; a full-length input would never fit in a batch "
                f"(only causal models prefill in chunks)"
            )
        self.model_config = model_config
        self.engine_config = engine_config
        self.options: dict[str, Any] = {}
        """The loading options that shape the vectors, as given to create_engine (JSON): an index records them."""
        # model_max_length as transformers reads it, for `encode(..., truncation=True)` (get_tokenizer's users)
        limit = tokenizer_max_length(Path(model_config.tokenizer_path).parent)
        self.tokenizer = PolyTokenizer(model_config.tokenizer_path, model_config.do_lower_case, limit)
        self.runner = ModelRunner(model_config, engine_config)
        self.causal = self.runner.causal
        self.prefix_cache: PrefixCache | None = None
        self.kv_cache_tokens = 0
        probe = None
        if self.causal:
            per_token = self.runner.kv_bytes_per_token()
            if engine_config.kv_cache_memory_bytes:
                self.kv_cache_tokens = engine_config.kv_cache_memory_bytes // per_token
            else:  # the default always fits one full-length prompt plus a batch
                self.kv_cache_tokens = max(
                    DEFAULT_KV_CACHE_BYTES // per_token,
                    model_config.max_model_len + engine_config.max_num_batched_tokens,
                )
            if engine_config.enable_prefix_caching is not False and engine_config.prefix_cache_tokens:
                self.prefix_cache = PrefixCache(engine_config.prefix_cache_tokens)
                probe = self.prefix_cache.probe
            logger.info(
                "KV cache: %d tokens (%.1f MiB); prefix caching %s",
                self.kv_cache_tokens,
                self.kv_cache_tokens * per_token / 2**20,
                "on" if self.prefix_cache is not None else "off",  # an empty cache is falsy (its __len__)
            )
        self.scheduler: Scheduler[Request] = Scheduler(
            engine_config.max_num_batched_tokens,
            engine_config.max_num_seqs,
            kv_cache_tokens=self.kv_cache_tokens,
            cache_every_causal=self.prefix_cache is not None,
            prefix_probe=probe,
            policy=engine_config.scheduling_policy,
        )
        self._window_groups: dict[str, Request] = {}  # parent request id → parent (long input windows)
        self._ready: list[Request] = []  # requests whose output needs no forward pass (Request.static_output)
        self._ready_lock = threading.Lock()  # a server adds requests while its engine thread runs a batch
        self.input_processor = InputProcessor(
            model_config,
            engine_config,
            self.tokenizer,
            self.runner.model,
            causal=self.causal,
            kv_cache_tokens=self.kv_cache_tokens,
            prefix_caching=self.prefix_cache is not None,
        )
        self.stats = EngineStats()
        task = model_config.pooler_config.task
        if task is not None and task not in self.supported_tasks:
            raise ValueError(f"Unsupported task: {task!r} Supported tasks: {list(self.supported_tasks)}")

    # ------------------------------------------------------------------------------------------ requests

    @property
    def pooling_task(self) -> str:
        """The task of a request that names none (vLLM's instance task): PoolerConfig.task, else the first the
        model supports of embed, classify, token_embed, token_classify."""
        if self.model_config.pooler_config.task is not None:
            return self.model_config.pooler_config.task
        order = ("embed", "classify", "token_embed", "token_classify")
        return next(t for t in order if t in self.supported_tasks)

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        return self.input_processor.supported_tasks

    @property
    def scores_by_maxsim(self) -> bool:
        """Scores are MaxSim of token vectors: the pooling task is token_embed (vLLM's late-interaction score
        type: a ColBERT model, or PoolerConfig(task="token_embed"))."""
        return self.pooling_task == "token_embed"

    @property
    def colbert(self) -> LateInteractionRecipe | None:
        """The model's ColBERT recipe, or None when it is not a late-interaction model."""
        return self.input_processor.colbert

    @property
    def is_late_interaction(self) -> bool:
        """A ColBERT-style model: token vectors out, MaxSim for scores."""
        return self.input_processor.colbert is not None

    @property
    def recipe_edits_tokens(self) -> bool:
        """A ColBERT recipe adds or drops tokens: its token rows are not the text's (late chunking cannot map them)."""
        return self.colbert is not None and self.colbert.edits_tokens

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def is_cross_encoder(self) -> bool:
        """A one-label sequence classifier scores text pairs (score / rerank) directly."""
        return "classify" in self.supported_tasks and self.model_config.num_labels == 1

    def default_pooling(self, task: str) -> tuple[str, ...]:
        return self.input_processor.default_pooling(task)

    def output_width(self, task: str) -> int:
        return self.input_processor.output_width(task)

    def verify_params(self, params: PoolingParams | None, task: str | None) -> PoolingParams:
        return self.input_processor.verify_params(params, task)

    def process(
        self,
        prompts: Sequence[Prompt],
        params: PoolingParams | Sequence[PoolingParams] | None,
        task: str | Sequence[str] | None,
        request_ids: Sequence[str] | None = None,
        *,
        add_special_tokens: bool = True,
        truncation: str | None = None,
        truncation_side: TruncationSide | None = None,
        padding: str | int | None = None,
        max_window_tokens: int | None = None,
        do_lower_case: bool | None = None,
    ) -> list[Request]:
        """Tokenize and check prompts (see `InputProcessor.process`); thread-safe. Several tasks (a list): each
        output's data is a dict, task name → output, all from one forward pass."""
        return self.input_processor.process(
            prompts,
            params,
            task,
            request_ids,
            add_special_tokens=add_special_tokens,
            truncation=truncation,
            truncation_side=truncation_side,
            padding=padding,
            max_window_tokens=max_window_tokens,
            do_lower_case=do_lower_case,
        )

    def warmup(self) -> Iterator[int]:
        """Steps that compile the kernels of every batch size this engine can run (see ModelRunner.warmup)."""
        return self.runner.warmup(self.engine_config.max_num_batched_tokens)

    def add_requests(self, requests: list[Request]) -> None:
        queued: list[Request] = []
        for r in requests:
            if r.static_output is not None:
                with self._ready_lock:
                    self._ready.append(r)
            elif r.windows:
                self._window_groups[r.request_id] = r
                queued.extend(r.windows)
            else:
                queued.append(r)
        self.scheduler.add_all(queued)

    def abort_requests(self, request_ids: set[str]) -> int:
        ids = set(request_ids)
        with self._ready_lock:
            ready = len(self._ready)
            self._ready = [r for r in self._ready if r.request_id not in ids]
            dropped = ready - len(self._ready)
        for rid in request_ids:
            parent = self._window_groups.pop(rid, None)
            if parent is not None:
                assert parent.windows is not None  # only requests split into windows are grouped
                ids.update(w.request_id for w in parent.windows)
        return dropped + self.scheduler.abort(ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self._ready) or self.scheduler.has_unfinished()

    # ------------------------------------------------------------------------------------------ stepping

    def schedule(self) -> list[ScheduledChunk[Request]]:
        return self.scheduler.schedule()

    def step(self) -> list[PoolingRequestOutput[PoolingOutput]]:
        return self.run(self.schedule())

    def run(self, batch: list[ScheduledChunk[Request]]) -> list[PoolingRequestOutput[PoolingOutput]]:
        """Execute a batch the scheduler picked (a server schedules under its lock and runs outside it);
        returns the requests it finished, and those that need no forward pass."""
        try:
            finished = self._run(batch)
            aborted = self.scheduler.aborted_in_step()  # while it ran: their clients are gone
            return [o for o in finished if o.request_id not in aborted] if aborted else finished
        finally:
            self.scheduler.end_step()

    def _run(self, batch: list[ScheduledChunk[Request]]) -> list[PoolingRequestOutput[PoolingOutput]]:
        with self._ready_lock:
            ready, self._ready = self._ready, []
        finished = [self._output(r, r.static_output) for r in ready]
        if not batch:
            return finished
        start = time.perf_counter()
        try:
            if self.causal:
                self._prepare_caches(batch)
            results, hidden = self.runner.execute(batch)
        except BaseException:  # the outputs that needed no forward pass go with the next batch
            with self._ready_lock:
                self._ready[:0] = ready
            raise
        if self.prefix_cache is not None:
            offset = 0
            for c in batch:
                self.prefix_cache.insert(c.request, c.start, c.num_tokens, hidden[offset : offset + c.num_tokens])
                offset += c.num_tokens
        self.stats.busy_seconds += time.perf_counter() - start
        self.stats.num_batches += 1
        self.stats.num_batched_tokens += sum(c.num_tokens for c in batch)
        self.stats.num_batched_seqs += len(batch)
        failed: list[tuple[ScheduledChunk[Request], Exception]] = []
        for c, data in zip(batch, results):
            if not c.is_last:
                continue
            r = c.request
            try:  # one request's output failing to form (a MUVERA or window step) leaves the others' done
                self._free(r)
                if r.parent is not None:
                    r.window_output = data
                    out = self._finish_windows(r.parent)
                    if out is not None:
                        finished.append(out)
                    continue
                finished.append(self._output(r, data))
            except Exception as exc:
                failed.append((c, exc))
        if failed:
            raise FinishError(finished, failed)
        return finished

    def fail(self, batch: list[ScheduledChunk[Request]]) -> list[str]:
        """A batch raised: drop its requests (and their sibling windows); return the ids to report failed."""
        ids = []
        for c in batch:
            r = c.request.parent or c.request
            if r.request_id not in ids:
                ids.append(r.request_id)
        self.abort_requests(set(ids) | {c.request.request_id for c in batch})
        for c in batch:
            self._free(c.request)
        return ids

    def _free(self, r: Request) -> None:
        self.scheduler.release(r.request_id)
        r.kv_cache = None

    def _prepare_caches(self, batch: list[ScheduledChunk[Request]]) -> None:
        """Give the requests the scheduler reserved KV cache for their cache; load cached prefixes."""
        for c in batch:
            r = c.request
            if r.kv_cache is not None or not self.scheduler.holds_cache(r.request_id):
                continue
            kv_cache = self.runner.allocate_kv_cache(r.num_tokens)
            if c.start > 0:  # the scheduler skipped a cached prefix
                assert self.prefix_cache is not None  # only its probe makes the scheduler skip tokens
                hidden = self.prefix_cache.load(r, c.start, kv_cache)
                state = PoolingState(r.spec)
                ids = torch.tensor(r.prompt_token_ids[: c.start], device=hidden.device)
                state.update(hidden.float(), ids, 0)
                r.num_cached_tokens, r.pool_state = c.start, state
            # set last: a load that failed leaves none, so a rerun of the chunk (after a fault) loads it again
            r.kv_cache = kv_cache

    def _output(self, r: Request, data: Any) -> PoolingRequestOutput[PoolingOutput]:
        r.pool_state = None
        assert r.params.task is not None  # verified params name their task
        factor = r.params.pool_factor
        query = (r.input_type or r.params.input_type) == "query"
        if factor and factor > 1 and not query and r.params.task == "token_embed" and data is not None:
            data = pool_in_blocks(data, factor, self.model_config.max_model_len)  # documents only, as PyLate
        if isinstance(r.params.muvera, MuveraParams) and r.params.task == "token_embed" and data is not None:
            data = torch.from_numpy(muvera_for(data.shape[1], r.params.muvera)(data, query))
        codes = None
        if r.params.token_encoding and r.params.task == "token_embed" and data is not None:
            codes = encode_tokens(data, r.params.token_encoding)
            data = codes.codes
        return PoolingRequestOutput(
            request_id=r.request_id,
            outputs=PoolingOutput(data, codes),  # several tasks: a dict, task name → output
            task="+".join(data) if isinstance(data, dict) else r.params.task,
            prompt_token_ids=r.prompt_token_ids,
            num_input_tokens=r.num_input_tokens,
            num_cached_tokens=r.num_cached_tokens + sum(w.num_cached_tokens for w in r.windows or ()),
            input_type=r.input_type,
        )

    def _finish_windows(self, parent: Request) -> PoolingRequestOutput[PoolingOutput] | None:
        """Combine a long input's windows once all are done (an aborted parent's stragglers are dropped)."""
        assert parent.windows is not None  # a window's parent was split into windows
        if any(w.window_output is None for w in parent.windows):
            return None
        if self._window_groups.pop(parent.request_id, None) is None:  # one step: abort pops it from another thread
            return None
        data = merge_windows(parent, self.runner.pooler, self.input_processor.special_ids)
        return self._output(parent, data)
