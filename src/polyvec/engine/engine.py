"""The engine: requests in, pooled outputs out.

`process` turns prompts into verified `Request`s (tokenization, truncation, parameter checks; thread-safe and
free of engine state, so a server can run it off its event loop), `add_requests` queues them, and each `step`
runs one scheduled batch through the model and returns the requests it finished.

Causal models prefill prompts longer than the token budget in chunks across steps (KV cache + pooling
state, see `scheduler.py`), and reuse cached prompt prefixes (`prefix_cache.py`). Encoder inputs longer than
`max_model_len` are, when asked (`long_input="window"`), split into window requests that run like any other
and are combined when the last one finishes.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch

from ..config import SEQ_POOLING_TYPES, EngineConfig, ModelConfig
from ..layers.pooler import PoolingSpec, PoolingState
from ..outputs import PoolingOutput, PoolingRequestOutput
from ..pooling_params import PoolingParams, token_pooling_type
from ..tokenizer import PolyTokenizer, PromptTooLongError
from .model_runner import ModelRunner
from .prefix_cache import PrefixCache, block_hashes
from .scheduler import ScheduledChunk, Scheduler
from .sequence import Request

logger = logging.getLogger(__name__)

# A prompt is text, a (text, text) pair, token ids, or vLLM's TextPrompt / TokensPrompt dicts.
Prompt = Union[str, tuple[str, str], Sequence[int], dict[str, Any]]


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
                f"(only causal models prefill in chunks)")
        self.model_config = model_config
        self.engine_config = engine_config
        self.tokenizer = PolyTokenizer(model_config.tokenizer_path, model_config.do_lower_case)
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
                self.kv_cache_tokens = max(DEFAULT_KV_CACHE_BYTES // per_token,
                                           model_config.max_model_len + engine_config.max_num_batched_tokens)
            if engine_config.enable_prefix_caching is not False and engine_config.prefix_cache_tokens:
                self.prefix_cache = PrefixCache(engine_config.prefix_cache_tokens)
                probe = self.prefix_cache.probe
            logger.info("KV cache: %d tokens (%.1f MiB); prefix caching %s", self.kv_cache_tokens,
                        self.kv_cache_tokens * per_token / 2**20, "on" if self.prefix_cache else "off")
        self.scheduler = Scheduler(engine_config.max_num_batched_tokens, engine_config.max_num_seqs,
                                   kv_cache_tokens=self.kv_cache_tokens,
                                   cache_every_causal=self.prefix_cache is not None, prefix_probe=probe)
        self._window_groups: dict[str, Request] = {}  # parent request id → parent (long input windows)
        self.supported_tasks: tuple[str, ...] = self.runner.model.supported_tasks
        self.colbert = _ColBERTIds.resolve(model_config, self.tokenizer)
        if self.colbert is not None:
            # A late-interaction model's outputs are its token vectors; a single pooled vector is not what
            # it was trained to produce.
            self.supported_tasks = ("token_embed",)
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._id_lock = threading.Lock()
        self._special_ids = {i for i, tok in self.tokenizer._base.get_added_tokens_decoder().items() if tok.special}

    # ------------------------------------------------------------------------------------------ requests

    @property
    def is_cross_encoder(self) -> bool:
        """A one-label sequence classifier scores text pairs (score / rerank) directly."""
        return "classify" in self.supported_tasks and self.model_config.num_labels == 1

    def default_pooling(self, task: str) -> tuple[str, ...]:
        """Sequence pooling of a task: the user's PoolerConfig, else the ST Pooling module, else the model's."""
        override = self.model_config.pooler_config.pooling_type
        if override in SEQ_POOLING_TYPES:
            return (override,)
        if task == "embed" and self.model_config.st_pooling:
            return self.model_config.st_pooling
        return (self.runner.model.default_pooling,)

    def output_width(self, task: str) -> int:
        if task == "embed":
            return self.model_config.embed_dim
        if task == "token_embed":
            return self.model_config.token_dim
        if self.runner.model.head_kind == "ForMaskedLM":
            return int(self.model_config.hf_config["vocab_size"])
        return self.model_config.num_labels

    def _spec(self, params: PoolingParams) -> PoolingSpec:
        task = params.task
        if task in ("embed", "classify"):
            pooling = self.default_pooling(task)
        else:
            pooling = (token_pooling_type(params, self.model_config.pooler_config.pooling_type or "ALL"),)
        if params.returned_token_ids is not None:
            width = self.output_width(task)
            bad = [i for i in params.returned_token_ids if i >= width]
            if bad:
                raise ValueError(f"returned_token_ids {bad} are out of range; this output has {width} columns")
        return PoolingSpec(task=task, pooling=pooling, dimensions=params.dimensions,
                           use_activation=bool(params.use_activation), step_tag_id=params.step_tag_id,
                           returned_token_ids=tuple(params.returned_token_ids) if params.returned_token_ids else None)

    def verify_params(self, params: PoolingParams | None, task: str | None) -> PoolingParams:
        return (params or PoolingParams()).verify(task, self.model_config, self.supported_tasks)

    def process(self, prompts: Sequence[Prompt], params: PoolingParams | Sequence[PoolingParams] | None,
                task: str | None, request_ids: Sequence[str] | None = None, *, add_special_tokens: bool = True,
                truncation: str | None = None) -> list[Request]:
        """Tokenize and check prompts; raises ValueError (naming the prompt and limit) on bad input.

        `truncation` ("auto" / "error") overrides the engine's setting for these prompts.
        """
        n = len(prompts)
        per_prompt = list(params) if isinstance(params, Sequence) else [params] * n
        if len(per_prompt) != n:
            raise ValueError(f"got {len(per_prompt)} pooling_params for {n} prompts")
        cache: dict[int, tuple[PoolingParams, PoolingSpec]] = {}  # verify and plan once per distinct params
        verified, specs = [], []
        for p in per_prompt:
            if id(p) not in cache:
                v = self.verify_params(p, task)
                cache[id(p)] = (v, self._spec(v))
            verified.append(cache[id(p)][0])
            specs.append(cache[id(p)][1])
        if request_ids is None:
            with self._id_lock:
                request_ids = [str(next(self._ids)) for _ in range(n)]

        limit = self.model_config.max_model_len
        error_mode = (truncation or self.engine_config.truncation) == "error"
        tokenized: list[Any] = [None] * n
        text_groups: dict[tuple[int, bool], list[int]] = {}
        windowed = [self._long_input(p) == "window" for p in verified]
        for i, (prompt, p) in enumerate(zip(prompts, verified)):
            max_len = p.truncate_prompt_tokens or limit
            if windowed[i] and p.truncate_prompt_tokens is None:
                max_len = 1 << 62  # tokenized whole, then split into windows of max_model_len
            if self.colbert is not None:  # the recipe's own length, less the marker inserted after [CLS]
                max_len = min(max_len, self.colbert.length(p.input_type)) - 1
            # An explicit truncate_prompt_tokens asks for truncation even when the engine rejects long input;
            # a ColBERT recipe always truncates to its query/document length, as its reference does.
            truncate = not error_mode or p.truncate_prompt_tokens is not None or self.colbert is not None
            if isinstance(prompt, dict):
                if "prompt_token_ids" in prompt:
                    prompt = prompt["prompt_token_ids"]
                elif "prompt" in prompt:
                    prompt = prompt["prompt"]
                else:
                    raise ValueError(f"prompt {i} is a dict without 'prompt' or 'prompt_token_ids'")
            if isinstance(prompt, str) or _is_text_pair(prompt):
                # Text pairs (query, document) are encoded as one sequence with segment ids: cross-encoders.
                text_groups.setdefault((max_len, truncate), []).append(i)
                tokenized[i] = self._with_prompt(prompt, p) if isinstance(prompt, str) else tuple(prompt)
            else:
                tokenized[i] = self._token_prompt(i, prompt, max_len, truncate)
        for (max_len, truncate), members in text_groups.items():
            try:
                encoded = self.tokenizer.encode([tokenized[i] for i in members], max_len, truncate,
                                                add_special_tokens=add_special_tokens)
            except PromptTooLongError as exc:
                raise ValueError(_too_long(members[exc.index], exc.num_tokens, max_len)) from None
            for i, enc in zip(members, encoded):
                tokenized[i] = (enc.input_ids, enc.token_type_ids, enc.num_input_tokens)

        requests = []
        for i in range(n):
            ids, types, num_input = tokenized[i]
            if not ids:  # text the tokenizer drops entirely, without special tokens around it
                raise ValueError(f"input {i} has no tokens after tokenization (add_special_tokens is off and the "
                                 f"tokenizer keeps nothing of the text)")
            request = Request(request_id=request_ids[i], prompt_token_ids=ids, token_type_ids=types,
                              params=verified[i], spec=specs[i], num_input_tokens=num_input)
            if self.colbert is not None:
                self.colbert.apply(request)
            if self.causal:
                request.chunkable = True
                if request.num_tokens > self.kv_cache_tokens:
                    raise ValueError(f"prompt {i} has {request.num_tokens} tokens, more than the KV cache holds "
                                     f"({self.kv_cache_tokens} tokens); raise kv_cache_memory_bytes")
                if self.prefix_cache is not None:
                    request.block_hashes = block_hashes(request.prompt_token_ids)
            elif windowed[i] and request.num_tokens > limit:
                self._split_windows(request, verified[i].window_overlap
                                    if verified[i].window_overlap is not None else self.engine_config.window_overlap)
            requests.append(request)
        return requests

    def _long_input(self, params: PoolingParams) -> str:
        mode = params.long_input or self.engine_config.long_input
        if mode == "window" and (self.causal or self.colbert is not None):
            if params.long_input == "window":
                raise ValueError("long_input='window' applies to encoder models without a ColBERT recipe; "
                                 + ("causal models prefill long inputs in chunks" if self.causal else
                                    "a ColBERT model truncates documents to its document_length"))
            return "truncate"
        if mode == "window" and params.is_step:
            if params.long_input == "window":
                raise ValueError("long_input='window' does not apply to STEP pooling (step_tag_id / "
                                 "returned_token_ids)")
            return "truncate"
        if mode == "window" and params.task == "classify":
            return "truncate"  # the server-wide default applies to the tasks windows support
        return mode

    def _with_prompt(self, text: str, params: PoolingParams) -> str:
        """Prepend the model's instruction prompt named by input_type (or its default prompt)."""
        prompts = self.model_config.prompts
        if not prompts or self.colbert is not None:
            return text
        name = params.input_type or self.model_config.default_prompt_name
        return prompts.get(name, "") + text if name else text

    def _split_windows(self, request: Request, overlap: int) -> None:
        """Cut an over-long encoder input into windows of max_model_len tokens, each with the input's leading
        and closing special tokens ([CLS] ... [SEP]); consecutive windows share `overlap` tokens.

        Window k covers content tokens [s_k, s_k + W) with W = max_model_len - specials and s_k = k (W - overlap).
        For token outputs, content token t comes from the window where it is farthest from an edge: window k
        keeps [s_k + overlap // 2, s_{k+1} + overlap // 2) (the first from 0, the last to the end).
        """
        ids, limit = request.prompt_token_ids, self.model_config.max_model_len
        head = ids[:1] if ids[0] in self._special_ids else []
        tail = ids[-1:] if ids[-1] in self._special_ids and len(ids) > len(head) else []
        body = ids[len(head):len(ids) - len(tail)]
        width = limit - len(head) - len(tail)
        stride = width - overlap
        if stride < 1:
            raise ValueError(f"window_overlap={overlap} leaves no room in windows of {width} tokens")
        starts = list(range(0, max(len(body) - overlap, 1), stride))
        if starts[-1] + width < len(body):
            starts.append(starts[-1] + stride)
        keep_from = [0] + [s + overlap // 2 for s in starts[1:]]
        keep_to = keep_from[1:] + [len(body)]
        spec = request.spec
        if spec.task in ("embed", "classify"):
            spec = PoolingSpec(task=spec.task, pooling=spec.pooling, raw=True)
        windows, spans = [], []
        for k, s in enumerate(starts):
            window_ids = head + body[s:s + width] + tail
            windows.append(Request(request_id=f"{request.request_id}#w{k}", prompt_token_ids=window_ids,
                                   token_type_ids=None, params=request.params, spec=spec,
                                   num_input_tokens=len(window_ids), parent=request))
            spans.append((s, keep_from[k], keep_to[k]))
        request.windows, request.window_spans = windows, spans
        request.num_input_tokens = len(ids)
        request.token_type_ids = None

    def _token_prompt(self, i: int, prompt: Sequence[int], max_len: int, truncate: bool):
        ids = list(prompt)
        if not ids:
            raise ValueError(f"prompt {i} has no tokens")
        vocab = self.tokenizer.vocab_size
        vocab = max(vocab, int(self.model_config.hf_config.get("vocab_size", vocab)))
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt {i}: token ids must be integers in 0..{vocab - 1}")
        num_input = len(ids)
        if num_input > max_len:
            if not truncate:
                raise ValueError(_too_long(i, num_input, max_len))
            # Keep a closing special token ([SEP], </s>) as tokenizer truncation would.
            ids = ids[: max_len - 1] + ids[-1:] if ids[-1] in self._special_ids and max_len > 1 else ids[:max_len]
        return ids, None, num_input

    def add_requests(self, requests: list[Request]) -> None:
        for r in requests:
            if r.windows:
                self._window_groups[r.request_id] = r
                for w in r.windows:
                    self.scheduler.add(w)
            else:
                self.scheduler.add(r)

    def abort_requests(self, request_ids: set[str]) -> int:
        ids = set(request_ids)
        for rid in request_ids:
            parent = self._window_groups.pop(rid, None)
            if parent is not None:
                ids.update(w.request_id for w in parent.windows)
        return self.scheduler.abort(ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------------------------------ stepping

    def schedule(self) -> list[ScheduledChunk]:
        return self.scheduler.schedule()

    def step(self) -> list[PoolingRequestOutput[PoolingOutput]]:
        return self.run(self.schedule())

    def run(self, batch: list[ScheduledChunk]) -> list[PoolingRequestOutput[PoolingOutput]]:
        """Execute a batch the scheduler picked (a server schedules under its lock and runs outside it);
        returns the requests it finished."""
        if not batch:
            return []
        start = time.perf_counter()
        if self.causal:
            self._prepare_caches(batch)
        results, hidden = self.runner.execute(batch)
        if self.prefix_cache is not None:
            offset = 0
            for c in batch:
                self.prefix_cache.insert(c.request, c.start, c.num_tokens, hidden[offset:offset + c.num_tokens])
                offset += c.num_tokens
        self.stats.busy_seconds += time.perf_counter() - start
        self.stats.num_batches += 1
        self.stats.num_batched_tokens += sum(c.num_tokens for c in batch)
        self.stats.num_batched_seqs += len(batch)
        finished = []
        for c, data in zip(batch, results):
            if not c.is_last:
                continue
            r = c.request
            self._free(r)
            if r.parent is not None:
                r.window_output = data
                out = self._finish_windows(r.parent)
                if out is not None:
                    finished.append(out)
                continue
            finished.append(self._output(r, data))
        return finished

    def fail(self, batch: list[ScheduledChunk]) -> list[str]:
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

    def _prepare_caches(self, batch: list[ScheduledChunk]) -> None:
        """Give the requests the scheduler reserved KV cache for their cache; load cached prefixes."""
        for c in batch:
            r = c.request
            if r.kv_cache is not None or not self.scheduler.holds_cache(r.request_id):
                continue
            r.kv_cache = self.runner.allocate_kv_cache(r.num_tokens)
            if c.start > 0:  # the scheduler skipped a cached prefix
                hidden = self.prefix_cache.load(r, c.start, r.kv_cache)
                r.pool_state = PoolingState(r.spec)
                ids = torch.tensor(r.prompt_token_ids[:c.start], device=hidden.device)
                r.pool_state.update(hidden.float(), ids, 0)

    def _output(self, r: Request, data: Any) -> PoolingRequestOutput[PoolingOutput]:
        r.pool_state = None
        return PoolingRequestOutput(request_id=r.request_id, outputs=PoolingOutput(data), task=r.params.task,
                                    prompt_token_ids=r.prompt_token_ids, num_input_tokens=r.num_input_tokens,
                                    input_type=r.input_type)

    def _finish_windows(self, parent: Request) -> PoolingRequestOutput[PoolingOutput] | None:
        """Combine a long input's windows once all are done (see `_split_windows`)."""
        if any(w.window_output is None for w in parent.windows) or parent.request_id not in self._window_groups:
            return None
        del self._window_groups[parent.request_id]
        results = [w.window_output for w in parent.windows]
        if parent.spec.task in ("embed", "classify"):
            weights = torch.tensor([float(w.num_tokens) for w in parent.windows])
            pooled = (torch.stack(results) * weights.unsqueeze(1)).sum(0) / weights.sum()
            data = self.runner.pooler.apply_head(parent.spec, pooled)
        else:
            ids = parent.prompt_token_ids
            n_head = 1 if ids[0] in self._special_ids else 0
            n_tail = 1 if ids[-1] in self._special_ids and len(ids) > n_head else 0
            pieces = [results[0][:n_head]]  # [CLS] from the first window, [SEP] from the last
            for (s, lo, hi), rows in zip(parent.window_spans, results):
                pieces.append(rows[n_head + lo - s:n_head + hi - s])
            pieces.append(results[-1][len(results[-1]) - n_tail:])
            data = torch.cat(pieces)
        for w in parent.windows:
            w.window_output = None
        return self._output(parent, data)


def _too_long(index: int, num_tokens: int, max_len: int) -> str:
    return (f"prompt {index} has {num_tokens} tokens, more than the maximum input length of {max_len} tokens "
            f"(max_model_len, or truncate_prompt_tokens when set); shorten it, pass truncate_prompt_tokens, "
            f"run with truncation='auto', or (encoder models) split it with long_input='window'")


def _is_text_pair(prompt: Any) -> bool:
    return isinstance(prompt, tuple) and len(prompt) == 2 and all(isinstance(p, str) for p in prompt)


@dataclass
class _ColBERTIds:
    """A ColBERT recipe with its tokens resolved to ids (PyLate's `tokenize` / Stanford's tokenizers)."""

    config: Any
    query_id: int
    document_id: int
    mask_id: int
    skip_ids: frozenset[int]

    @classmethod
    def resolve(cls, model_config: ModelConfig, tokenizer: PolyTokenizer) -> _ColBERTIds | None:
        cb = model_config.colbert
        if cb is None:
            return None
        ids = {}
        for name, token in (("query", cb.query_prefix), ("document", cb.document_prefix), ("mask", "[MASK]")):
            found = tokenizer.token_to_id(token)
            if found is None and token.strip() != token:
                found = tokenizer.token_to_id(token.strip())
            if found is None:
                raise ValueError(f"the ColBERT {name} token {token!r} is not in the tokenizer's vocabulary")
            ids[name] = found
        unk = tokenizer.token_to_id("[UNK]")
        skip = {tokenizer.token_to_id(w) for w in cb.skiplist_words}
        skip = {unk if i is None else i for i in skip} - {None}
        return cls(cb, ids["query"], ids["document"], ids["mask"], frozenset(skip))

    def length(self, input_type: str | None) -> int:
        return self.config.query_length if input_type == "query" else self.config.document_length

    def apply(self, request: Request) -> None:
        """Insert the mode's marker after [CLS]; expand queries with [MASK]; mark document skiplist tokens."""
        cb, ids = self.config, request.prompt_token_ids
        mode = request.params.input_type or "document"
        ids = ids[:1] + [self.query_id if mode == "query" else self.document_id] + ids[1:]
        types = request.token_type_ids
        if types is not None:
            types = types[:1] + [0] + types[1:]
        if mode == "query" and cb.do_query_expansion and len(ids) < cb.query_length:
            if not cb.attend_to_expansion_tokens:
                request.num_key_tokens = len(ids)
            extra = cb.query_length - len(ids)
            ids = ids + [self.mask_id] * extra
            types = None if types is None else types + [0] * extra
        elif mode == "document":
            keep = [i for i, t in enumerate(ids) if t not in self.skip_ids]
            request.keep = keep if len(keep) < len(ids) else None
        request.prompt_token_ids, request.token_type_ids, request.input_type = ids, types, mode
