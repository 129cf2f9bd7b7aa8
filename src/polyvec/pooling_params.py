"""Per-request pooling options, with vLLM's names and checks.

`PoolingParams.verify(task, model_config, supported_tasks)` resolves aliases and defaults and returns a
new, fully specified object; every rejection is a `ValueError` naming the parameter and what is allowed.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from .config import EMBED_TASKS, POOLING_TASKS, TOKEN_POOLING_TYPES, ModelConfig
from .late_chunking import LateChunkingParams
from .muvera import MuveraParams

LONG_INPUT_MODES = ("truncate", "window")
INPUT_TYPES = {
    "query": "query",
    "document": "document",
    "search_query": "query",
    "search_document": "document",
    "classification": None,
    "clustering": None,
}


# vLLM's words for the tasks it removed (vllm/tasks.py)
REMOVED_TASKS = {
    "score": "`score` task was removed; use `classify` instead.",
    "encode": "`encode` task was removed; use `token_embed` or `token_classify` instead.",
}


class TaskError(ValueError):
    """A task that is not valid here (unknown, unsupported by the model, repeated, conflicting)."""


@dataclass
class PoolingParams:
    """Options of one pooling request (vLLM's `PoolingParams`)."""

    use_activation: bool | None = None
    """Apply the task's activation: L2 normalize (embed tasks), softmax/sigmoid (classify tasks)."""
    dimensions: int | None = None
    """Matryoshka truncation of embed / token_embed outputs (None: full size)."""
    truncate_prompt_tokens: int | None = None
    """Keep at most this many tokens (special tokens included); -1 means the model's maximum."""
    normalize: bool | None = None
    """Older name of `use_activation` for the embed tasks."""
    activation: bool | None = None
    """Older name of `use_activation` for the classify tasks."""
    softmax: bool | None = None
    """Removed; rejected with a pointer to `use_activation`."""
    task: str | None = None
    """embed, token_embed, classify or token_classify; set by the entrypoint that receives the request."""
    step_tag_id: int | None = None
    """STEP pooling: return only tokens with this id."""
    returned_token_ids: list[int] | None = None
    """STEP pooling: return only these output columns."""
    input_type: str | None = None
    """Late-interaction (ColBERT) models: encode as a "query" or a "document" (default document). Cohere's
    search_query / search_document are accepted as aliases; other models ignore it. Models with instruction
    prompts (config_sentence_transformers.json `prompts`, e.g. Qwen3-Embedding) prepend the prompt of that
    name to text inputs."""
    long_input: str | None = None
    """Encoder input longer than the model's maximum: "truncate" (cut to max_model_len, as
    sentence-transformers does) or "window" (split into windows of max_model_len: embed returns the
    token-weighted mean of the windows' pooled vectors followed by the task's activation; token_embed and
    token_classify return one vector per input token). None: the engine's setting (default "truncate")."""
    window_overlap: int | None = None
    """long_input="window": tokens shared by consecutive windows (each token's vector is taken from the
    window where it is farther from the edge). None: the engine's setting (default 0)."""

    sparse_top_k: int | None = None
    """embed_sparse: keep only the k largest weights."""
    sparse_threshold: float | None = None
    """embed_sparse: drop weights below this value."""
    return_tokens: bool = False
    """embed_sparse: also return the vocabulary string of each index."""
    pool_factor: int | None = None
    """token_embed of documents: cluster the token vectors into len // pool_factor groups and return their means
    (PyLate's hierarchical token pooling; the first vector is kept). Queries are never pooled."""
    token_encoding: str | None = None
    """token_embed: "int8" (a scale per vector) or "binary" (sign bits) codes instead of float vectors, for
    storage (polyvec.token_codes: the output's `codes`, and MaxSim against them). None: float vectors."""
    muvera: MuveraParams | dict | bool | None = None
    """token_embed: the token vectors' MUVERA fixed-dimensional encoding instead, one vector per input
    (polyvec.muvera; True or {} for fastembed's defaults k_sim=5, dim_proj=16, r_reps=20, seed=42). Queries
    (input_type "query") and documents are encoded differently; both sides must use the same parameters."""
    late_chunking_params: LateChunkingParams | None = None
    """token_embed, offline: mean-pool the token vectors per span of `chunk_size` tokens (vLLM's late
    chunking); the output is one vector per chunk, and `PoolingRequestOutput.late_chunking` gives the spans."""

    # vLLM's internal fields, accepted so that code building PoolingParams as vLLM's own does runs unchanged.
    requires_token_ids: bool = False
    """No effect: every output carries its `prompt_token_ids`."""
    skip_reading_prefix_cache: bool | None = None
    """No effect: a prompt read from the prefix cache gives the same outputs as one computed whole."""
    late_interaction_params: Any = None
    """No effect: `LLM.score` and the score routes set up late interaction themselves."""
    extra_kwargs: dict[str, Any] | None = None
    """No effect: options for vLLM's plugins."""
    output_kind: Any = None
    """No effect: pooling outputs are always final."""

    def clone(self) -> PoolingParams:
        """A deep copy, as vLLM's (a clone's extra_kwargs or token lists are its own)."""
        return copy.deepcopy(self)

    SPARSE_OPTIONS: ClassVar[tuple[str, ...]] = ("sparse_top_k", "sparse_threshold", "return_tokens")

    def __post_init__(self) -> None:
        if isinstance(self.task, str) and self.task in REMOVED_TASKS:  # refused when built, as vLLM does
            raise TaskError(REMOVED_TASKS[self.task])

    def sparse_options(self) -> list[str]:
        """The embed_sparse options given, by name (each applies to that task only)."""
        return [n for n in self.SPARSE_OPTIONS if getattr(self, n) is not None and getattr(self, n) is not False]

    def verify(self, task: str | None, model_config: ModelConfig, supported_tasks: tuple[str, ...]) -> PoolingParams:
        """Check against the task and model; return a copy with `task` and `use_activation` resolved."""
        task = task or self.task
        if task is None:
            raise TaskError(f"task must be given; this model supports: {', '.join(supported_tasks)}")
        if self.task is not None and self.task != task:
            raise TaskError(f"task={self.task!r} in PoolingParams conflicts with the requested task {task!r}")
        if task in REMOVED_TASKS:
            raise TaskError(REMOVED_TASKS[task])
        if task not in POOLING_TASKS:
            raise TaskError(f"task={task!r} is not a pooling task; allowed: {', '.join(POOLING_TASKS)}")
        if task not in supported_tasks:
            raise TaskError(
                f"Unsupported task: {task!r} is not supported by this model ({model_config.architecture}); "
                f"it supports: {', '.join(supported_tasks)}"
            )
        if self.softmax is not None:
            raise ValueError("softmax is no longer a PoolingParams field; use use_activation=True/False instead")
        for name in ("use_activation", "normalize", "activation", "return_tokens"):  # "no" would read as true
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be true or false, got {value!r}")
        if self.late_chunking_params is not None:
            if not isinstance(self.late_chunking_params, LateChunkingParams):
                raise ValueError(f"late_chunking_params must be LateChunkingParams, got {self.late_chunking_params!r}")
            if task != "token_embed":
                raise ValueError("Late chunking requires token_embed")
        factor = self.pool_factor
        if factor is not None:
            if isinstance(factor, bool) or not isinstance(factor, int) or factor < 1:
                raise ValueError(f"pool_factor must be a positive integer, got {factor!r}")
            if task != "token_embed":
                raise ValueError(f"pool_factor applies to token_embed, not {task!r}")
            if self.late_chunking_params is not None:
                raise ValueError("pool_factor and late_chunking_params cannot be combined")

        if self.token_encoding is not None:
            if self.token_encoding not in ("int8", "binary"):
                raise ValueError(f"token_encoding must be 'int8' or 'binary', got {self.token_encoding!r}")
            if task != "token_embed":
                raise ValueError(f"token_encoding applies to token_embed, not {task!r}")
            if self.late_chunking_params is not None:
                raise ValueError("token_encoding and late_chunking_params cannot be combined")

        sparse = task == "embed_sparse"
        given = self.sparse_options()
        if not sparse and given:  # named first, so that a server's error names the field
            verb = "applies" if len(given) == 1 else "apply"
            raise ValueError(f"{', '.join(given)} {verb} to embed_sparse, not {task!r}")
        if sparse:
            off = [n for n in ("use_activation", "normalize", "activation") if getattr(self, n) is False]
            if off:  # named as the caller spelled it
                raise ValueError(
                    f"{off[0]}=False is not valid: embed_sparse always applies its activation (log(1 + relu))"
                )
            k, threshold = self.sparse_top_k, self.sparse_threshold
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
                raise ValueError(f"sparse_top_k must be a positive integer, got {k!r}")
            if threshold is not None and (
                isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold >= 0  # NaN
            ):
                raise ValueError(f"sparse_threshold must be a non-negative number, got {threshold!r}")
            if self.long_input == "window":
                raise ValueError("long_input='window' does not apply to embed_sparse")

        is_embed = task in EMBED_TASKS
        use_activation = self.use_activation
        for alias, valid in (("normalize", is_embed), ("activation", not is_embed)):
            value = getattr(self, alias)
            if value is None:
                continue
            if not valid:
                allowed = "embed, token_embed" if alias == "normalize" else "classify, token_classify"
                raise ValueError(
                    f"{alias} is only valid for the {allowed} tasks, not {task!r}; use use_activation instead"
                )
            if use_activation is not None and use_activation != value:
                raise ValueError(f"{alias}={value} conflicts with use_activation={use_activation}")
            use_activation = value
        pooler = model_config.pooler_config
        if use_activation is None:
            use_activation = True if pooler.use_activation is None else pooler.use_activation

        dimensions = self.dimensions
        if dimensions is not None and not is_embed:
            raise ValueError(f"dimensions is only valid for the embed and token_embed tasks, not {task!r}")
        if dimensions is None and is_embed:
            dimensions = (
                pooler.dimensions if pooler.dimensions is not None or task != "embed" else model_config.truncate_dim
            )
        if dimensions is not None:
            dimensions = _check_dimensions(dimensions, task, model_config)

        truncate = self.truncate_prompt_tokens
        if truncate is not None:
            limit = model_config.max_model_len
            if isinstance(truncate, bool) or not isinstance(truncate, int):
                raise ValueError(f"truncate_prompt_tokens must be an integer, got {truncate!r}")
            if truncate == -1:
                truncate = limit
            elif truncate < 1:
                raise ValueError(
                    f"truncate_prompt_tokens must be -1 (the model's maximum) or between 1 and {limit}, got {truncate}"
                )
            elif truncate > limit:
                raise ValueError(
                    f"truncate_prompt_tokens={truncate} is larger than the model's maximum "
                    f"input length max_model_len={limit}; allowed: -1 or 1..{limit}"
                )

        token_task = task in ("token_embed", "token_classify")  # the pooler's STEP settings: token tasks only
        step_tag_id = self.step_tag_id if self.step_tag_id is not None else pooler.step_tag_id if token_task else None
        returned = self.returned_token_ids
        if returned is None and token_task:
            returned = pooler.returned_token_ids
        if self.late_chunking_params is not None:
            self.late_chunking_params.verify()  # a chunk_size set after construction, as vLLM checks it
            if step_tag_id is not None:  # the request's or the pooler's: chunks are spans of every row
                raise ValueError("Late chunking requires all token rows (no step_tag_id)")
        if (self.step_tag_id is not None or self.returned_token_ids is not None) and task in (
            "embed",
            "classify",
            "embed_sparse",
        ):
            raise ValueError(
                f"step_tag_id and returned_token_ids apply to STEP pooling of token tasks "
                f"({', '.join(t for t in POOLING_TASKS if t.startswith('token'))}), not {task!r}"
            )
        if step_tag_id is not None and (
            isinstance(step_tag_id, bool) or not isinstance(step_tag_id, int) or step_tag_id < 0
        ):
            raise ValueError(f"step_tag_id must be a non-negative integer (a token id), got {step_tag_id!r}")
        if returned is not None and (
            not isinstance(returned, (list, tuple))
            or not returned
            or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in returned)
        ):
            raise ValueError(f"returned_token_ids must be a non-empty list of non-negative integers, got {returned!r}")

        input_type = self.input_type
        if input_type is not None:
            declared = model_config.prompts  # a prompt the model names (sentence-transformers' prompt_name)
            if input_type not in INPUT_TYPES and input_type not in declared:
                allowed = ", ".join([*INPUT_TYPES, *(n for n in declared if n not in INPUT_TYPES)])
                raise ValueError(f"Unsupported input_type {input_type!r}; allowed: {allowed}")
            # a prompt the model declares by that name is its own (vLLM's task instructions); else Cohere's names are
            # the modes they mean (a ColBERT model's modes are query and document whatever it declares)
            if input_type not in declared or model_config.colbert is not None:
                input_type = INPUT_TYPES.get(input_type, input_type)

        if self.long_input is not None and self.long_input not in LONG_INPUT_MODES:
            raise ValueError(f"long_input={self.long_input!r} is not valid; allowed: {', '.join(LONG_INPUT_MODES)}")
        if self.long_input == "window" and task == "classify":
            raise ValueError(
                "long_input='window' applies to the embed, token_embed and token_classify tasks, not classify"
            )
        overlap = self.window_overlap
        if overlap is not None and (isinstance(overlap, bool) or not isinstance(overlap, int) or overlap < 0):
            raise ValueError(f"window_overlap must be a non-negative integer, got {overlap!r}")
        if overlap is not None and overlap >= model_config.max_model_len // 2:
            raise ValueError(
                f"window_overlap={overlap} must be less than half of max_model_len={model_config.max_model_len}"
            )

        muvera = None
        if self.muvera is not None and self.muvera is not False:
            muvera = MuveraParams.coerce(self.muvera)
            if task != "token_embed":
                raise ValueError(f"muvera applies to token_embed, not {task!r}")
            if self.token_encoding is not None or self.late_chunking_params is not None:
                raise ValueError("muvera cannot be combined with token_encoding or late_chunking_params")
            # STEP pooling keeps the returned_token_ids columns
            muvera.check_width(len(returned) if returned is not None else dimensions or model_config.token_dim)

        return dataclasses.replace(
            self,
            task=task,
            muvera=muvera,
            input_type=input_type,
            use_activation=use_activation,
            normalize=None,
            activation=None,
            dimensions=dimensions,
            truncate_prompt_tokens=truncate,
            step_tag_id=step_tag_id,
            returned_token_ids=returned,
        )

    @property
    def is_step(self) -> bool:
        return self.step_tag_id is not None or self.returned_token_ids is not None


