"""One validated place for what a loaded model is and how the engine runs it.

`ModelConfig` is read from the checkpoint's files by `polyvec.loader` (HF `config.json` plus the
sentence-transformers layout); `PoolerConfig` is the user's override of what those files say, with vLLM's
field names; `EngineConfig` holds the batching and device knobs. Every value that was resolved from several
possible places records where it came from in `ModelConfig.sources`, so startup can log it.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import InitVar, asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from .layers.pooling_methods import SEQUENCE_METHODS, TOKEN_METHODS, PoolingTask
from .platforms.base import FLOAT16_UNSTABLE, KernelOptions, Platform

# Sequence pooling types produce one vector per request; token pooling types one per (selected) token
# (the registry of methods: layers/pooling_methods.py).
SEQ_POOLING_TYPES = tuple(SEQUENCE_METHODS)
TOKEN_POOLING_TYPES = tuple(TOKEN_METHODS)
POOLING_TYPES = SEQ_POOLING_TYPES + TOKEN_POOLING_TYPES

POOLING_TASKS = tuple(t.value for t in PoolingTask)
EMBED_TASKS = (PoolingTask.EMBED.value, PoolingTask.TOKEN_EMBED.value)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's other names

# EngineConfig's choices (checked in its __post_init__, for callers that pass plain strings).
Truncation = Literal["auto", "error"]
LongInput = Literal["truncate", "window"]
SchedulingPolicy = Literal["fcfs", "priority"]
Quantization = Literal["int8"]

# Activations a checkpoint may name (sentence-transformers `activation_fn` / Dense `activation_function`).
Activation = Literal["identity", "tanh", "relu", "gelu", "sigmoid", "softmax"]


_REMOVED = object()  # the default of a removed keyword argument: giving it at all is refused


@dataclass
class PoolerConfig:
    """Overrides of the pooling behaviour the checkpoint's files describe: vLLM 0.34's `PoolerConfig`
    (`LLM(pooler_config=...)`, `--pooler-config JSON`). Any field left as None keeps what the model's files say.
    """

    task: str | None = None
    """The task a request that names none gets (`/pooling`, `LLM.encode`): embed, classify, token_embed or
    token_classify; it must be one the model supports."""
    pooling_type: str | None = None
    """Shorthand for one of the two below: a sequence type sets `seq_pooling_type`, ALL / STEP `tok_pooling_type`."""
    seq_pooling_type: str | None = None
    """CLS, LAST, MEAN, MAX, MEAN_SQRT_LEN or WEIGHTED_MEAN: how embed and classify pool the tokens."""
    tok_pooling_type: str | None = None
    """ALL or STEP: which tokens token_embed and token_classify return."""
    use_activation: bool | None = None
    """Default for every request: normalize (embed tasks) or softmax/sigmoid (classify tasks)."""
    dimensions: int | None = None
    """Default Matryoshka output size for embed tasks."""
    enable_chunked_processing: bool | None = None
    """Inputs longer than max_model_len are split into windows and combined (polyvec's `long_input="window"`)
    instead of truncated."""
    max_embed_len: int | None = None
    """With chunked processing: the most tokens one input may have (longer ones are rejected)."""
    logit_mean: float | None = None
    """classify / token_classify: subtracted from the logits before the activation (Platt scaling:
    activation((logit - logit_mean) / logit_sigma)), with or without the activation, as vLLM does."""
    logit_sigma: float | None = None
    """classify / token_classify: the logits (less logit_mean) are divided by it; not 0."""
    step_tag_id: int | None = None
    """STEP pooling: only tokens with this id are returned (all tokens when None)."""
    returned_token_ids: list[int] | None = None
    """STEP pooling: only these output columns are returned."""
    enable_flash_late_interaction: bool | None = None
    """vLLM's choice of a Triton MaxSim kernel: accepted, no effect (MaxSim here is the reference's)."""
    normalize: InitVar[object] = _REMOVED
    """Removed in vLLM: refused with a pointer to `use_activation`, as vLLM refuses it (not a field)."""

    def __post_init__(self, normalize: object = _REMOVED) -> None:
        if normalize is not _REMOVED:
            raise ValueError("Parameter `normalize` was removed; use `use_activation` instead.")
        if self.task is not None and self.task not in POOLING_TASKS:
            removed = {"score": "classify", "encode": "token_embed or token_classify"}
            if self.task in removed:
                raise ValueError(f"`{self.task}` task was removed; use {removed[self.task]} instead.")
            raise ValueError(f"task={self.task!r} is not valid; allowed: {', '.join(POOLING_TASKS)}")
        for name, allowed in (
            ("pooling_type", POOLING_TYPES),
            ("seq_pooling_type", SEQ_POOLING_TYPES),
            ("tok_pooling_type", TOKEN_POOLING_TYPES),
        ):
            value = getattr(self, name)
            if value is not None:
                value = str(value).upper()
                if value not in allowed:
                    raise ValueError(f"{name}={value!r} is not valid; allowed: {', '.join(allowed)}")
                setattr(self, name, value)
        if self.pooling_type is not None:
            target = "seq_pooling_type" if self.pooling_type in SEQ_POOLING_TYPES else "tok_pooling_type"
            if getattr(self, target) not in (None, self.pooling_type):
                raise ValueError(f"Cannot set both `pooling_type` and `{target}`")
            setattr(self, target, self.pooling_type)
        for name in ("dimensions", "max_embed_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("logit_mean", "logit_sigma"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            ):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.logit_sigma is not None and self.logit_sigma == 0:
            raise ValueError("logit_sigma cannot be 0 (division by zero)")

    def to_dict(self) -> dict[str, Any]:
        """The fields set (JSON, as `from_dict` reads them)."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> PoolerConfig:
        """From JSON (`--pooler-config`), refusing unknown keys by name, as vLLM does."""
        if not isinstance(values, dict):
            raise ValueError(f"the pooler config must be a JSON object, got {values!r}")
        if "normalize" in values:
            raise ValueError("Parameter `normalize` was removed; use `use_activation` instead.")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown pooler config field(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**values)


