"""Typed model arguments, read once from a checkpoint's `config.json` (gpt-fast's `ModelArgs` idea).

`from_hf` holds every default and fallback polyvec applies to a transformers config, so the trunks read
typed fields instead of `.get(key, default)` calls. Keys with no default are required (`KeyError` if absent).
Values are taken as transformers writes them; conversions (`int`, `bool`) are applied only where the trunks
always applied them, so a config that loads today loads the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EncoderArgs:
    """BERT, DistilBERT, RoBERTa, XLM-RoBERTa and MPNet."""

    hidden_size: int
    num_attention_heads: int
    num_hidden_layers: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-12
    type_vocab_size: int = 0
    """Segment (token type) vocabulary; 0: the model has no segment embeddings."""
    pad_token_id: int | None = 1
    """fairseq-style models (RoBERTa, MPNet) number positions from pad_token_id + 1."""
    relative_attention_num_buckets: int = 32
    """MPNet's relative position buckets."""

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> EncoderArgs:
        if config.get("model_type") == "distilbert":  # no segments; its LayerNorms' eps is fixed in transformers
            config = {
                **config,
                "type_vocab_size": 0,
                "layer_norm_eps": 1e-12,
                "pad_token_id": config.get("pad_token_id", 0),
            }
        kind = config.get("position_embedding_type", "absolute")
        if kind not in (None, "absolute"):  # relative_key(_query) attention terms: refused as vLLM refuses them
            raise ValueError(f"position_embedding_type {kind!r} is not supported; only 'absolute' is")
        if config.get("is_decoder"):  # transformers runs such a BERT causally
            raise ValueError("is_decoder: true (a causal BERT) is not supported; encoders attend both ways")
        pad = config.get("pad_token_id", 1)
        return cls(
            hidden_size=config["hidden_size"],
            num_attention_heads=config["num_attention_heads"],
            num_hidden_layers=config["num_hidden_layers"],
            intermediate_size=config["intermediate_size"],
            vocab_size=config["vocab_size"],
            max_position_embeddings=config["max_position_embeddings"],
            hidden_act=config.get("hidden_act", "gelu"),
            layer_norm_eps=config.get("layer_norm_eps", 1e-12),
            type_vocab_size=int(config.get("type_vocab_size", 0) or 0),
            # None only fails where it is used (RoBERTa, MPNet); BERT configs may leave it null.
            pad_token_id=None if pad is None else int(pad),
            relative_attention_num_buckets=int(config.get("relative_attention_num_buckets", 32)),
        )


@dataclass(frozen=True)
class DecoderArgs:
    """Llama, Mistral, Qwen2 and Qwen3."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    """Grouped-query attention; `num_attention_heads` when the config has none."""
    head_dim: int
    """Explicit in Qwen3 configs; otherwise hidden_size // num_attention_heads."""
    num_hidden_layers: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    attention_bias: bool = False
    """Biases on q/k/v and o (Qwen2 has q/k/v biases whatever this says)."""
    mlp_bias: bool = False
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None
    """transformers < 5 (e.g. Llama 3's {"rope_type": "llama3", "factor": 8.0, ...})."""
    rope_parameters: Mapping[str, Any] | None = None
    """transformers >= 5: rope_theta and the scaling in one dict; wins over the two above."""
    sliding_window: int | None = None
    """Attention window in tokens (None: none); the fields below say which layers use it."""
    layer_types: tuple[str, ...] | None = None
    """Per layer "sliding_attention" or "full_attention"; when given, it alone decides the windowed layers."""
    use_sliding_window: bool = False
    """Qwen2/Qwen3: the window applies only when this is set ..."""
    max_window_layers: int = 0
    """... and from this layer on."""
    model_type: str | None = None
    classifier_from_token_ids: tuple[int, ...] = ()
    """vLLM's `classifier_from_token` as vocabulary ids (the loader sets them): LM-head rows → classifier."""
    classifier_2_way: bool = False
    """vLLM's method "from_2_way_softmax" (Qwen3-Reranker, mxbai-rerank): one label, the LM-head row of the second
    token less that of the first (logit(yes) - logit(no), whose sigmoid is the softmax over the two)."""
    mrope_section: tuple[int, ...] | None = None
    """Qwen2-VL's multimodal rotary positions: how many of each head's d/2 frequencies turn with the temporal,
    height and width position (their sum is d/2); None: one position per token."""
    max_position_embeddings: int | None = None
    """The length trained on where a scaled rope's parameters give none; YaRN's factor over it, where none."""
    original_max_position_embeddings: int | None = None
    """Outside the rope parameters (Phi-3 writes it there): it overrides theirs, as in transformers."""
    query_pre_attn_scalar: float | None = None
    """Gemma 3: queries scaled by its inverse square root instead of head_dim's."""
    rope_local_base_freq: float | None = None
    """Gemma 3 (before transformers 5): the local (sliding) layers' rope base."""
    attn_logit_softcapping: float | None = None
    """Gemma 2's attention logit cap (Gemma 3 has none); refused where set."""
    is_causal: bool = True
    """False: every token attends to every token of its prompt (vLLM's `is_causal` config key, gte-Qwen2's):
    whole prompts, no KV cache."""

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> DecoderArgs:
        # transformers' MistralConfig windows 4096 tokens when its config leaves the key out (vLLM reads it so);
        # attending both ways (is_causal false) asks for the whole prompt
        mistral = config.get("model_type") == "mistral" and config.get("is_causal", True) is not False
        window = config.get("sliding_window", 4096 if mistral else None)
        layer_types = config.get("layer_types")
        gemma3 = str(config.get("model_type", "")).startswith("gemma3")
        if gemma3 and layer_types is None:  # older Gemma 3 configs: every `sliding_window_pattern`-th layer global
            pattern = int(config.get("sliding_window_pattern", 6))
            layer_types = [
                "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                for i in range(config["num_hidden_layers"])
            ]
        return cls(
            hidden_size=config["hidden_size"],
            num_attention_heads=config["num_attention_heads"],
            num_key_value_heads=int(config.get("num_key_value_heads") or config["num_attention_heads"]),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]),
            num_hidden_layers=config["num_hidden_layers"],
            intermediate_size=config["intermediate_size"],
            vocab_size=config["vocab_size"],
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            hidden_act=config.get("hidden_act") or config.get("hidden_activation") or "silu",  # Gemma's name
            attention_bias=bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
            rope_theta=config.get("rope_theta", 10000.0),
            rope_scaling=config.get("rope_scaling"),
            rope_parameters=config.get("rope_parameters"),
            sliding_window=int(window) if window else None,
            layer_types=None if layer_types is None else tuple(layer_types),
            use_sliding_window=bool(config.get("use_sliding_window", False)),
            max_window_layers=config.get("max_window_layers", 0),
            model_type=config.get("model_type"),
            classifier_from_token_ids=tuple(config.get("classifier_from_token_ids") or ()),
            classifier_2_way=bool(config.get("classifier_2_way", False)),
            mrope_section=_mrope_section(config),
            max_position_embeddings=config.get("max_position_embeddings"),
            original_max_position_embeddings=config.get("original_max_position_embeddings"),
            query_pre_attn_scalar=config.get("query_pre_attn_scalar"),
            rope_local_base_freq=config.get("rope_local_base_freq"),
            attn_logit_softcapping=config.get("attn_logit_softcapping"),
            # EmbeddingGemma's key for it
            is_causal=config.get("is_causal", True) is not False and not config.get("use_bidirectional_attention"),
        )