def _check_dimensions(dimensions: int, task: str, model_config: ModelConfig) -> int:
    if isinstance(dimensions, bool) or not isinstance(dimensions, int):
        raise ValueError(f"dimensions must be an integer, got {dimensions!r}")
    full = model_config.embed_dim if task == "embed" else model_config.token_dim
    if model_config.matryoshka_dimensions:
        allowed = model_config.matryoshka_dimensions
        if dimensions not in allowed:
            raise ValueError(
                f"dimensions={dimensions} is not one of this model's Matryoshka dimensions: "
                f"{', '.join(map(str, allowed))}"
            )
        return dimensions
    if not model_config.is_matryoshka:
        if dimensions == full:
            return dimensions
        raise ValueError(
            f"dimensions={dimensions} is not allowed: this model was not trained for Matryoshka "
            f"representations, so only its full size {full} is valid (set is_matryoshka or "
            f"matryoshka_dimensions through hf_overrides to opt in)"
        )
    if not 1 <= dimensions <= full:
        raise ValueError(f"dimensions={dimensions} is out of range; allowed: 1..{full}")
    return dimensions


def token_pooling_type(params: PoolingParams, default: str) -> str:
    """Token tasks use STEP when a step option is set, else the configured token pooling type."""
    if params.is_step:
        return "STEP"
    return default if default in TOKEN_POOLING_TYPES else "ALL"
