"""The engine: requests in, pooled outputs out.

`process` turns prompts into verified `Request`s (tokenization, truncation, parameter checks; thread-safe and
free of engine state, so a server can run it off its event loop), `add_requests` queues them, and each `step`
runs one scheduled batch through the model and returns the requests it finished.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Union

from ..config import SEQ_POOLING_TYPES, EngineConfig, ModelConfig
from ..layers.pooler import PoolingSpec
from ..outputs import PoolingOutput, PoolingRequestOutput
from ..pooling_params import PoolingParams, token_pooling_type
from ..tokenizer import PolyTokenizer, PromptTooLongError
from .model_runner import ModelRunner
from .scheduler import Scheduler
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


class Engine:
    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig):
        if engine_config.max_num_batched_tokens < model_config.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={engine_config.max_num_batched_tokens} is smaller than "
                f"max_model_len={model_config.max_model_len}; a full-length input would never fit in a batch")
        self.model_config = model_config
        self.engine_config = engine_config
        self.tokenizer = PolyTokenizer(model_config.tokenizer_path, model_config.do_lower_case)
        self.runner = ModelRunner(model_config, engine_config)
        self.scheduler = Scheduler(engine_config.max_num_batched_tokens, engine_config.max_num_seqs)
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
        for i, (prompt, p) in enumerate(zip(prompts, verified)):
            max_len = p.truncate_prompt_tokens or limit
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
                tokenized[i] = prompt if isinstance(prompt, str) else tuple(prompt)
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
            request = Request(request_id=request_ids[i], prompt_token_ids=ids, token_type_ids=types,
                              params=verified[i], spec=specs[i], num_input_tokens=num_input)
            if self.colbert is not None:
                self.colbert.apply(request)
            requests.append(request)
        return requests

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
            self.scheduler.add(r)

    def abort_requests(self, request_ids: set[str]) -> int:
        return self.scheduler.abort(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------------------------------ stepping

    def step(self) -> list[PoolingRequestOutput[PoolingOutput]]:
        return self.run(self.scheduler.schedule())

    def run(self, batch: list[Request]) -> list[PoolingRequestOutput[PoolingOutput]]:
        """Execute a batch the scheduler picked (a server schedules under its lock and runs outside it)."""
        if not batch:
            return []
        start = time.perf_counter()
        results = self.runner.execute(batch)
        self.stats.busy_seconds += time.perf_counter() - start
        self.stats.num_batches += 1
        self.stats.num_batched_tokens += sum(r.num_tokens for r in batch)
        self.stats.num_batched_seqs += len(batch)
        return [PoolingRequestOutput(request_id=r.request_id, outputs=PoolingOutput(data), task=r.params.task,
                                     prompt_token_ids=r.prompt_token_ids, num_input_tokens=r.num_input_tokens,
                                     input_type=r.input_type)
                for r, data in zip(batch, results)]



def _too_long(index: int, num_tokens: int, max_len: int) -> str:
    return (f"prompt {index} has {num_tokens} tokens, more than the maximum input length of {max_len} tokens "
            f"(max_model_len, or truncate_prompt_tokens when set); shorten it, pass truncate_prompt_tokens, "
            f"or run with truncation='auto'")


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
    def resolve(cls, model_config: ModelConfig, tokenizer: PolyTokenizer) -> "_ColBERTIds | None":
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
