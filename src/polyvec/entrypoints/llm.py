"""The offline API, vLLM-compatible: `LLM(model).embed(...)`, `.encode(...)`, `.classify(...)`, `.score(...)`.

See vLLM's pooling-model docs (https://docs.vllm.ai/en/latest/models/pooling_models.html): the same method
names, arguments and output fields, so switching is an import change.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import numbers
import threading
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, cast

import torch

from .. import late_chunking
from ..chat import load_template
from ..config import LongInput, PoolerConfig, Quantization, SchedulingPolicy, Truncation
from ..engine.engine import Engine, FinishError, Prompt
from ..engine.factory import create_engine
from ..engine.input_processor import PromptError
from ..late_chunking import LateChunkingParams
from ..loader import DEFAULT_MODEL
from ..multimodal.image import is_image_object
from ..outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
    SparseEmbeddingRequestOutput,
    as_task_output,
)
from ..platforms import KernelOptions
from ..pooling_params import PoolingParams
from ..scoring import SideError, check_token_limits, cut_side, pair_composer, pair_template, plan_scores
from ..tokenizer import special_tokens_map
from . import vllm_compat

logger = logging.getLogger(__name__)

PromptsType = Prompt | Sequence[Prompt]


def _vllm_lora(method: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's per-call `lora_request` keyword: None, as vLLM code passes it, is accepted; an adapter is refused
    (a checkpoint that ships a LoRA adapter has it merged when it loads)."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, lora_request: Any = None, **kwargs: Any) -> Any:
        if lora_request is not None:
            raise ValueError(
                "lora_request is not supported: polyvec merges a checkpoint's LoRA adapter into the model when it "
                "loads, not per call"
            )
        return method(self, *args, **kwargs)

    return wrapper


class LLM:
    """Load a pooling model and run it offline.

    Args:
        model: local folder, Hugging Face cache entry, or hub id resolved offline.
        dtype: "auto" (on CPU bfloat16 where its matmuls run faster than float32's, else float32; on CUDA
            vLLM's rule: float16, bfloat16 checkpoints in bfloat16 on compute capability 8.0+), "float32",
            "bfloat16" or "float16".
        device: "auto", "cpu", "cuda" or "cuda:N".
        max_model_len: longest input in tokens (default: sentence-transformers max_seq_length, else the
            model's position limit).
        max_num_batched_tokens: token budget of one forward pass.
        max_num_seqs: most sequences in one forward pass.
        pooler_config: overrides of the pooling the model's files describe (`PoolerConfig`, or a dict of its
            fields as vLLM's `--pooler-config` JSON).
        truncation: "auto" cuts over-long input to max_model_len; "error" rejects it.
        hf_overrides: values that replace entries of config.json (e.g. {"is_matryoshka": True}).
        download_dir: Hugging Face cache folder to resolve hub ids in (default: the standard cache).
        convert: "embed" or "classify": serve a `*ForCausalLM` checkpoint as an embedding model (LM head
            dropped, LAST pooling; the default for causal LMs) or a classifier (`score` head).
        long_input: "truncate" (default) or "window": encoder input longer than max_model_len is split into
            windows (see PoolingParams.long_input); window_overlap: tokens shared by consecutive windows.
        kv_cache_memory_bytes: causal models: memory for the KV caches of prompts prefilled in chunks.
        enable_prefix_caching: causal models: reuse computed prompt prefixes (default on).
        quantization: None, or "int8" (CPU, opt-in): int8 projections with per-token dynamic activation
            scales; faster, close to float32 instead of exact (see EngineConfig.quantization).
        kernels: which of polyvec's native CPU paths may run (`KernelOptions(native=, onednn=, amx=)`; default
            all, less those POLYVEC_DISABLE_KERNELS / _ONEDNN / _AMX=1 turn off).
        tokenizer: a folder or hub id to read the tokenizer from instead of the model's.
        limit_mm_per_prompt: image models: {"image": N}, the most images in one prompt (vLLM's).
        mm_processor_kwargs: image models: {"min_pixels": ..., "max_pixels": ...}, the resize budget in pixels
            (default: the checkpoint's preprocessor_config.json).
        max_image_pixels: the largest decoded image accepted (width × height; default 50 million).
        allowed_media_domains: hosts whose http(s) image URLs are fetched (none by default).
        scheduling_policy: vLLM's "fcfs" or "priority" (a server's requests by their `priority`; offline calls
            carry none, so both serve them in order).
        runner, tensor_parallel_size, ...: vLLM's other arguments are accepted where they change nothing here
            (`entrypoints/vllm_compat.py`); a runner other than pooling, or more than one device, is refused.
    """

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        *,
        dtype: str | torch.dtype = "auto",
        device: str = "auto",
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int = 256,
        pooler_config: PoolerConfig | dict[str, Any] | None = None,
        truncation: Truncation = "auto",
        hf_overrides: dict[str, Any] | None = None,
        revision: str | None = None,
        download_dir: str | None = None,
        num_threads: int | None = None,
        convert: str | None = None,
        long_input: LongInput = "truncate",
        window_overlap: int = 0,
        kv_cache_memory_bytes: int | None = None,
        enable_prefix_caching: bool | None = None,
        quantization: Quantization | None = None,
        kernels: KernelOptions | None = None,
        tokenizer: str | None = None,
        limit_mm_per_prompt: dict[str, int] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        max_image_pixels: int = 50_000_000,
        allowed_media_domains: list[str] | None = None,
        scheduling_policy: SchedulingPolicy = "fcfs",
        **kwargs: Any,
    ):
        kwargs.pop("enforce_eager", None)  # vLLM's CUDA graphs; offline polyvec has no warm-up for it to skip
        known = set(vllm_compat.IGNORED) | set(vllm_compat.PARALLEL) | {"runner", "task"}
        unknown = set(kwargs) - known - set(vllm_compat.IGNORED_OFFLINE)
        if unknown:
            raise TypeError(f"LLM() got unexpected arguments: {', '.join(sorted(unknown))}")
        offline = {n: kwargs.pop(n) for n in vllm_compat.IGNORED_OFFLINE if n in kwargs}
        ignored = vllm_compat.check(kwargs) + [n for n, v in offline.items() if v not in (None, False, "")]
        if ignored:
            logger.warning("vLLM arguments with no effect in polyvec: %s", ", ".join(ignored))
        if isinstance(pooler_config, dict):
            pooler_config = PoolerConfig.from_dict(pooler_config)
        if kwargs.get("task") is not None:
            pooler_task = pooler_config.task if pooler_config is not None else None
            task, convert = vllm_compat.task_options(kwargs["task"], pooler_task, convert)
            if task is not None:
                pooler_config = dataclasses.replace(pooler_config or PoolerConfig(), task=task)
            logger.warning("task=%r is vLLM's deprecated form of pooler_config task=%r (convert=%r)", kwargs["task"],
                           task, convert)  # fmt: skip
        # Outputs the engine finished, until the call that submitted them takes them: a step runs every queued
        # request, also those of another call on this LLM (an open iter_encode while embed() runs).
        self._finished: dict[str, PoolingRequestOutput] = {}
        self._steps = threading.RLock()  # one step at a time: calls from several threads share the engine
        self.engine = create_engine(
            model,
            dtype=dtype,
            device=device,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            pooler_config=pooler_config,
            truncation=truncation,
            hf_overrides=hf_overrides,
            revision=revision,
            download_dir=download_dir,
            num_threads=num_threads,
            convert=convert,
            long_input=long_input,
            window_overlap=window_overlap,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            enable_prefix_caching=enable_prefix_caching,
            quantization=quantization,
            kernels=kernels,
            tokenizer=tokenizer,
            limit_mm_per_prompt=limit_mm_per_prompt,
            mm_processor_kwargs=mm_processor_kwargs,
            max_image_pixels=max_image_pixels,
            allowed_media_domains=allowed_media_domains,
            scheduling_policy=scheduling_policy,
        )
        self.model_config = self.engine.model_config

    @classmethod
    def from_engine(cls, engine: Engine) -> LLM:
        """An LLM over an engine built elsewhere (`polyvec.engine.factory.create_engine`)."""
        llm = cls.__new__(cls)
        llm.engine, llm.model_config, llm._finished = engine, engine.model_config, {}
        llm._steps = threading.RLock()
        return llm

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        return self.engine.supported_tasks

    @property
    def is_cross_encoder(self) -> bool:
        return self.engine.is_cross_encoder

    def get_tokenizer(self):
        return self.engine.tokenizer

    # ---------------------------------------------------------------------------------------- core loop

    def _run(
        self,
        prompts: PromptsType,
        params: PoolingParams | Sequence[PoolingParams] | None,
        task: str | Sequence[str],
        truncate_prompt_tokens: int | None,
        use_tqdm: bool | Callable,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[PoolingRequestOutput]:
        prompts = _as_prompt_list(prompts)
        if not prompts:
            raise ValueError("You must pass at least one prompt")  # vLLM's words
        truncate_prompt_tokens, options = _tokenization_options(
            tokenization_kwargs, truncate_prompt_tokens, self.model_config.max_model_len
        )
        if truncate_prompt_tokens is not None:
            params = _with_truncation(params, truncate_prompt_tokens)
        late = self._late_chunking(prompts, params, task)
        if late and late_chunking.tokenization_changes(tokenization_kwargs):
            raise ValueError("Late chunking does not support input padding, truncation or renderer text normalization")
        encodings = {}
        if late:  # whole documents, never cut nor windowed: the pooler averages their rows per chunk
            limit = self.model_config.max_model_len
            special_tokens = options.get("add_special_tokens", True)
            for i, (text, _) in late.items():
                encodings[i] = enc = self.engine.tokenizer._base.encode(text, add_special_tokens=special_tokens)
                if (detail := late_chunking.too_long(len(enc.ids), limit)) is not None:
                    raise PromptError(i, detail)
            per_prompt = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
            params = [  # within max_model_len: "truncate" keeps them whole, and out of a server's window mode
                dataclasses.replace(p or PoolingParams(), long_input="truncate") if i in late else p or PoolingParams()
                for i, p in enumerate(per_prompt)
            ]
        requests = self.engine.process(prompts, params, task, **options)
        ids = [r.request_id for r in requests]
        bar = None
        if use_tqdm and len(requests) > 1:  # made before the requests are queued: a failing factory leaves none
            from tqdm.auto import tqdm

            factory = use_tqdm if callable(use_tqdm) else tqdm
            bar = factory(total=len(requests), desc="Processed prompts", dynamic_ncols=True)
        try:
            with self._steps:
                self.engine.add_requests(requests)
            left = set(ids)
            while left:
                with self._steps:  # another thread's step may have finished them: the mailbox says
                    done = left.intersection(self._finished)
                    if not done:
                        self._step()
                        done = left.intersection(self._finished)
                left -= done
                if bar is not None:
                    bar.update(len(done))
        except BaseException:
            self._drop(ids)
            raise
        finally:
            if bar is not None:
                bar.close()
        with self._steps:
            outputs = [self._finished.pop(rid) for rid in ids]
        for i, (_, chunking) in late.items():
            out, enc = outputs[i], encodings[i]
            special = [bool(m) for m in enc.special_tokens_mask]
            out.late_chunking = late_chunking.metadata(
                len(out.prompt_token_ids), list(enc.offsets), special, chunking.chunk_size
            )
        return outputs

    def _step(self) -> None:
        """One engine step (under `_steps`); its outputs go to the mailbox, whichever call's they are."""
        if not self.engine.has_unfinished_requests():
            raise RuntimeError("requests of this call were lost: a step that ran them failed (in this or another call)")
        try:
            finished = self.engine.step()
        except FinishError as exc:  # the outputs that did form wait for their calls
            for out in exc.finished:
                self._finished[out.request_id] = out
            raise
        for out in finished:
            self._finished[out.request_id] = out

    def _drop(self, ids: Iterable[str]) -> None:
        """A call stopped early or failed: its queued requests and its finished outputs go."""
        ids = set(ids)
        with self._steps:
            self.engine.abort_requests(ids)
            for rid in ids:
                self._finished.pop(rid, None)

    def _late_chunking(self, prompts: list, params, task) -> dict[int, tuple[str, LateChunkingParams]]:
        """Prompts whose params ask for late chunking: index → (text, params); checked as vLLM does."""
        per_prompt = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        found = {}
        for i, (prompt, p) in enumerate(zip(prompts, per_prompt)):
            if p is None or p.late_chunking_params is None:
                continue
            text = late_chunking.check(
                p,
                task,
                prompt,
                recipe_edits_tokens=self.engine.recipe_edits_tokens,
                lower_case=self.model_config.do_lower_case,
            )
            verified = self.engine.input_processor.verify_params(p, task)
            late_chunking.check_no_prompt(self.engine.input_processor, text, verified)
            found[i] = (text, p.late_chunking_params)
        return found

    def iter_encode(
        self,
        prompts: Iterable[Prompt],
        pooling_params: PoolingParams | None = None,
        *,
        pooling_task: str | Sequence[str] = "embed",
        max_in_flight: int = 4096,
        truncate_prompt_tokens: int | None = None,
    ) -> Iterator[PoolingRequestOutput]:
        """Outputs one by one, in input order, for any number of prompts (a list or a lazy iterable such as
        a file reader), with memory bounded by `max_in_flight` requests rather than by the corpus: prompts
        are tokenized in slices as the engine drains, and nothing is kept once yielded. For offline runs
        over large collections (write each output to disk as it comes)."""
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        if pooling_params is not None and pooling_params.late_chunking_params is not None:
            raise ValueError("late chunking needs the whole document's tokens: use encode() or token_embed()")
        _check_return_tokens(pooling_params)
        if truncate_prompt_tokens is not None:
            pooling_params = _with_truncation(pooling_params, truncate_prompt_tokens)
        one = isinstance(prompts, (str, dict)) or is_image_object(prompts)  # one prompt, not characters or keys
        if isinstance(prompts, (list, tuple)) and prompts and all(_is_token_id(t) for t in prompts):
            one = True  # token ids: one prompt, as embed() and vLLM read a flat list of ints
        source = iter(cast(Iterable[Prompt], [prompts] if one else prompts))
        slice_size = max(1, min(max_in_flight // 2, 1024))
        order: deque[str] = deque()  # request ids not yet yielded, in input order
        exhausted, read = False, 0
        try:
            while True:
                while not exhausted and len(order) + slice_size <= max_in_flight:
                    chunk = list(itertools.islice(source, slice_size))
                    if not chunk:
                        exhausted = True
                        break
                    _check_prompts(chunk, first=read)
                    try:
                        requests = self.engine.process(chunk, pooling_params, pooling_task)
                    except PromptError as exc:  # numbered in the slice: in the whole input
                        raise exc.moved(read) from None
                    read += len(chunk)
                    with self._steps:
                        self.engine.add_requests(requests)
                    order.extend(r.request_id for r in requests)
                while order and order[0] in self._finished:
                    with self._steps:
                        out = self._finished.pop(order.popleft())
                    yield out
                if not order and exhausted:
                    return
                if order:
                    with self._steps:
                        if order[0] not in self._finished:  # another thread's step may have finished it
                            self._step()
        finally:
            if order:  # the consumer stopped early or something raised: drop what is still queued
                self._drop(order)

    # ------------------------------------------------------------------------------------------ tasks

    @_vllm_lora
    def encode(
        self,
        prompts: PromptsType,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        pooling_task: str | Sequence[str] | None = None,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool | Callable = True,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[PoolingRequestOutput]:
        """Raw pooling outputs (`.outputs.data` tensors). With no task: PoolerConfig.task, else token_embed, else
        token_classify. Several tasks (a list, e.g. ["embed", "embed_sparse", "token_embed"]): one forward pass per
        prompt, and `.outputs.data` is a dict, task name → that task's output (embed_sparse: the whole vector)."""
        if pooling_task is None:
            first = pooling_params[0] if isinstance(pooling_params, Sequence) and pooling_params else pooling_params
            pooling_task = getattr(first, "task", None)
        if pooling_task is None:
            pooling_task = self.model_config.pooler_config.task
        if pooling_task is None:
            for candidate in ("token_embed", "token_classify"):
                if candidate in self.supported_tasks:
                    pooling_task = candidate
                    break
            else:
                raise ValueError(
                    f"encode() needs pooling_task for this model; it supports: {', '.join(self.supported_tasks)}"
                )
        _check_return_tokens(pooling_params)
        return self._run(prompts, pooling_params, pooling_task, truncate_prompt_tokens, use_tqdm, tokenization_kwargs)

    @_vllm_lora
    def embed(
        self,
        prompts: PromptsType,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool | Callable = True,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One vector per prompt: `.outputs.embedding` (list of floats) and `.outputs.data` (tensor). A model whose
        pooling task is token_embed (a ColBERT model, or `PoolerConfig(task="token_embed")`) returns its token
        matrices in `.outputs.data`, as vLLM's `embed` does."""
        task = "token_embed" if self.engine.pooling_task == "token_embed" else "embed"
        outs = self._run(prompts, pooling_params, task, truncate_prompt_tokens, use_tqdm, tokenization_kwargs)
        return outs if task == "token_embed" else [as_task_output(o) for o in outs]  # type: ignore[return-value,misc]

    @_vllm_lora
    def embed_sparse(
        self,
        prompts: PromptsType,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool | Callable = True,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[SparseEmbeddingRequestOutput]:
        """One sparse vector per prompt (SPLADE models): `.outputs.indices` and `.outputs.values` (ascending
        vocabulary ids, zeros dropped), `.outputs.tokens` with return_tokens, `.outputs.data` the whole vector."""
        outs = self._run(prompts, pooling_params, "embed_sparse", truncate_prompt_tokens, use_tqdm, tokenization_kwargs)
        typed = [cast(SparseEmbeddingRequestOutput, as_task_output(o)) for o in outs]
        per_prompt = pooling_params if isinstance(pooling_params, Sequence) else [pooling_params] * len(typed)
        tokenizer = self.engine.tokenizer
        for out, params in zip(typed, per_prompt):
            if params is not None and params.return_tokens:
                out.outputs.tokens = [tokenizer.id_to_token(i) or "" for i in out.outputs.indices]
        return typed

    @_vllm_lora
    def token_embed(
        self,
        prompts: PromptsType,
        pooling_params=None,
        *,
        truncate_prompt_tokens=None,
        use_tqdm: bool | Callable = True,
        tokenization_kwargs=None,
    ) -> list[PoolingRequestOutput]:
        return self._run(prompts, pooling_params, "token_embed", truncate_prompt_tokens, use_tqdm, tokenization_kwargs)

    @_vllm_lora
    def token_classify(
        self,
        prompts: PromptsType,
        pooling_params=None,
        *,
        truncate_prompt_tokens=None,
        use_tqdm: bool | Callable = True,
        tokenization_kwargs=None,
    ) -> list[PoolingRequestOutput]:
        return self._run(
            prompts, pooling_params, "token_classify", truncate_prompt_tokens, use_tqdm, tokenization_kwargs
        )

    @_vllm_lora
    def classify(
        self,
        prompts: PromptsType,
        pooling_params=None,
        *,
        truncate_prompt_tokens=None,
        use_tqdm: bool | Callable = True,
        tokenization_kwargs=None,
    ) -> list[ClassificationRequestOutput]:
        """Label probabilities per prompt: `.outputs.probs`."""
        outs = self._run(prompts, pooling_params, "classify", truncate_prompt_tokens, use_tqdm, tokenization_kwargs)
        return [as_task_output(o) for o in outs]  # type: ignore[misc]

    @_vllm_lora
    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool | Callable = True,
        pooling_params: PoolingParams | None = None,
        chat_template: str | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[ScoringRequestOutput]:
        """Similarity of text pairs (1:1, 1:N, N:N): cosine of the embeddings for embedding models, the
        classifier's score of the joint (text_1, text_2) input for cross-encoders (one-label classifiers),
        MaxSim of query-mode text_1 against document-mode text_2 for late-interaction (ColBERT) models.
        `chat_template` (vLLM's): a cross-encoder's pair rendered through it as messages of roles "query" and
        "document" (the Qwen3-Reranker template), a file path or the template itself. `tokenization_kwargs` as for
        encode() (vLLM's: e.g. truncation and max_length)."""
        if pooling_params is not None and not isinstance(pooling_params, PoolingParams):
            raise TypeError(f"score() takes one PoolingParams for every pair, not {type(pooling_params).__name__}")
        for name in ("token_encoding", "muvera", "late_chunking_params"):  # codes or chunks would be scored as vectors
            value = None if pooling_params is None else getattr(pooling_params, name)
            if value is not None and not (name == "muvera" and value is False):
                raise ValueError(f"{name} does not apply to score(): scores are computed from the float vectors")
        # vLLM's per-side caps, offline in PoolingParams.extra_kwargs: texts cut to their first N content tokens
        extra = (pooling_params.extra_kwargs if pooling_params is not None else None) or {}
        limits = {k: int(extra.get(k) or 0) for k in ("max_tokens_per_query", "max_tokens_per_doc")}
        try:
            check_token_limits(limits, self.model_config.max_model_len)
        except SideError as exc:
            raise ValueError(str(exc)) from None
        sides: list[Any] = []
        for name, side in (("data_1", data_1), ("data_2", data_2)):  # named by side and item, not the joined list
            if not isinstance(side, (str, dict, Iterable)) and not is_image_object(side):
                raise TypeError(f"{name} must be a text, a prompt or a list of them, not {type(side).__name__}")
            one = isinstance(side, (str, dict)) or is_image_object(side)
            items = [side] if one else list(side)
            try:
                _check_prompts(items)
            except TypeError as exc:
                raise TypeError(f"{name} item {str(exc).removeprefix('prompt ')}") from None
            sides.append(side if one else items)
        data_1, data_2 = sides
        tok = self.engine.tokenizer._base
        data_1 = cut_side(data_1, limits["max_tokens_per_query"], tok)
        data_2 = cut_side(data_2, limits["max_tokens_per_doc"], tok)
        given = None if chat_template is None else load_template(chat_template)
        template, variables, special = pair_template(self.model_config, self.engine.is_cross_encoder, given)
        # a rendered pair over max_model_len has its document cut, not the template's end (where truncation applies)
        fits = self.engine.engine_config.truncation == "auto" and truncate_prompt_tokens is None
        fit_to = (tok, self.model_config.max_model_len) if fits and not tokenization_kwargs else None
        if not special:  # a saved template writes every token: none added unless the call asks
            special = bool((tokenization_kwargs or {}).get("add_special_tokens", False))
            tokenization_kwargs = {"add_special_tokens": special, **(tokenization_kwargs or {})}
        plan = plan_scores(
            data_1,
            data_2,
            self.supported_tasks,
            self.is_cross_encoder,
            late_interaction=self.engine.scores_by_maxsim,
            names=("data_1", "data_2"),
            compose=pair_composer(
                self.model_config.hf_config,
                template,
                special_tokens_map(self.model_config.tokenizer_path.parent),
                variables,
                fit_to=fit_to,
                special_tokens_added=special,
            ),
        )
        try:
            params = plan.params(pooling_params)
            outs = self._run(plan.prompts, params, plan.task, truncate_prompt_tokens, use_tqdm, tokenization_kwargs)
        except PromptError as exc:  # the caller's item, not its place in the joined prompt list
            where = plan.describe(exc.index, lambda s, i: f"data_{s + 1} item {i}")
            raise ValueError(where + exc.detail) from None
        results = []
        pad = self.engine.tokenizer.special_token_id("pad_token")
        between = [] if pad is None else [pad]  # vLLM's: two encoded sides joined by the tokenizer's pad token
        for k, (score, sources) in enumerate(zip(plan.scores(outs), plan.pair_outputs(outs))):
            ids = [list(o.prompt_token_ids) for o in sources]  # one: a cross-encoder's pair, already joined
            results.append(
                ScoringRequestOutput(
                    request_id=f"score-{k}",
                    outputs=ScoringOutput(score=score),
                    task="score",
                    prompt_token_ids=ids[0] if len(ids) == 1 else ids[0] + between + ids[1],
                    num_input_tokens=sum(o.num_input_tokens for o in sources),
                )
            )
        return results


def _tokenization_options(
    kwargs: dict[str, Any] | None, truncate: int | None, max_model_len: int
) -> tuple[int | None, dict[str, Any]]:
    """vLLM's `tokenization_kwargs`: the truncation length, and the keyword arguments for `Engine.process`.
    Keys that change nothing here (padding, needs_detokenization, ...) are ignored with a warning, as vLLM
    ignores those it does not know."""
    if not kwargs:
        return truncate, {}
    options: dict[str, Any] = {}
    if kwargs.get("truncation") not in (None, False, "do_not_truncate") and kwargs.get("max_length") is not None:
        truncate = int(kwargs["max_length"])
    if kwargs.get("truncate_prompt_tokens") is not None:
        k = int(kwargs["truncate_prompt_tokens"])
        truncate = max_model_len if k == -1 else k
    if "add_special_tokens" in kwargs:
        options["add_special_tokens"] = bool(kwargs["add_special_tokens"])
    if kwargs.get("truncation_side") is not None:
        if kwargs["truncation_side"] not in ("left", "right"):
            raise ValueError(f"truncation_side must be 'left' or 'right', got {kwargs['truncation_side']!r}")
        options["truncation_side"] = kwargs["truncation_side"]
    if kwargs.get("do_lower_case") is not None:  # vLLM's renderer lowercases texts (the model's setting else)
        options["do_lower_case"] = bool(kwargs["do_lower_case"])
    used = {
        "truncation",
        "max_length",
        "truncate_prompt_tokens",
        "add_special_tokens",
        "truncation_side",
        "do_lower_case",
    }
    if kwargs.get("padding") in ("max_length", "do_not_pad", False, None):  # vLLM's; other values warned of
        options["padding"] = kwargs.get("padding")
        used.add("padding")
        if kwargs.get("padding") == "max_length" and kwargs.get("max_length") is not None:
            options["padding"] = int(kwargs["max_length"])  # pads up to max_length, as vLLM's with_kwargs
    ignored = sorted(set(kwargs) - used)
    if ignored:
        logger.warning("tokenization_kwargs with no effect in polyvec, ignored: %s", ", ".join(ignored))
    return truncate, options


def _check_return_tokens(params: PoolingParams | Sequence[PoolingParams] | None) -> None:
    """return_tokens fills `.outputs.tokens` of embed_sparse(); encode's raw output has no place for them."""
    for p in params if isinstance(params, Sequence) else [params]:
        if p is not None and p.return_tokens:
            raise ValueError("return_tokens applies to embed_sparse(); encode returns the raw vector without tokens")


def _as_prompt_list(prompts: PromptsType) -> list[Prompt]:
    if prompts is None:
        raise TypeError("prompts must be a prompt or a list of prompts, not None")
    if isinstance(prompts, (str, dict)) or is_image_object(prompts):  # bytes are an image, never token ids
        return [cast(Prompt, prompts)]
    items = list(prompts)
    if items and all(_is_token_id(t) for t in items):
        return [cast(list[int], items)]  # one prompt given as token ids
    _check_prompts(items)
    return cast(list[Prompt], items)  # no bare token ids left: the check rejects them


def _is_token_id(item: object) -> bool:
    return isinstance(item, numbers.Integral) and not isinstance(item, bool)  # numpy's integers too


def _check_prompts(items: list, first: int = 0) -> None:
    """TypeError naming the first item (counted from `first`) that is no prompt."""
    for i, p in enumerate(items, first):
        if not isinstance(p, (str, dict, list, tuple)) and not is_image_object(p):
            raise TypeError(
                f"prompt {i} must be a string, a list of token ids, a prompt dict or an image, not {type(p).__name__}"
            )


def _with_truncation(params, truncate: int):
    if isinstance(params, Sequence):
        return [_replace_trunc(p, truncate) for p in params]
    return _replace_trunc(params, truncate)


def _replace_trunc(params: PoolingParams | None, truncate: int) -> PoolingParams:
    params = (params or PoolingParams()).clone()
    if params.truncate_prompt_tokens is not None and params.truncate_prompt_tokens != truncate:
        warnings.warn("truncate_prompt_tokens given twice; the keyword argument wins", stacklevel=3)
    params.truncate_prompt_tokens = truncate
    return params
