"""Prompts in, verified `Request`s out: tokenization, truncation, parameter checks, instruction prompts, the
ColBERT recipe, and the split of over-long inputs into window requests.

Thread-safe and free of engine stepping state, so a server can run `process` off its event loop: everything
here is fixed at construction except the request-id counter, which a lock guards.
"""

from __future__ import annotations

import dataclasses
import itertools
import numbers
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from ..config import EMBED_TASKS, EngineConfig, ModelConfig
from ..layers.pooler import PoolingSpec, prune_sparse
from ..multimodal.image import is_image_prompt
from ..pooling_params import PoolingParams, TaskError, token_pooling_type
from ..tokenizer import PolyTokenizer, PromptTooLongError, TruncationSide
from .late_interaction import LateInteractionRecipe
from .long_input import split_windows
from .prefix_cache import block_hashes
from .request import Request

if TYPE_CHECKING:
    from ..models.registry import PoolingModel

# A prompt is text, a (text, text) pair, token ids, or vLLM's TextPrompt / TokensPrompt dicts.
Prompt = str | tuple[str, str] | Sequence[int] | dict[str, Any]


class InputProcessor:
    """Turns prompts into `Request`s for one model; `causal`, `kv_cache_tokens` and `prefix_caching` describe
    the engine's caches, which bound and annotate causal requests."""

    def __init__(
        self,
        model_config: ModelConfig,
        engine_config: EngineConfig,
        tokenizer: PolyTokenizer,
        model: PoolingModel,
        *,
        causal: bool,
        kv_cache_tokens: int,
        prefix_caching: bool,
    ):
        self.model_config = model_config
        self.engine_config = engine_config
        self.tokenizer = tokenizer
        self.model = model
        self.causal = causal
        self.kv_cache_tokens = kv_cache_tokens
        self.prefix_caching = prefix_caching
        self.supported_tasks: tuple[str, ...] = model.supported_tasks
        # segment embeddings' rows (0: none, types unused); a type beyond them failed inside the forward pass
        self.type_vocab_size = int(
            getattr(getattr(getattr(model, "encoder", None), "args", None), "type_vocab_size", 0)
        )
        # token ids the model has embeddings for (config.json's vocab_size; a tokenizer may declare tokens beyond)
        self.id_rows = int(model_config.hf_config.get("vocab_size") or tokenizer.vocab_size)
        self._tokens_past_rows = tokenizer.vocab_size > self.id_rows  # then a text's ids are checked
        if model_config.bge_m3 is not None:  # its sparse head: pooled, or per token as vLLM serves it
            self.supported_tasks += ("embed_sparse", "token_classify")
        if model_config.splade_embed is not None:  # vLLM's SPLADE: embed is the sparse vector (its own task)
            self.supported_tasks = ("embed", *self.supported_tasks)
        self.colbert = LateInteractionRecipe.resolve(model_config, tokenizer)
        if self.colbert is not None:
            # A late-interaction model's outputs are its token vectors; a single pooled vector is not what
            # it was trained to produce.
            self.supported_tasks = ("token_embed",)
        self._prompt_lengths: dict[tuple[str, bool, bool | None], int] = {}  # include_prompt: false
        self.special_ids = frozenset(i for i, tok in tokenizer._base.get_added_tokens_decoder().items() if tok.special)
        # vLLM pads with the tokenizer's pad token; config.json's where the tokenizer names none
        config_pad = model_config.hf_config.get("pad_token_id")
        self.pad_token_id = tokenizer.special_token_id("pad_token")
        if self.pad_token_id is None and isinstance(config_pad, int) and not isinstance(config_pad, bool):
            self.pad_token_id = config_pad
        self._ids = itertools.count()
        self._id_lock = threading.Lock()
        self.static_query: torch.Tensor | None = None  # inference-free SPLADE: a weight per vocabulary id
        if model_config.splade.query_weights is not None and "embed_sparse" in self.supported_tasks:
            self.static_query = _read_static_weights(model_config.splade.query_weights)

    def default_pooling(self, task: str) -> tuple[str, ...]:
        """Sequence pooling of a task: the user's PoolerConfig, else the ST Pooling module, else the model's."""
        override = self.model_config.pooler_config.seq_pooling_type
        if override is not None:
            return (override,)
        if task == "embed" and self.model_config.st_pooling:
            return self.model_config.st_pooling
        return (self.model.default_pooling,)

    def output_width(self, task: str) -> int:
        if task == "embed":
            return self.model_config.embed_dim
        if task == "token_embed":
            return self.model_config.token_dim
        if self.model_config.bge_m3 is not None:  # token_classify: the sparse head's one weight per token
            return 1
        if self.model.head_kind == "ForMaskedLM":
            return int(self.model_config.hf_config["vocab_size"])
        return self.model_config.num_labels

    def verify_params(self, params: PoolingParams | None, task: str | None) -> PoolingParams:
        return (params or PoolingParams()).verify(task, self.model_config, self.supported_tasks)

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
        """Tokenize and check prompts; raises ValueError (naming the prompt and limit) on bad input.

        `truncation` ("auto" / "error") overrides the engine's setting for these prompts; `truncation_side`
        ("right", the default, or "left": keep the last tokens) is the end that truncation cuts. `padding`
        "max_length" (vLLM's, for models trained on fixed-length input without an attention mask) fills each text
        or token prompt, once truncated, with the tokenizer's pad token up to max_model_len (a number: up to that
        many tokens, offline tokenization_kwargs' max_length); the pads are attended, as in vLLM. Several tasks (a
        list) are all read from one forward pass of each prompt (`Request.extra`). `max_window_tokens`: the most
        tokens an input split into windows may have (a server's window limit), longer refused as too long with
        that max_len (a huge text from a part of it, not tokenized whole). `do_lower_case` (vLLM's
        tokenization_kwargs key) overrides the model's lowercasing of texts.
        """
        limit = self.model_config.max_model_len
        if isinstance(padding, int) and not isinstance(padding, bool):  # a length (False is vLLM's "do not pad")
            if not 1 <= padding <= limit:
                raise ValueError(f"padding to max_length={padding}: it must be between 1 and max_model_len={limit}")
            pad_width: int | None = padding
        elif padding in (None, False, "do_not_pad", "max_length"):
            pad_width = limit if padding == "max_length" else None
        else:
            raise ValueError(f"padding must be 'max_length' or 'do_not_pad', got {padding!r}")
        if pad_width is not None and self.colbert is not None and self.colbert.inserts_marker:
            raise ValueError("padding='max_length' does not apply to a ColBERT model: its recipe sets the lengths")
        if task is not None and not isinstance(task, str):
            if pad_width is not None:
                raise ValueError("padding='max_length' applies to one task per request")
            return self._process_multi(
                prompts, params, list(task), request_ids, add_special_tokens, truncation, truncation_side, do_lower_case
            )
        if truncation_side not in (None, "left", "right"):
            raise ValueError(f"truncation_side must be 'left' or 'right', got {truncation_side!r}")
        side: TruncationSide = truncation_side or self.tokenizer.default_truncation_side
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
        pixels: dict[int, list[Any]] = {}  # prompt index → its images' patches (ColQwen2)
        spent = [0]  # decoded image pixels of these prompts so far
        # one encode_prompts call per limit and kind (text or pair): what a text gets never depends on the others
        text_groups: dict[tuple[int, bool, bool, bool], list[int]] = {}
        windowed = [self._long_input(p) == "window" for p in verified]
        over_windows = [False] * n
        skips = [0] * n  # include_prompt: false: the leading tokens sequence pooling leaves out
        # Inference-free SPLADE queries: weights looked up per token id, no forward pass (Request.static_output)
        static = [
            self.static_query is not None and p.task == "embed_sparse" and p.input_type == "query" for p in verified
        ]
        for i, (prompt, p) in enumerate(zip(prompts, verified)):
            max_len = p.truncate_prompt_tokens or limit
            if windowed[i] and p.truncate_prompt_tokens is None:
                max_len = 1 << 62  # tokenized whole, then split into windows of max_model_len
                if self.model_config.pooler_config.max_embed_len:  # vLLM's cap on chunked inputs: longer is an error
                    max_len = self.model_config.pooler_config.max_embed_len
                if max_window_tokens:
                    max_len = min(max_len, max_window_tokens)
            if self.colbert is not None and self.colbert.inserts_marker:  # its length, less a marker after [CLS]
                max_len = min(max_len, self.colbert.length(p.input_type))
                max_len -= int(self.colbert.marker(p.input_type) is not None)
                if max_len < 1:
                    raise PromptError(
                        i,
                        f": truncate_prompt_tokens={p.truncate_prompt_tokens} leaves no token of it: a ColBERT model's "
                        "marker token takes one (2 at least)",
                    )
            # An explicit truncate_prompt_tokens or long_input="truncate" asks for truncation even when the engine
            # rejects long input; a ColBERT recipe always truncates to its query/document length, as its reference
            # does.
            recipe = self.colbert is not None and self.colbert.inserts_marker
            asked = p.truncate_prompt_tokens is not None or p.long_input == "truncate"
            truncate = not error_mode or asked or recipe
            if windowed[i] and max_len != 1 << 62 and p.truncate_prompt_tokens is None:
                truncate = False
            # too long here is over the windows a server allows (its 413), not over the model's length
            over_windows[i] = windowed[i] and max_len == max_window_tokens
            add_special = add_special_tokens
            if static[i]:  # as sentence-transformers' SparseStaticEmbedding tokenizes: truncated, no special tokens
                truncate, add_special = True, False
            if is_image_prompt(prompt):  # a bare image (PIL, bytes, a data:image URL): the model's image prompt
                if self.model_config.colqwen2 is None:  # never read an image as text or token ids
                    raise PromptError(i, f" is an image ({_image_kind(prompt)}); this model reads text only")
                prompt = {"multi_modal_data": {"image": prompt}}
            if isinstance(prompt, dict):
                if prompt.get("multi_modal_data"):  # never drop an image silently
                    spec = self.model_config.colqwen2
                    if spec is None:
                        raise PromptError(i, " carries multi_modal_data; this model reads text only")
                    pixels[i] = self._pixels(i, prompt["multi_modal_data"], spent)
                    prompt = prompt.get("prompt") or spec.visual_prompt
                    text_groups.setdefault((1 << 62, False, False, False), []).append(i)
                    tokenized[i] = prompt
                    continue
                if "prompt_token_ids" in prompt:
                    types = prompt.get("token_type_ids")  # vLLM's TokensPrompt for cross-encoders: the segments
                    prompt = prompt["prompt_token_ids"]
                    if types is not None:
                        ids, _, num = self._token_prompt(
                            i, cast(Sequence[int], prompt), max_len, truncate, side, over_windows[i]
                        )
                        if len(types) != len(prompt) or any(type(t) is not int or t < 0 for t in types):
                            raise PromptError(i, ": token_type_ids must be one integer >= 0 per token id")
                        if len(ids) != len(prompt):
                            raise PromptError(i, ": token ids with token_type_ids are not truncated; shorten both")
                        tokenized[i] = (ids, list(types), num)
                        continue
                elif "prompt" in prompt:
                    prompt = prompt["prompt"]
                else:
                    raise PromptError(i, " is a dict without 'prompt' or 'prompt_token_ids'")
            if isinstance(prompt, str) or _is_text_pair(prompt):
                # Text pairs (query, document) are encoded as one sequence with segment ids: cross-encoders.
                tokenized[i] = self._with_prompt(prompt, p) if isinstance(prompt, str) else tuple(prompt)
                if isinstance(prompt, str) and tokenized[i] != prompt and not self.model_config.pool_prompt:
                    head = tokenized[i][: len(tokenized[i]) - len(prompt)]
                    skips[i] = self._prompt_length(head, add_special, do_lower_case)
                spec = self.model_config.colqwen2
                if spec is not None and isinstance(prompt, str) and p.input_type == "query":
                    tokenized[i] = spec.query_prefix + prompt + spec.query_suffix  # colpali-engine's queries
                    add_special = add_special and spec.family != "paligemma"  # ColPali's prompt writes <bos>
                pair = isinstance(tokenized[i], tuple)
                text_groups.setdefault((max_len, truncate, add_special, pair), []).append(i)
            else:
                # Neither text nor a text pair: token ids (`_token_prompt` checks them).
                if not hasattr(prompt, "__len__") or isinstance(prompt, (bytes, dict)):
                    raise PromptError(
                        i, f" is {type(prompt).__name__}: a prompt is a text, a text pair, token ids or a prompt dict"
                    )
                # asked for, it would be silently lost (a ColBERT model's input_type picks its mode: token ids are
                # sent as they are meant, marker added)
                if p.input_type is not None and self.colbert is None and self._with_prompt("", p):
                    raise PromptError(
                        i,
                        f": input_type={p.input_type!r} puts the model's {p.input_type!r} prompt before a text; "
                        "token ids cannot take it (send the text, or the prompt's ids with yours)",
                    )
                tokenized[i] = self._token_prompt(
                    i, cast(Sequence[int], prompt), max_len, truncate, side, over_windows[i]
                )
        for (max_len, truncate, add_special, _), members in text_groups.items():
            try:
                encoded = self.tokenizer.encode_prompts(
                    [tokenized[i] for i in members],
                    max_len,
                    truncate,
                    add_special_tokens=add_special,
                    truncation_side=side,
                    lower_case=do_lower_case,
                )
            except TypeError:  # tokenizers refuses a str it cannot encode (a lone surrogate): name the prompt
                for i in members:
                    _check_unicode(i, tokenized[i])
                raise
            except PromptTooLongError as exc:
                error = _too_long(members[exc.index], exc.num_tokens, max_len, exc.at_least)
                error.over_windows = over_windows[members[exc.index]]
                raise error from None
            for i, enc in zip(members, encoded):
                tokenized[i] = (enc.input_ids, enc.token_type_ids, enc.num_input_tokens)
            if self._tokens_past_rows:  # a token only the tokenizer's configs declare
                for i in members:
                    ids = tokenized[i][0]
                    if ids and max(ids) >= self.id_rows:
                        beyond = next(t for t in ids if t >= self.id_rows)
                        token = self.tokenizer.id_to_token(beyond)
                        raise PromptError(
                            i,
                            f": its token {token!r} has id {beyond}, beyond the model's {self.id_rows} token "
                            "embeddings (the tokenizer declares it, the model was not trained with it)",
                        )

        requests = []
        for i in range(n):
            ids, types, num_input = tokenized[i]
            if i in pixels:
                ids = self._expand_images(i, ids, pixels[i])
                num_input = len(ids)
                most = verified[i].truncate_prompt_tokens
                if most is not None and num_input > most:  # an image's tokens are never cut: say so, not ignore it
                    raise PromptError(
                        i,
                        f" has {num_input} tokens with its images, more than the truncation limit of {most} "
                        "(truncate_prompt_tokens; Cohere's max_tokens); images are not truncated: raise the limit "
                        "or send smaller images",
                    )
            if pad_width is not None and i not in pixels and not static[i]:  # an input that fits, windowed or not
                if len(ids) < pad_width:
                    pad = self.pad_token_id
                    if pad is None:
                        raise PromptError(i, ": padding='max_length' needs a pad token (the tokenizer has none)")
                    if pad >= self.id_rows:  # a pad token only the tokenizer's configs declare
                        raise PromptError(
                            i, f": padding='max_length' pads with token id {pad}, beyond the model's {self.id_rows} "
                            "token embeddings",
                        )  # fmt: skip
                    ids = [*ids, *[pad] * (pad_width - len(ids))]
                    types = None if types is None else [*types, *[0] * (pad_width - len(types))]
            if not ids and not static[i]:  # text the tokenizer drops entirely, without special tokens around it
                raise PromptError(
                    i,
                    " has no tokens after tokenization (add_special_tokens is off and the tokenizer keeps nothing"
                    " of the text)",
                    subject="input",
                )
            if types and self.type_vocab_size and max(types) >= self.type_vocab_size:
                raise PromptError(
                    i,
                    f": token type {max(types)} is beyond the model's {self.type_vocab_size} segment types "
                    "(type_vocab_size); a text pair needs a model with two",
                )
            skip = min(skips[i], max(len(ids) - 1, 0))  # at least one token is pooled
            request = Request(
                request_id=request_ids[i],
                prompt_token_ids=ids,
                token_type_ids=types,
                params=verified[i],
                spec=skip_prompt(specs[i], skip),
                num_input_tokens=num_input,
                skip_prompt=skip,
            )
            if static[i]:
                request.static_output = self._static_sparse(ids, specs[i])
                requests.append(request)
                continue
            if self.model_config.colqwen2 is not None:  # whole prompts, one step each; no prefix caching
                spec = self.model_config.colqwen2
                if i not in pixels and spec.family == "qwen2_vl" and spec.image_token_id in ids:
                    # the vision rotary positions would look for an image behind it (it was a 500 at the forward)
                    raise PromptError(i, f" holds {spec.image_pad}, the image placeholder, and no image")
                request.images = pixels.get(i)
                request.input_type = "document" if i in pixels else (verified[i].input_type or "document")
                budget = min(self.engine_config.max_num_batched_tokens, limit)
                if request.num_tokens > budget:
                    raise PromptError(i, f" has {request.num_tokens} tokens (images included), more than {budget}")
                requests.append(request)
                continue
            if self.colbert is not None:
                self.colbert.apply(request)
            if windowed[i] and request.num_tokens > limit:
                overlap = verified[i].window_overlap
                split_windows(
                    request,
                    limit,
                    overlap if overlap is not None else self.engine_config.window_overlap,
                    self.special_ids,
                )
            for part in request.windows or [request]:  # a decoder prefills each window like any prompt
                if self.causal:
                    part.chunkable = True
                    if part.num_tokens > self.kv_cache_tokens:
                        raise PromptError(
                            i,
                            f" has {part.num_tokens} tokens, more than the KV cache holds "
                            f"({self.kv_cache_tokens} tokens); raise kv_cache_memory_bytes",
                        )
                    if self.prefix_caching:
                        part.block_hashes = block_hashes(part.prompt_token_ids)
            requests.append(request)
        return requests

    def _pixels(self, i: int, data: Any, spent: list[int]) -> list[Any]:
        """A prompt's multi_modal_data: its images' patches (an ImageError becomes a PromptError naming both);
        `spent` counts the decoded pixels of the call's images so far, against max_request_image_pixels."""
        from ..multimodal.image import ImageError, Qwen2VLPixels, load_image, qwen2_vl_patches, siglip_patches

        spec = self.model_config.colqwen2
        assert spec is not None
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise PromptError(i, ": multi_modal_data takes 'image' (one image or a list) only")
        images = data["image"] if isinstance(data["image"], (list, tuple)) else [data["image"]]
        if not images:
            raise PromptError(i, ": multi_modal_data['image'] is empty")
        most = self.engine_config.max_images_per_prompt
        if most is not None and len(images) > most:
            raise PromptError(i, f" has {len(images)} images, more than the limit of {most} per prompt")
        budget = self.engine_config.max_request_image_pixels

        def within_budget(width: int, height: int) -> None:
            spent[0] += width * height
            if budget is not None and spent[0] > budget:
                raise ImageError(
                    k, f"the request's images reach {spent[0]} pixels, more than the limit of {budget} per request"
                )

        vision = spec.vision_config
        out = []
        for k, source in enumerate(images):
            try:
                image = load_image(
                    source,
                    k,
                    self.engine_config.max_image_pixels,
                    allowed_domains=self.engine_config.allowed_media_domains,
                    before_decode=within_budget,
                    transparent_on_white=spec.transparent_on_white,
                )
                if spec.family == "paligemma":  # one square size: every image gives (size / patch)² patches
                    patch, side = int(vision.get("patch_size", 14)), spec.image_size
                    patches = siglip_patches(image, side, patch, spec.image_mean, spec.image_std)
                    out.append(Qwen2VLPixels(patches, (1, side // patch, side // patch)))
                    continue
                out.append(
                    qwen2_vl_patches(
                        image,
                        spec.min_pixels,
                        spec.max_pixels,
                        int(vision.get("patch_size", 14)),
                        int(vision.get("spatial_merge_size", 2)),
                        int(vision.get("temporal_patch_size", 2)),
                        spec.image_mean,
                        spec.image_std,
                        index=k,
                    )
                )
            except ImageError as e:
                raise PromptError(i, f": {e}") from None
        return out

    def _expand_images(self, i: int, ids: list[int], pixels: list[Any]) -> list[int]:
        """Each image placeholder token → as many as the image has merged tokens (the processor's expansion)."""
        spec = self.model_config.colqwen2
        assert spec is not None
        pad = spec.image_token_id
        merge = 1 if spec.family == "paligemma" else int(spec.vision_config.get("spatial_merge_size", 2)) ** 2
        if ids.count(pad) != len(pixels):
            raise PromptError(i, f" has {ids.count(pad)} {spec.image_pad} placeholders for {len(pixels)} images")
        out: list[int] = []
        k = 0
        for t in ids:
            if t == pad:
                out += [pad] * (pixels[k].num_patches // merge)
                k += 1
            else:
                out.append(t)
        return out

    def _static_sparse(self, ids: list[int], spec: PoolingSpec) -> torch.Tensor:
        """weight[id] for each distinct token id of the query (SparseStaticEmbedding), pruned as requested."""
        weights = self.static_query
        assert weights is not None  # only static requests get here
        out = torch.zeros_like(weights)
        if ids:
            at = torch.tensor(ids, dtype=torch.long).clamp_(0, weights.numel() - 1)
            out[at] = weights[at]
        return prune_sparse(spec, out.unsqueeze(0))[0]

    def _process_multi(self, prompts, params, tasks: list[str], request_ids, add_special, truncation, side, lower):
        if not tasks or len(set(tasks)) != len(tasks):
            raise TaskError(f"tasks must be a non-empty list without repeats, got {tasks!r}")
        if self.causal:
            raise TaskError("several tasks from one pass apply to encoder models (causal ones prefill in chunks)")

        per_prompt = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        for p in per_prompt:
            if p is None:
                continue
            sparse = p.sparse_options()
            if sparse and "embed_sparse" not in tasks:  # as for one task: an option that would do nothing
                raise ValueError(f"{sparse[0]} applies to embed_sparse, which is not among {tasks}")
            shaped = [n for n in ("pool_factor", "muvera", "token_encoding") if getattr(p, n)]
            if shaped:  # they reshape one token_embed output; a list of tasks gives a dict of outputs
                raise ValueError(f"{shaped[0]} applies to one token_embed task, not a list of tasks ({tasks})")

        def for_task(p: PoolingParams | None, task: str) -> PoolingParams:
            p = dataclasses.replace(p or PoolingParams(), task=None)
            # an option that fits some of the tasks leaves the others alone; verify refuses one that fits none
            unset: dict[str, Any] = {}
            for name in _SOME_TASKS_OPTIONS:
                value = getattr(p, name)
                if value is None or (name == "return_tokens" and value is False):
                    continue
                if not _fits(name, value, task) and any(_fits(name, value, t) for t in tasks):
                    unset[name] = False if name == "return_tokens" else None
            return dataclasses.replace(p, **unset)

        requests = self.process(
            prompts,
            [for_task(p, tasks[0]) for p in per_prompt],
            tasks[0],
            request_ids,
            add_special_tokens=add_special,
            truncation=truncation,
            truncation_side=side,
            do_lower_case=lower,
        )
        for i, (r, p) in enumerate(zip(requests, per_prompt)):
            r.by_task = True
            if r.static_output is not None:
                raise PromptError(
                    i, " is an inference-free SPLADE query: several tasks from one pass need the model, it has none"
                )
            if r.windows:
                raise PromptError(
                    i,
                    f" has {r.num_tokens} tokens, more than max_model_len: several tasks from one pass need inputs "
                    "within it (no long_input windows)",
                )
            for task in tasks[1:]:
                spec = self._spec(self.verify_params(for_task(p, task), task))
                r.extra.append((task, skip_prompt(spec, r.skip_prompt)))
        return requests

    def _spec(self, params: PoolingParams) -> PoolingSpec:
        task = params.task
        assert task is not None  # verified params name their task
        pooling: tuple[str, ...]
        ends = self.model_config.splade_embed if task == "embed" else None
        if task == "embed_sparse" or ends is not None:
            pooling = ()  # SPLADE pooling (ModelConfig.splade), in the pooler's sparse path
        elif task in ("embed", "classify"):
            pooling = self.default_pooling(task)
        else:
            pooling = (token_pooling_type(params, self.model_config.pooler_config.tok_pooling_type or "ALL"),)
        if params.returned_token_ids is not None:
            if task == "token_classify" and self.model_config.bge_m3 is not None:
                raise ValueError("returned_token_ids does not apply to bge-m3's token_classify: one weight per token")
            width = self.output_width(task)
            bad = [i for i in params.returned_token_ids if i >= width]
            if bad:
                raise ValueError(f"returned_token_ids {bad} are out of range; this output has {width} columns")
        return PoolingSpec(
            task=task,
            pooling=pooling,
            dimensions=params.dimensions,
            use_activation=bool(params.use_activation),
            step_tag_id=params.step_tag_id,
            returned_token_ids=tuple(params.returned_token_ids) if params.returned_token_ids else None,
            sparse_top_k=params.sparse_top_k,
            sparse_threshold=params.sparse_threshold,
            chunk_size=params.late_chunking_params.chunk_size if params.late_chunking_params is not None else None,
            splade_ends=ends,
        )

    def _long_input(self, params: PoolingParams) -> str:
        mode = params.long_input or self.engine_config.long_input
        if mode == "window" and (self.colbert is not None or self.model_config.colqwen2 is not None):
            if params.long_input == "window":
                raise ValueError(
                    "long_input='window' applies to text models without a ColBERT recipe; "
                    + (
                        "a ColBERT model truncates documents to its document_length"
                        if self.colbert is not None
                        else "page-image models read whole prompts"
                    )
                )
            return "truncate"
        if mode == "window" and params.is_step:
            if params.long_input == "window":
                raise ValueError(
                    "long_input='window' does not apply to STEP pooling (step_tag_id / returned_token_ids)"
                )
            return "truncate"
        if mode == "window" and params.task == "token_classify" and self.model_config.bge_m3 is not None:
            if params.long_input == "window":  # its rows are filtered by token id, which windows repeat
                raise ValueError("long_input='window' does not apply to bge-m3's token_classify (sparse weights)")
            return "truncate"
        sparse = params.task == "embed_sparse" or (
            params.task == "embed" and self.model_config.splade_embed is not None
        )
        if mode == "window" and sparse and params.long_input == "window":
            raise ValueError(f"long_input='window' does not apply to a SPLADE model's {params.task}")
        if mode == "window" and (params.task == "classify" or sparse):
            return "truncate"  # the server-wide default applies to the tasks windows support
        return mode

    def _prompt_length(self, prompt: str, add_special: bool, lower_case: bool | None = None) -> int:
        """`include_prompt: false`: the leading tokens sequence pooling leaves out, counted as
        sentence-transformers counts them (the prompt tokenized alone, less a closing special token), lowercased
        as the text is (`lower_case`: a call's override)."""
        key = (prompt, add_special, lower_case)
        if key not in self._prompt_lengths:
            ids = self.tokenizer.encode_prompts(
                [prompt], 1 << 62, False, add_special_tokens=add_special, lower_case=lower_case
            )[0].input_ids
            self._prompt_lengths[key] = len(ids) - int(bool(ids) and ids[-1] in self.special_ids)
        return self._prompt_lengths[key]

    def _with_prompt(self, text: str, params: PoolingParams) -> str:
        """Prepend the model's instruction prompt named by input_type (or its default prompt), a ColBERT model's
        too (PyLate puts the prompt before the text, then its query or document marker after [CLS])."""
        mc = self.model_config
        if params.input_type is None and mc.default_prompt is not None:
            return mc.default_prompt + text
        if not mc.prompts:
            return text
        name = params.input_type or mc.default_prompt_name
        return mc.prompts.get(name, "") + text if name else text

    def _token_prompt(
        self,
        i: int,
        prompt: Sequence[int],
        max_len: int,
        truncate: bool,
        side: TruncationSide = "right",
        over_windows: bool = False,
    ) -> tuple[list[int], None, int]:
        """`over_windows`: `max_len` is a windowed input's `max_window_tokens` (PromptError.over_windows)."""
        # numpy's integers are token ids too (vLLM takes them), as Python ints; bools are not
        ids = [int(t) if isinstance(t, numbers.Integral) and not isinstance(t, bool) else t for t in prompt]
        if not ids:
            raise PromptError(i, " has no tokens")
        vocab = self.id_rows
        bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            what = f"token id {bad} is out of vocabulary" if type(bad) is int else f"{bad!r:.40} is not a token id"
            # the usual cause: LangChain's OpenAIEmbeddings tokenizes with tiktoken and sends its ids
            hint = (
                "; ids of another tokenizer, such as tiktoken's? send the texts" if type(bad) is int and bad > 0 else ""
            )
            raise PromptError(i, f": {what} (token ids must be integers in 0..{vocab - 1}{hint})")
        num_input = len(ids)
        if num_input > max_len:
            if not truncate:
                error = _too_long(i, num_input, max_len)
                error.over_windows = over_windows
                raise error
            if side == "left":  # keep an opening special token ([CLS], <s>) and the last tokens
                head = 1 if ids[0] in self.special_ids and max_len > 1 else 0
                ids = ids[:head] + ids[num_input - max_len + head :]
            else:  # keep a closing special token ([SEP], </s>) as tokenizer truncation would
                ids = ids[: max_len - 1] + ids[-1:] if ids[-1] in self.special_ids and max_len > 1 else ids[:max_len]
        return ids, None, num_input


_SOME_TASKS_OPTIONS = ("dimensions", "normalize", "activation", "use_activation", *PoolingParams.SPARSE_OPTIONS)


def _fits(name: str, value: Any, task: str) -> bool:
    """Whether a pooling option applies to the task (in a request for several)."""
    if name in PoolingParams.SPARSE_OPTIONS:
        return task == "embed_sparse"
    if name in ("dimensions", "normalize"):
        return task in EMBED_TASKS
    if name == "activation":
        return task in ("classify", "token_classify")
    return not (value is False and task == "embed_sparse")  # use_activation: embed_sparse's is part of it


def skip_prompt(spec: PoolingSpec, skip: int) -> PoolingSpec:
    """A sequence task's spec that pools from token `skip` on (dense pooling only: SPLADE keeps every token)."""
    if not skip or spec.task not in ("embed", "classify"):
        return spec
    return dataclasses.replace(spec, skip_first=skip)


class PromptError(ValueError):
    """A bad prompt, with its position, so a caller can name it in its own terms (the server: a field's item);
    the message is `f"{subject} {index}{detail}"`."""

    def __init__(self, index: int, detail: str, subject: str = "prompt"):
        super().__init__(f"{subject} {index}{detail}")
        self.index, self.detail, self.subject = index, detail, subject
        self.num_tokens: int | None = None
        """For an over-long prompt: its tokens, and the most it may have (`max_len`)."""
        self.max_len: int | None = None
        self.advice = ""
        """The end of `detail` that says what to do (a server route offers its own body's options instead)."""
        self.over_windows = False
        """Over-long for `max_window_tokens`: an input to be split into windows, longer than they may hold."""

    def moved(self, offset: int) -> PromptError:
        """The same error for the prompt `offset` places further on (a part of a longer list)."""
        error = PromptError(self.index + offset, self.detail, self.subject)
        error.num_tokens, error.max_len, error.advice = self.num_tokens, self.max_len, self.advice
        error.over_windows = self.over_windows
        return error


def _too_long(index: int, num_tokens: int, max_len: int, at_least: bool = False) -> PromptError:
    has = f"at least {num_tokens}" if at_least else str(num_tokens)  # a huge text: what a part of it showed
    advice = (
        " (this model's maximum context length, max_model_len, or truncate_prompt_tokens when set); shorten it, "
        "pass truncate_prompt_tokens, run with truncation='auto', or split it with long_input='window'"
    )
    error = PromptError(index, f" has {has} tokens, more than the maximum input length of {max_len} tokens{advice}")
    error.num_tokens, error.max_len, error.advice = num_tokens, max_len, advice
    return error


def _check_unicode(i: int, prompt: str | tuple[str, str]) -> None:
    """A text must be encodable as UTF-8: a lone surrogate ("\\ud800", from a broken decode) is refused by name
    rather than failing inside the tokenizer without saying which prompt."""
    for text in (prompt,) if isinstance(prompt, str) else prompt:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise PromptError(
                i, f": character {e.start} is a lone surrogate ({text[e.start]!r}), not valid Unicode text"
            ) from None


def _image_kind(prompt: Any) -> str:
    if isinstance(prompt, str):
        return "a data:image URL"
    return "bytes" if isinstance(prompt, (bytes, bytearray)) else "a PIL image"


def _is_text_pair(prompt: Any) -> bool:
    return isinstance(prompt, tuple) and len(prompt) == 2 and all(isinstance(p, str) for p in prompt)


def _read_static_weights(path) -> torch.Tensor:
    """SparseStaticEmbedding's `weight` [vocab] (safetensors or a torch.save'd state dict), in float32."""
    if str(path).endswith(".safetensors"):
        from safetensors.torch import load_file

        state = load_file(str(path))
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    return state["weight"].float().flatten()