@dataclass(frozen=True)
class SpladeSpec:
    """How a masked-LM checkpoint's logits become a sparse vector (sentence-transformers' `SpladePooling`):
    activation(logits) then `pooling` over the input's tokens; activation is log(1 + relu(x)), or for
    "log1p_relu" log(1 + log(1 + relu(x)))."""

    pooling: Literal["max", "sum"] = "max"
    activation: Literal["relu", "log1p_relu"] = "relu"
    query_weights: Path | None = None
    """Inference-free SPLADE (a sentence-transformers Router whose query route is a `SparseStaticEmbedding`):
    its weights file; a query's sparse vector is then weight[id] for each distinct token id of the query,
    tokenized without special tokens, and no forward pass runs."""


@dataclass(frozen=True)
class ColQwen2Spec:
    """A ColVision checkpoint's image side: the vision config, the placeholder token, the processor's image rule
    and its prompts. `family` "qwen2_vl" (ColQwen2, ColQwen2.5; colpali-engine's ColQwen2Processor: dynamic
    resolution within min/max_pixels) or "paligemma" (ColPali; ColPaliProcessor: every image resized to
    image_size², one placeholder per patch, bidirectional attention, texts tokenized without added tokens)."""

    vision_config: dict[str, Any]
    image_token_id: int
    min_pixels: int = 4 * 28 * 28
    max_pixels: int = 768 * 28 * 28
    family: Literal["qwen2_vl", "paligemma"] = "qwen2_vl"
    image_size: int = 448  # paligemma: the square every image is resized to
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)  # paligemma (Qwen2-VL's are CLIP's)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    visual_prompt: str = (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe the image.<|im_end|><|endoftext|>"
    )
    query_prefix: str = "Query: "
    query_suffix: str = "<|endoftext|>" * 10  # query augmentation tokens
    image_pad: str = "<|image_pad|>"
    # transparent pixels on white (transformers' convert_to_rgb, for its *ForRetrieval layouts), or the colour they
    # hide kept (colpali-engine's image.convert("RGB"), for its own layouts)
    transparent_on_white: bool = True