def _mrope_section(config: Mapping[str, Any]) -> tuple[int, ...] | None:
    for key in ("rope_parameters", "rope_scaling"):
        section = (config.get(key) or {}).get("mrope_section")
        if section:
            return tuple(int(s) for s in section)
    return None


@dataclass(frozen=True)
class ModernBertArgs:
    """ModernBERT (answerdotai's layout; transformers >= 5 writes `layer_types` and `rope_parameters`)."""

    hidden_size: int
    num_attention_heads: int
    num_hidden_layers: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int = 8192
    hidden_activation: str = "gelu"
    norm_eps: float = 1e-5
    norm_bias: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    layer_types: tuple[str, ...] = ()
    """Per layer "full_attention" or "sliding_attention"; older configs: every `global_attn_every_n_layers`-th
    layer (from 0) is global."""
    local_attention: int = 128
    """The local layers' whole window: a query sees keys at most local_attention // 2 positions away."""
    global_rope_theta: float = 160000.0
    local_rope_theta: float = 10000.0
    classifier_pooling: str = "cls"
    classifier_activation: str = "gelu"
    classifier_bias: bool = False
    decoder_bias: bool = True

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> ModernBertArgs:
        layers = int(config["num_hidden_layers"])
        every = int(config.get("global_attn_every_n_layers", 3))
        types = config.get("layer_types") or [
            "sliding_attention" if i % every else "full_attention" for i in range(layers)
        ]
        rope = config.get("rope_parameters") or {}
        thetas = {}
        for kind, key, default in (("full_attention", "global_rope_theta", 160000.0), ("sliding_attention",
                                   "local_rope_theta", 10000.0)):  # fmt: skip
            params = rope.get(kind) or {}
            if params.get("rope_type", "default") != "default":
                raise ValueError(f"ModernBERT rope_type {params['rope_type']!r} is not supported (only default)")
            thetas[kind] = float(params.get("rope_theta", config.get(key, default)))
        if config.get("hidden_activation", "gelu") != "gelu":
            raise ValueError(f"ModernBERT hidden_activation {config['hidden_activation']!r} is not supported")
        return cls(
            hidden_size=config["hidden_size"],
            num_attention_heads=config["num_attention_heads"],
            num_hidden_layers=layers,
            intermediate_size=config["intermediate_size"],
            vocab_size=config["vocab_size"],
            max_position_embeddings=int(config.get("max_position_embeddings", 8192)),
            norm_eps=float(config.get("norm_eps", 1e-5)),
            norm_bias=bool(config.get("norm_bias", False)),
            attention_bias=bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
            layer_types=tuple(types),
            local_attention=int(config.get("local_attention", 128)),
            global_rope_theta=thetas["full_attention"],
            local_rope_theta=thetas["sliding_attention"],
            classifier_pooling=str(config.get("classifier_pooling", "cls")),
            classifier_activation=str(config.get("classifier_activation", "gelu")),
            classifier_bias=bool(config.get("classifier_bias", False)),
            decoder_bias=bool(config.get("decoder_bias", True)),
        )


Args = EncoderArgs | DecoderArgs | ModernBertArgs
