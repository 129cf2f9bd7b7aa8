"""State of one request inside the engine."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ..pooling_params import PoolingParams


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    token_type_ids: list[int] | None
    params: PoolingParams  # verified: task and activation resolved
    spec: Any  # layers.pooler.PoolingSpec; kept opaque so the scheduler stays free of torch
    num_input_tokens: int  # before truncation
    num_key_tokens: int | None = None  # tokens others may attend to (ColBERT unattended expansion); None: all
    keep: list[int] | None = None  # positions whose outputs are returned (ColBERT skiplist); None: all
    input_type: str | None = None  # ColBERT mode used: "query" or "document"
    extra: list[tuple[str, Any]] = field(default_factory=list)  # more (task, spec) read from the same pass
    by_task: bool = False  # asked as a list of tasks: the output is {task: tensor}, even for a list of one
    skip_prompt: int = 0  # include_prompt: false: the instruction prompt's tokens, left out of sequence pooling
    static_output: Any = None  # an output known without the model (inference-free SPLADE queries)
    images: list[Any] | None = None  # multimodal.image.Qwen2VLPixels of the prompt's images, in prompt order
    priority: int = 0  # lower is served earlier under the priority scheduling policy
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None  # time.monotonic() when a step first took it (a window's: its parent's)
    # Causal models (chunked prefill):
    chunkable: bool = False
    num_computed_tokens: int = 0  # tokens scheduled so far (their KV is in kv_cache)
    num_cached_tokens: int = 0  # leading tokens whose KV came from the prefix cache
    block_hashes: list[bytes] | None = None  # prefix-caching names of the prompt's full blocks
    kv_cache: Any = None  # layers.attention.KVCache while the request is being prefilled in chunks
    pool_state: Any = None  # layers.pooler.PoolingState carried across chunks
    # Encoder input longer than max_model_len, split into windows (the parent holds the window requests):
    windows: list[Request] | None = None
    window_spans: list[tuple[int, int, int]] | None = None  # per window: (first token, kept from, kept to)
    parent: Request | None = None
    window_output: Any = None  # a window's result, kept until its siblings are done

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)