@dataclass(frozen=True)
class ScoreTemplate:
    """The chat template a sentence-transformers CrossEncoder's config names (`sentence_bert_config.json`
    `processing_kwargs.chat_template`) and the variables saved with it; `template` None: the checkpoint lacks it."""

    name: str
    template: str | None
    variables: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LoraSpec:
    """A PEFT LoRA adapter (`path`) on the checkpoint `base_model`, merged into its weights at load time
    (models/lora.py)."""

    path: Path
    base_model: str
    r: int
    alpha: float
    use_rslora: bool = False
    alpha_pattern: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class BgeM3Spec:
    """bge-m3's two extra heads beside its XLM-RoBERTa trunk (FlagEmbedding's layout): multi-vector =
    normalize(colbert_linear(h)) of every token but the first; sparse = relu(sparse_linear(h)) per token, special
    tokens dropped, the largest weight kept per vocabulary id."""

    colbert_path: Path
    sparse_path: Path


@dataclass(frozen=True)
class DenseSpec:
    """A sentence-transformers (or PyLate) `Dense` module: `activation(linear(x))`."""

    path: Path
    in_features: int
    out_features: int
    bias: bool
    activation: str  # "identity", "tanh", "relu", "gelu", "sigmoid"
    use_residual: bool = False
    on_tokens: bool = False
    """Applied to every token embedding (PyLate / multi-vector layouts) rather than to the pooled vector."""


@dataclass(frozen=True)
class ColBERTConfig:
    """The query/document encoding recipe of a late-interaction (ColBERT) checkpoint.

    PyLate keeps it in config_sentence_transformers.json; Stanford ColBERT in artifact.metadata. Both insert
    a marker token after [CLS], truncate to the mode's length, pad queries with [MASK] to the query length
    (expansion), and drop skiplist (punctuation) tokens from document outputs.
    """

    layout: Literal["pylate", "stanford", "vllm", "colqwen2"]
    """vllm: vLLM's ColBERTModel / ColBERTModernBertModel checkpoints, a trunk and its `linear` projection and no
    recipe: every token of the text as it is, no markers, expansion or skiplist, for queries and documents."""
    query_prefix: str
    """Marker token inserted after [CLS] in query mode ("[Q] " in PyLate, "[unused0]" in Stanford ColBERT)."""
    document_prefix: str
    query_length: int
    document_length: int
    do_query_expansion: bool = True
    attend_to_expansion_tokens: bool = False
    skiplist_words: tuple[str, ...] = ()
    dim: int | None = None
    """Projection size when the projection lives in the main checkpoint (Stanford `linear.weight`)."""


@dataclass
class ModelConfig:
    """What the checkpoint is: architecture, limits, tokenizer and pooling recipe."""

    model: str
    path: Path
    hf_config: dict[str, Any]
    architecture: str
    dtype: torch.dtype
    max_model_len: int
    max_position_len: int
    tokenizer_path: Path
    transformer_dir: Path
    """Folder of the transformer's config.json and weights (the model folder, or its ST subfolder)."""
    do_lower_case: bool = False
    # Sentence-transformers pipeline: pooling modes (in ST's concatenation order), Dense stack.
    st_pooling: tuple[str, ...] | None = None
    dense: tuple[DenseSpec, ...] = ()
    # Matryoshka: an explicit list of trained sizes, or any size up to the embedding size.
    matryoshka_dimensions: tuple[int, ...] | None = None
    is_matryoshka: bool = False
    truncate_dim: int | None = None
    """config_sentence_transformers.json's truncate_dim: the default `dimensions` of embed (not of token_embed,
    as sentence-transformers cuts sentence embeddings only)."""
    # Classification heads.
    num_labels: int = 0
    id2label: dict[int, str] = field(default_factory=dict)
    classifier_activation: Activation = "softmax"
    """softmax, sigmoid or identity unless the checkpoint names another (sentence-transformers `activation_fn`)."""
    pooler_config: PoolerConfig = field(default_factory=PoolerConfig)
    colbert: ColBERTConfig | None = None
    bge_m3: BgeM3Spec | None = None
    """colbert_linear.pt and sparse_linear.pt beside the trunk: token_embed and embed_sparse from those heads."""
    colqwen2: ColQwen2Spec | None = None
    """ColQwen2, ColQwen2.5 and ColPali: images in (multimodal/image.py), token vectors out; `architecture` is
    "ColQwen2" or "ColPali"."""
    lora: LoraSpec | None = None
    """A LoRA adapter the model was loaded from: `path` is then its base model's folder."""
    splade: SpladeSpec = field(default_factory=SpladeSpec)
    """embed_sparse of masked-LM checkpoints (SPLADE): the modules.json SpladePooling, else max + relu."""
    splade_embed: tuple[int | None, int | None] | None = None
    """vLLM's BertSpladeSparseEmbeddingModel: embed is the SPLADE vector over the vocabulary (max pooling), a
    leading token with config.json's cls_token_id and a trailing one with its sep_token_id left out."""
    is_causal: bool = False
    """A decoder (causal attention): chunked prefill, KV cache, prefix caching."""
    prompts: dict[str, str] = field(default_factory=dict)
    """Instruction prompts by name (config_sentence_transformers.json), prepended to text prompts whose
    input_type (query / document) names one."""
    default_prompt_name: str | None = None
    default_prompt: str | None = None
    """A prompt text put before text inputs that name no input_type, in place of default_prompt_name's (TEI's
    `--default-prompt`)."""
    score_template: ScoreTemplate | None = None
    """A sentence-transformers CrossEncoder that scores pairs as "query" / "document" messages through a chat
    template (used where no chat template is given, as vLLM does)."""
    pool_prompt: bool = True
    """False (the Pooling module's `include_prompt: false`): embed and classify pool only the tokens after the
    instruction prompt, as sentence-transformers does."""
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def hidden_size(self) -> int:
        return int(self.hf_config["hidden_size"])

    @property
    def model_type(self) -> str:
        return str(self.hf_config.get("model_type", ""))

    @property
    def embedding_size(self) -> int:
        """vLLM's name for the width of an embed output (the upper bound of `dimensions`)."""
        return self.embed_dim

    @property
    def embed_dim(self) -> int:
        """Size of the pooled embedding after the Dense stack and the concatenation of pooling modes."""
        if self.splade_embed is not None:
            return int(self.hf_config["vocab_size"])
        pooled = [d for d in self.dense if not d.on_tokens]
        if pooled:
            return pooled[-1].out_features
        return self.hidden_size * len(self.st_pooling or ("MEAN",))

    @property
    def token_dim(self) -> int:
        """Size of each per-token vector (after token-level Dense layers, e.g. ColBERT's projection)."""
        on_tokens = [d for d in self.dense if d.on_tokens]
        if on_tokens:
            return on_tokens[-1].out_features
        return self.colbert.dim if self.colbert is not None and self.colbert.dim else self.hidden_size


_INTEGER_FIELDS = (
    "max_num_batched_tokens",
    "max_num_seqs",
    "prefix_cache_tokens",
    "kv_cache_memory_bytes",
    "num_threads",
    "max_images_per_prompt",
    "max_image_pixels",
    "max_request_image_pixels",
)


@dataclass
class EngineConfig:
    """How requests are batched and where the model runs."""

    max_num_batched_tokens: int = 16384
    """Token budget of one forward pass (real tokens, no padding)."""
    max_num_seqs: int = 256
    """Most sequences in one forward pass."""
    device: str = "auto"
    """auto (CUDA when available, else CPU), cpu, cuda or cuda:N."""
    truncation: Truncation = "auto"
    """auto: input longer than max_model_len is cut to it (as sentence-transformers does); error: rejected."""
    num_threads: int | None = None
    """CPU threads for torch (None: torch's default, one per core)."""
    long_input: LongInput = "truncate"
    """Encoder input longer than max_model_len: truncate (or reject, with truncation="error"), or split into
    windows; requests may override it (PoolingParams.long_input)."""
    window_overlap: int = 0
    """Default tokens shared by consecutive windows (long_input="window")."""
    kv_cache_memory_bytes: int | None = None
    """Causal models: memory for the KV caches of requests being prefilled (default 4 GiB, and at least one
    max_model_len request plus a full batch). Requests wait when it is full."""
    scheduling_policy: SchedulingPolicy = "fcfs"
    """vLLM's: fcfs serves waiting requests in arrival order; priority by their `priority` (lower first), then
    arrival. Requests already started keep going either way."""
    enable_prefix_caching: bool | None = None
    """Causal models: reuse the keys/values of prompt prefixes already computed (None: on)."""
    prefix_cache_tokens: int = 8192
    """Most prompt tokens the prefix cache keeps (least recently used blocks are evicted)."""
    quantization: Quantization | None = None
    """None: projections in the model dtype. "int8" (CPU only, opt-in): dynamic W8A8, weights int8 per output
    channel and activations quantized per token at run time, on oneDNN's int8 matmul (VNNI / AMX); attention
    and norms stay in the model dtype, pooling and heads in float32. Faster, not exact: close to float32, by
    how much depending on the model (the README's int8 section)."""
    kernels: KernelOptions = field(default_factory=KernelOptions.from_env)
    """Which of polyvec's native CPU paths may run (native kernels, oneDNN projections, AMX); default: all,
    less those POLYVEC_DISABLE_KERNELS / _ONEDNN / _AMX=1 turn off."""
    max_images_per_prompt: int | None = None
    """Most images in one prompt (vLLM's limit_mm_per_prompt={"image": N}); None: as many as its tokens allow."""
    max_image_pixels: int = 50_000_000
    """Largest decoded image (width × height) accepted; larger ones are refused before they are decoded."""
    max_request_image_pixels: int | None = None
    """Most decoded image pixels in one call of `process` (one HTTP request); None: no limit (offline)."""
    allowed_media_domains: tuple[str, ...] = ()
    """Hosts (and their subdomains) whose http(s) image URLs are fetched; none by default."""

    def __post_init__(self) -> None:
        for name in _INTEGER_FIELDS:  # "4" or 4.0 would fail later, in a comparison that names nothing
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.long_input not in ("truncate", "window"):
            raise ValueError(f"long_input must be 'truncate' or 'window', got {self.long_input!r}")
        overlap = self.window_overlap
        if isinstance(overlap, bool) or not isinstance(overlap, int) or overlap < 0:
            raise ValueError(f"window_overlap must be an integer >= 0, got {overlap!r}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be >= 1, got {self.kv_cache_memory_bytes}")
        if self.prefix_cache_tokens < 0:
            raise ValueError(f"prefix_cache_tokens must be >= 0, got {self.prefix_cache_tokens}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.truncation not in ("auto", "error"):
            raise ValueError(f"truncation must be 'auto' or 'error', got {self.truncation!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.quantization not in (None, "int8"):
            raise ValueError(f"quantization must be None or 'int8', got {self.quantization!r}")
        if self.max_images_per_prompt is not None and self.max_images_per_prompt < 0:
            raise ValueError(f"max_images_per_prompt must be >= 0, got {self.max_images_per_prompt}")
        for name in ("max_image_pixels", "max_request_image_pixels"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            dev = torch.device(self.device)
        except (RuntimeError, TypeError):  # torch's words for a string it cannot read ("gpu", "cuda:x")
            dev = None
        if dev is None or dev.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for but torch sees no CUDA device")
        if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={self.device!r}: torch sees {torch.cuda.device_count()} CUDA device(s)")
        return dev


def checkpoint_dtype(hf_config: dict[str, Any]) -> str | None:
    """The dtype config.json says the weights were saved in (`dtype` in transformers 5, `torch_dtype` before)."""
    for cfg in (hf_config, hf_config.get("text_config") or {}):
        value = cfg.get("dtype") or cfg.get("torch_dtype")
        if isinstance(value, str):
            return value
    return None


def resolve_dtype(dtype: str | torch.dtype, platform: Platform, hf_config: dict[str, Any] | None = None) -> torch.dtype:
    """`auto`: the platform's default for the checkpoint (on CUDA vLLM's rule: float16, bfloat16 checkpoints in
    bfloat16 on GPUs that compute it; on CPU bfloat16 where matmuls run it natively, else float32). Pooling
    and heads always run in float32."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype}")
        platform.check_dtype(dtype)
        return dtype
    if dtype == "auto":
        cfg = hf_config or {}
        return platform.default_dtype(checkpoint_dtype(cfg), cfg.get("model_type"))
    dtype = DTYPE_ALIASES.get(dtype, dtype)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {dtype!r}")
    model_type = (hf_config or {}).get("model_type")
    if DTYPES[dtype] == torch.float16 and model_type in FLOAT16_UNSTABLE:  # vLLM's words
        raise ValueError(
            f"The model type {model_type!r} does not support float16. Reason: Numerical instability. "
            "Please use bfloat16 or float32 instead."
        )
    platform.check_dtype(DTYPES[dtype])
    return DTYPES[dtype]
