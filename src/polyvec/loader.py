"""Read a checkpoint's configuration files and its weights (`polyvec.resolve` finds or downloads it).

Files read: `config.json`; `model.safetensors` (or its sharded index) or `pytorch_model.bin`; `tokenizer.json`
(or `vocab.txt`); and the sentence-transformers layout (`modules.json`, the Pooling module's `config.json`,
Dense modules, Normalize, `sentence_bert_config.json`). See
https://sbert.net/docs/sentence_transformer/usage/custom_models.html for that layout.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import string
from pathlib import Path
from typing import Any

import torch

from .chat import find_template
from .config import (
    Activation,
    BgeM3Spec,
    ColBERTConfig,
    ColQwen2Spec,
    DenseSpec,
    ModelConfig,
    PoolerConfig,
    ScoreTemplate,
    SpladeSpec,
)
from .models.lora import ADAPTER_CONFIG, has_embedded_adapter, is_adapter, read_adapter_config
from .multimodal.image import CLIP_MEAN, CLIP_STD
from .resolve import DEFAULT_MODEL, PACKAGED_MODELS, ModelNotFoundError, resolve_model_path

__all__ = [
    "DEFAULT_MODEL",
    "PACKAGED_MODELS",
    "ModelNotFoundError",
    "load_model_config",
    "resolve_model_path",
]

logger = logging.getLogger(__name__)

# sentence-transformers Pooling modes → polyvec pooling types (ST concatenates them in this order).
ST_POOLING_MODES = {
    "cls": "CLS",
    "max": "MAX",
    "mean": "MEAN",
    "mean_sqrt_len_tokens": "MEAN_SQRT_LEN",
    "weightedmean": "WEIGHTED_MEAN",
    "lasttoken": "LAST",
}
_ST_LEGACY_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
_ACTIVATIONS: dict[str, Activation] = {
    "identity": "identity",
    "tanh": "tanh",
    "relu": "relu",
    "gelu": "gelu",
    "sigmoid": "sigmoid",
    "softmax": "softmax",
}
# A Transformer module's settings (max_seq_length, do_lower_case): the first of these files, as sentence-transformers
# and vLLM look for them (checkpoints from before sentence_bert_config.json name their model type).
ST_TRANSFORMER_CONFIGS = tuple(
    f"sentence_{name}_config.json"
    for name in ("bert", "roberta", "distilbert", "camembert", "albert", "xlm-roberta", "xlnet")
)
# Encoders whose positions start after the padding index (fairseq convention).
_PADDING_OFFSET_POSITIONS = ("roberta", "xlm-roberta", "mpnet", "camembert")


# ----------------------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------------------


def _read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _dense_activation(cfg: dict[str, Any], where: Path) -> Activation:
    """A Dense module's activation as sentence-transformers loads it: Tanh when its config names none (Dense's
    default), and Tanh too, with a warning, for a path outside torch, which it does not import."""
    if "activation_function" not in cfg:
        return "tanh"
    qualname = cfg["activation_function"]
    if qualname and not str(qualname).startswith("torch."):
        logger.warning("%s: activation_function %r is not torch's; Tanh, as sentence-transformers falls back to",
                       where, qualname)  # fmt: skip
        return "tanh"
    return _activation_name(qualname)


def _activation_name(qualname: str | None) -> Activation:
    if not qualname:
        return "identity"
    name = qualname.rsplit(".", 1)[-1].lower()
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported activation function {qualname!r}; supported: {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def _st_pooling_modes(cfg: dict[str, Any]) -> tuple[str, ...]:
    modes = cfg.get("pooling_mode")
    if modes is None:
        modes = [mode for key, mode in _ST_LEGACY_KEYS.items() if cfg.get(key)]
    elif isinstance(modes, str):
        modes = [modes]
    if not modes:
        raise ValueError(f"sentence-transformers Pooling config selects no pooling mode: {cfg}")
    unknown = [m for m in modes if m not in ST_POOLING_MODES]
    if unknown:
        raise ValueError(f"unknown sentence-transformers pooling mode(s) {unknown}; known: {list(ST_POOLING_MODES)}")
    return tuple(ST_POOLING_MODES[m] for m in modes)


def _read_sentence_transformers(root: Path) -> dict[str, Any]:
    """Walk modules.json; return the transformer folder, pooling modes, Dense specs and Normalize."""
    out: dict[str, Any] = {
        "transformer_dir": root,
        "pooling": None,
        "include_prompt": True,
        "dense": [],
        "normalize": False,
        "splade": None,
    }
    modules_file = root / "modules.json"
    if modules_file.is_file():
        _read_modules(root, _read_json(modules_file), out)
    return out


_ST_MODULES = ("Transformer", "MLMTransformer", "Pooling", "Dense", "Normalize", "SpladePooling", "Router", "Dropout")
"""sentence-transformers modules read (Dropout does nothing at inference); any other is refused by name."""


def _read_modules(root: Path, modules: list[dict[str, Any]], out: dict[str, Any]) -> None:
    token_dense_first: Path | None = None  # a Dense over token vectors before any Pooling
    for k, module in enumerate(modules):
        kind = module.get("type", "").rsplit(".", 1)[-1]
        folder = root / module.get("path", "")
        own = "." in module.get("type", "") and not module["type"].startswith(("sentence_transformers.", "pylate."))
        if kind not in _ST_MODULES or own:  # skipped, or run as the built-in, it would change every vector unseen
            why = "code of its own, not sentence-transformers'" if own and kind in _ST_MODULES else "not supported"
            raise ValueError(
                f"{root / 'modules.json'}: module {k} ({module.get('type')}, {module.get('path')}) is {why}; "
                f"supported: {', '.join(_ST_MODULES)}"
            )
        if out["normalize"] and kind != "Dropout":  # sentence-transformers runs modules in order
            raise ValueError(f"{root / 'modules.json'}: a Normalize module before {kind} (module {k}) is not supported")
        if kind == "Transformer" or kind == "MLMTransformer":
            if (folder / "config.json").is_file():
                out["transformer_dir"] = folder
        elif kind == "Pooling":
            if token_dense_first is not None:  # embed would leave it out
                raise ValueError(f"{token_dense_first}: a Dense over token embeddings before Pooling is not supported")
            cfg = _read_json(folder / "config.json")
            out["pooling"] = _st_pooling_modes(cfg)
            out["include_prompt"] = cfg.get("include_prompt", True) is not False
        elif kind == "Dense":
            cfg = _read_json(folder / "config.json")
            pylate = module.get("type", "").startswith("pylate")
            on_tokens = pylate or cfg.get("module_input_name") == "token_embeddings"
            if on_tokens and not pylate and out["pooling"] is None:
                token_dense_first = folder
            if cfg.get("module_output_name", "sentence_embedding") != "sentence_embedding" and not on_tokens:
                # sentence-transformers writes it elsewhere: the sentence embedding is left as it was
                raise ValueError(f"{folder}: a Dense writing {cfg['module_output_name']!r} is not supported")
            out["dense"].append(
                DenseSpec(
                    path=folder,
                    in_features=int(cfg["in_features"]),
                    out_features=int(cfg["out_features"]),
                    bias=bool(cfg.get("bias", True)),
                    activation=_dense_activation(cfg, folder / "config.json"),
                    use_residual=bool(cfg.get("use_residual", False)),
                    on_tokens=on_tokens,
                )
            )
        elif kind == "Normalize":
            out["normalize"] = True
        elif kind == "SpladePooling":
            cfg = _read_json(folder / "config.json") if (folder / "config.json").is_file() else {}
            strategy, act = cfg.get("pooling_strategy", "max"), cfg.get("activation_function", "relu")
            if strategy not in ("max", "sum") or act not in ("relu", "log1p_relu"):
                raise ValueError(f"{folder}: SpladePooling {strategy!r} / {act!r} is not supported")
            out["splade"] = SpladeSpec(strategy, act)
        elif kind == "Router":
            _read_router(folder, out)


def _read_router(folder: Path, out: dict[str, Any]) -> None:
    """sentence-transformers' Router (router_config.json): the document route is the model; a query route that
    is one `SparseStaticEmbedding` makes it inference-free SPLADE (SpladeSpec.query_weights)."""
    cfg = _read_json(folder / "router_config.json")
    types, routes = cfg.get("types", {}), cfg.get("structure", {})
    default = (cfg.get("parameters") or {}).get("default_route") or "document"
    if default not in routes:
        raise ValueError(f"{folder}: Router has no {default!r} route; routes: {', '.join(routes)}")

    def modules(route: str) -> list[dict[str, Any]]:
        return [{"type": types.get(key, ""), "path": key} for key in routes[route]]

    _read_modules(folder, modules(default), out)
    query = routes.get("query")
    if query is None or query == routes[default]:
        return
    kinds = [m["type"].rsplit(".", 1)[-1] for m in modules("query")]
    if kinds != ["SparseStaticEmbedding"] or out["splade"] is None:
        raise ValueError(
            f"{folder}: a Router whose query route is {kinds} beside the {default!r} route is not supported "
            "(supported: inference-free SPLADE, a SparseStaticEmbedding query route beside MLMTransformer + "
            "SpladePooling)"
        )
    static = folder / query[0]
    weights = next((static / n for n in ("model.safetensors", "pytorch_model.bin") if (static / n).is_file()), None)
    if weights is None:
        raise ValueError(f"{static}: SparseStaticEmbedding without model.safetensors or pytorch_model.bin")
    out["splade"] = dataclasses.replace(out["splade"], query_weights=weights)


def _read_bge_m3(root: Path) -> BgeM3Spec | None:
    colbert, sparse = root / "colbert_linear.pt", root / "sparse_linear.pt"
    return BgeM3Spec(colbert, sparse) if colbert.is_file() and sparse.is_file() else None


def _saved_score_template(root: Path, tokenizer_dir: Path) -> ScoreTemplate | None:
    """A sentence-transformers (6+) CrossEncoder whose one Transformer module reads `message` inputs: it scores a
    pair as messages of roles "query" and "document" through the tokenizer's chat template (the saved
    processing_kwargs name which, and its variables), as vLLM 0.34 reads the same files."""
    files = [root / n for n in ("config_sentence_transformers.json", "modules.json", "sentence_bert_config.json")]
    if not all(f.is_file() for f in files):
        return None
    st_model, modules, transformer = (_read_json(f) for f in files)
    modules = modules.get("modules") if isinstance(modules, dict) else modules
    modality = transformer.get("modality_config") if isinstance(transformer, dict) else None
    if not (
        isinstance(st_model, dict)
        and st_model.get("model_type") == "CrossEncoder"
        and isinstance(modules, list)
        and len(modules) == 1
        and isinstance(modules[0], dict)
        and str(modules[0].get("type", "")).rsplit(".", 1)[-1] == "Transformer"
        and not modules[0].get("path")
        and transformer.get("transformer_task") == "sequence-classification"
        and isinstance(modality, dict)
        and "message" in modality
    ):
        return None
    where = root / "sentence_bert_config.json"
    kwargs = (transformer.get("processing_kwargs") or {}).get("chat_template") or {}
    if not isinstance(kwargs, dict):
        raise ValueError(f"{where}: processing_kwargs.chat_template must be a JSON object")
    kwargs = {k: v for k, v in kwargs.items() if k != "restore_suffix"}  # the document is cut to fit (scoring)
    name = kwargs.pop("chat_template", None)
    if name is not None and not isinstance(name, str):
        raise ValueError(f"{where}: the chat template's name must be a string, got {name!r}")
    if reserved := sorted({"tokenize", "tools"} & kwargs.keys()):
        raise ValueError(f"{where}: chat template settings not supported: {', '.join(reserved)}")
    # none found: scoring is refused unless a chat template is given (vLLM's), other tasks run
    return ScoreTemplate(name or "default", find_template(root, tokenizer_dir, name=name), kwargs)


def tokenizer_max_length(folder: Path) -> int | None:
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return None
    value = _read_json(path).get("model_max_length")
    # transformers writes a huge sentinel (int(1e30)) when the tokenizer sets no limit.
    return int(value) if isinstance(value, (int, float)) and 0 < value < 1_000_000 else None


# transformers' ColQwen2ForRetrieval and colpali-engine's ColQwen2 / ColQwen2_5 (its config.json names the
# class); ColQwen2.5 differs only in its vision tower, told apart by its config (models/qwen2_vl_vision.py).
COLQWEN2 = ("ColQwen2ForRetrieval", "ColQwen2", "ColQwen2_5")


def _read_colqwen2(root: Path, hf_config: dict[str, Any]) -> tuple[dict[str, Any], ColQwen2Spec]:
    """The language model's config flattened to the top level (as a decoder's), the vision side in the spec;
    the processor's pixel budget from preprocessor_config.json when it has one."""
    vlm = hf_config.get("vlm_config") or hf_config
    text = vlm.get("text_config") or vlm
    flat = {**text, "architectures": ["ColQwen2"], "model_type": "qwen2_vl"}
    flat["embedding_dim"] = int(hf_config.get("embedding_dim", 128))
    pre = root / "preprocessor_config.json"
    cfg = _read_json(pre) if pre.is_file() else {}
    size = cfg.get("size") or {}
    proc = _read_json(root / "processor_config.json") if (root / "processor_config.json").is_file() else {}
    default = ColQwen2Spec(vision_config={}, image_token_id=0)
    # transformers' ColQwen2Processor ends a query with "\n" after the augmentation tokens; colpali-engine's not
    newline = "\n" if (hf_config.get("architectures") or [""])[0] == "ColQwen2ForRetrieval" else ""
    spec = ColQwen2Spec(
        vision_config=dict(vlm["vision_config"]),
        image_token_id=int(vlm.get("image_token_id", 151655)),
        min_pixels=int(cfg.get("min_pixels") or size.get("shortest_edge") or 4 * 28 * 28),
        max_pixels=int(cfg.get("max_pixels") or size.get("longest_edge") or 768 * 28 * 28),
        image_mean=tuple(cfg.get("image_mean") or CLIP_MEAN),
        image_std=tuple(cfg.get("image_std") or CLIP_STD),
        visual_prompt=proc.get("visual_prompt_prefix") or default.visual_prompt,
        query_prefix=proc.get("query_prefix") or default.query_prefix,
        query_suffix=default.query_suffix + newline,
        transparent_on_white=bool(newline),
    )
    return flat, spec


# transformers' ColPaliForRetrieval and colpali-engine's ColPali (PaliGemma: SigLIP + Gemma).
COLPALI = ("ColPaliForRetrieval", "ColPali")
# GemmaConfig's defaults, which PaliGemma configs on the hub leave out of their text_config.
GEMMA_DEFAULTS = {
    "hidden_act": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "head_dim": 256,
    "max_position_embeddings": 8192,
}


def _read_colpali(root: Path, hf_config: dict[str, Any]) -> tuple[dict[str, Any], ColQwen2Spec]:
    """PaliGemma's Gemma config flattened to the top level, SigLIP's in the spec; the processor's image size,
    mean and std from preprocessor_config.json; prompts as colpali-engine's ColPaliProcessor writes them."""
    vlm = hf_config.get("vlm_config") or hf_config
    text = {**GEMMA_DEFAULTS, **(vlm.get("text_config") or {})}
    if "hidden_activation" in text and "hidden_act" not in (vlm.get("text_config") or {}):
        text["hidden_act"] = text["hidden_activation"]
    flat = {**text, "architectures": ["ColPali"], "model_type": "gemma"}
    flat["embedding_dim"] = int(hf_config.get("embedding_dim", 128))
    vision = dict(vlm.get("vision_config") or {})
    pre = root / "preprocessor_config.json"
    cfg = _read_json(pre) if pre.is_file() else {}
    size = int((cfg.get("size") or {}).get("height") or vision.get("image_size", 224))
    patch = int(vision.get("patch_size", 14))
    tokens = (size // patch) ** 2
    if cfg.get("image_seq_length") not in (None, tokens):
        raise ValueError(f"{pre}: image_seq_length {cfg['image_seq_length']} is not ({size} / {patch})² = {tokens}")
    image_token = int(vlm.get("image_token_id", vlm.get("image_token_index", 257152)))
    spec = ColQwen2Spec(
        vision_config=vision,
        image_token_id=image_token,
        min_pixels=size * size,
        max_pixels=size * size,
        family="paligemma",
        image_size=size,
        image_mean=tuple(cfg.get("image_mean") or (0.5, 0.5, 0.5)),
        image_std=tuple(cfg.get("image_std") or (0.5, 0.5, 0.5)),
        visual_prompt="<image><bos>Describe the image.\n",
        query_prefix="<bos>Question: ",
        query_suffix="<pad>" * 10 + "\n",  # the query augmentation tokens, then PaliGemma's separator
        image_pad="<image>",
        transparent_on_white=(hf_config.get("architectures") or [""])[0] == "ColPaliForRetrieval",
    )
    return flat, spec


# vLLM's ColBERT architectures → the trunk they put the `linear` projection on.
VLLM_COLBERT = {"ColBERTModel": "BertModel", "ColBERTModernBertModel": "ModernBertModel"}
VLLM_SPLADE = "BertSpladeSparseEmbeddingModel"


def _token_id(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _read_colbert(root: Path, tdir: Path, st: dict[str, Any], hf_config: dict[str, Any]) -> ColBERTConfig | None:
    """PyLate: a token-level Dense in modules.json + prefixes in config_sentence_transformers.json.
    Stanford ColBERT: architecture HF_ColBERT + artifact.metadata. vLLM: ColBERTModel / ColBERTModernBertModel."""
    if hf_config.get("architectures", [""])[0] in ("ColQwen2", "ColPali"):  # flattened by _read_colqwen2/colpali
        return ColBERTConfig("colqwen2", "", "", 0, 0, do_query_expansion=False, dim=int(hf_config["embedding_dim"]))
    if hf_config.get("architectures", [""])[0] in VLLM_COLBERT:
        # the size is the projection's, read with its weights where config.json does not say it (as in vLLM)
        dim = hf_config.get("colbert_dim") or hf_config.get("dim") or hf_config.get("projection_dim")
        return ColBERTConfig("vllm", "", "", 0, 0, do_query_expansion=False, dim=int(dim) if dim else None)
    if hf_config.get("architectures", [""])[0] == "HF_ColBERT":
        meta_path = next((p for p in (tdir / "artifact.metadata", root / "artifact.metadata") if p.is_file()), None)
        meta = _read_json(meta_path) if meta_path else {}
        punctuation = tuple(string.punctuation) if meta.get("mask_punctuation", True) else ()
        return ColBERTConfig(
            layout="stanford",
            query_prefix=meta.get("query_token_id", "[unused0]"),
            document_prefix=meta.get("doc_token_id", "[unused1]"),
            query_length=int(meta.get("query_maxlen", 32)),
            document_length=int(meta.get("doc_maxlen", 180)),
            do_query_expansion=True,
            attend_to_expansion_tokens=bool(meta.get("attend_to_mask_tokens", False)),
            skiplist_words=punctuation,
            dim=int(meta.get("dim", 128)),
        )
    st_file = root / "config_sentence_transformers.json"
    if not any(d.on_tokens for d in st["dense"]) or not st_file.is_file():
        return None
    cfg = _read_json(st_file)
    if "query_length" not in cfg and "query_prefix" not in cfg:
        return None
    expansion = bool(cfg.get("do_query_expansion", True))
    return ColBERTConfig(
        layout="pylate",
        query_prefix=cfg.get("query_prefix", "[Q] "),
        document_prefix=cfg.get("document_prefix", "[D] "),
        query_length=int(cfg.get("query_length") or 32),
        document_length=int(cfg.get("document_length") or 180),
        do_query_expansion=expansion,
        attend_to_expansion_tokens=expansion and bool(cfg.get("attend_to_expansion_tokens", False)),
        skiplist_words=tuple(cfg.get("skiplist_words", string.punctuation)),
    )


def _token_ids(tokenizer_path: Path, tokens: list[str]) -> list[int]:
    """Vocabulary ids of single tokens (vLLM's classifier_from_token)."""
    from .tokenizer import PolyTokenizer

    tok = PolyTokenizer(tokenizer_path)
    ids = []
    for token in tokens:
        found = tok.token_to_id(token)
        if found is None:
            encoded = tok.token_ids(token, add_special_tokens=False)[0]
            if len(encoded) != 1:
                raise ValueError(f"classifier_from_token {token!r} is not a single token of this vocabulary")
            found = encoded[0]
        ids.append(found)
    return ids


def position_limit(hf_config: dict[str, Any]) -> int:
    """Longest input the position table allows (fairseq-style models reserve padding_idx + 1 slots)."""
    limit = int(hf_config.get("max_position_embeddings", 512))
    if hf_config.get("model_type") == "mpnet":  # transformers' MPNet fixes its padding_idx at 1
        limit -= 2
    elif hf_config.get("model_type") in _PADDING_OFFSET_POSITIONS:
        limit -= int(hf_config.get("pad_token_id", 1)) + 1
    rope = {**(hf_config.get("rope_scaling") or {}), **(hf_config.get("rope_parameters") or {})}
    gemma3 = "gemma3" in str(hf_config.get("model_type", ""))  # vLLM: Gemma 3's length is already the scaled one
    if rope.get("rope_type", rope.get("type")) == "linear" and rope.get("factor") and not gemma3:
        limit = int(limit * float(rope["factor"]))  # vLLM's rule: linear scaling stretches the positions trained on
    return limit


def _classifier_activation(hf_config: dict[str, Any], num_labels: int, root: Path | None = None) -> Activation:
    st = hf_config.get("sentence_transformers") or {}
    explicit = st.get("activation_fn") or hf_config.get("sbert_ce_default_activation_function")
    saved = root / "config_sentence_transformers.json" if root is not None else None
    if not explicit and saved is not None and saved.is_file():  # sentence-transformers 5+ CrossEncoder.save
        st_model = _read_json(saved)
        explicit = st_model.get("activation_fn") if st_model.get("model_type") == "CrossEncoder" else None
    if explicit:
        return _activation_name(explicit)
    if hf_config.get("problem_type") == "regression":  # before the one-label rule, as vLLM and transformers
        return "identity"
    if hf_config.get("problem_type") == "multi_label_classification" or num_labels == 1:
        return "sigmoid"
    return "softmax"


DISTILBERT_KEYS = {"dim": "hidden_size", "n_heads": "num_attention_heads", "n_layers": "num_hidden_layers",
                   "hidden_dim": "intermediate_size", "activation": "hidden_act"}  # fmt: skip
"""DistilBERT's config keys → BERT's (the rest of polyvec reads BERT's)."""

BASE_ARCHITECTURES = {
    "bert": "BertModel",
    "distilbert": "DistilBertModel",
    "roberta": "RobertaModel",
    "xlm-roberta": "XLMRobertaModel",
    "camembert": "CamembertModel",
    "mpnet": "MPNetModel",
    "modernbert": "ModernBertModel",
    "llama": "LlamaModel",
    "mistral": "MistralModel",
    "qwen2": "Qwen2Model",
    "qwen3": "Qwen3Model",
    "gemma3_text": "Gemma3TextModel",
}
"""A config.json without `architectures` (older hub repos): its model_type's bare model, as transformers' auto
mapping (and so vLLM) reads it."""


def load_model_config(
    model: str | os.PathLike,
    *,
    dtype: torch.dtype,
    max_model_len: int | None = None,
    pooler_config: PoolerConfig | None = None,
    hf_overrides: dict[str, Any] | None = None,
    revision: str | None = None,
    download_dir: str | None = None,
    convert: str | None = None,
    tokenizer: str | None = None,
) -> ModelConfig:
    """`convert` (vLLM's name) serves a `*ForCausalLM` checkpoint as a pooling model: "embed" (the default
    for causal LMs: LM head dropped, LAST pooling) or "classify" (a `score` head, from the checkpoint or
    from the LM-head rows of the `classifier_from_token` tokens)."""
    if convert not in (None, "auto", "none", "embed", "classify"):
        raise ValueError(f"convert={convert!r} is not valid; allowed: auto, embed, classify")
    root = resolve_model_path(model, revision, download_dir)
    lora, adapter_root = None, root
    if is_adapter(root):  # a LoRA adapter: the base model's checkpoint, the adapter merged into its weights
        lora = read_adapter_config(root)
        root = resolve_model_path(lora.base_model, None, download_dir)
    elif has_embedded_adapter(root):  # merged into this model's own weights, as transformers loads it
        lora = read_adapter_config(root, base=str(root))
    st = _read_sentence_transformers(root)
    tdir: Path = st["transformer_dir"]
    if not (tdir / "config.json").is_file():
        raise ValueError(f"{tdir} has no config.json; is it a transformers checkpoint?")
    hf_config = dict(_read_json(tdir / "config.json"))
    hf_config.update(hf_overrides or {})
    if hf_config.get("model_type") == "distilbert":  # its own names for BERT's keys, as transformers maps them
        hf_config = {
            **{bert: hf_config[name] for name, bert in DISTILBERT_KEYS.items() if name in hf_config},
            **hf_config,
        }
    sources: dict[str, str] = {}
    if lora is not None:
        sources["lora"] = f"{adapter_root / ADAPTER_CONFIG} (merged into {lora.base_model})"

    architectures = hf_config.get("architectures") or []
    sources["architecture"] = "config.json"
    if not architectures and hf_config.get("model_type") in BASE_ARCHITECTURES:  # older repos: as vLLM fills it in
        architectures = [BASE_ARCHITECTURES[hf_config["model_type"]]]
        sources["architecture"] = f"config.json model_type {hf_config['model_type']!r}"
    if not architectures:
        raise ValueError(
            f"{tdir / 'config.json'} names no architectures (give one, e.g. hf_overrides="
            '{"architectures": ["BertModel"]})'
        )
    architecture = architectures[0]
    colqwen2 = None
    if architecture in COLQWEN2:  # the adapter's processor settings, where it ships them
        processor = adapter_root if (adapter_root / "preprocessor_config.json").is_file() else root
        hf_config, colqwen2 = _read_colqwen2(processor, hf_config)
        backbone = "Qwen2.5-VL" if "out_hidden_size" in colqwen2.vision_config else "Qwen2-VL"
        sources["architecture"] = f"config.json {architecture} (ColQwen2: {backbone} + token projection)"
        architecture = "ColQwen2"
    elif architecture in COLPALI:
        processor = adapter_root if (adapter_root / "preprocessor_config.json").is_file() else root
        hf_config, colqwen2 = _read_colpali(processor, hf_config)
        sources["architecture"] = f"config.json {architecture} (ColPali: PaliGemma + token projection)"
        architecture = "ColPali"
    colbert = _read_colbert(root, tdir, st, hf_config)
    if architecture == "HF_ColBERT":  # Stanford ColBERT: a BERT trunk plus `linear` (in the same checkpoint)
        architecture = "BertModel"
        sources["architecture"] = "config.json HF_ColBERT (Stanford ColBERT: BERT + linear projection)"
    splade_embed = None
    if architecture == VLLM_SPLADE:  # vLLM's SPLADE: a masked LM whose embed is its sparse vector, dense
        sources["architecture"] = (
            f"config.json {architecture} (vLLM's SPLADE: BertForMaskedLM, embed over the vocabulary)"
        )
        architecture = "BertForMaskedLM"
        splade_embed = (_token_id(hf_config.get("cls_token_id")), _token_id(hf_config.get("sep_token_id")))
    if architecture in VLLM_COLBERT:  # vLLM's ColBERT: a trunk plus `linear` (in the same checkpoint)
        sources["architecture"] = f"config.json {architecture} (vLLM's ColBERT: {VLLM_COLBERT[architecture]} + linear)"
        architecture = VLLM_COLBERT[architecture]
    if colbert is not None:
        sources["colbert"] = {"stanford": "artifact.metadata", "vllm": "config.json (vLLM's ColBERT layout)"}.get(
            colbert.layout, "config_sentence_transformers.json"
        )
    if st["pooling"] is not None or colbert is not None:
        # A sentence-transformers model with a Pooling module is an embedding model: its config.json often
        # names the pre-training head (all-mpnet-base-v2 says MPNetForMaskedLM; Qwen3-Embedding says
        # Qwen3ForCausalLM) whose weights it lacks.
        for suffix in (
            "ForMaskedLM",
            "ForSequenceClassification",
            "ForTokenClassification",
            "ForPreTraining",
            "ForCausalLM",
        ):
            if architecture.endswith(suffix) and convert != "classify":
                sources["architecture"] = f"modules.json (embedding model; config.json says {architecture})"
                architecture = architecture[: -len(suffix)] + "Model"
    if architecture.endswith("ForCausalLM"):
        head = "ForSequenceClassification" if convert == "classify" else "Model"
        sources["architecture"] = f"convert={convert or 'embed'} (config.json says {architecture})"
        architecture = architecture[: -len("ForCausalLM")] + head
    elif convert == "classify" and not architecture.endswith("ForSequenceClassification"):
        raise ValueError(f"convert='classify' needs a causal LM or sequence classifier checkpoint, not {architecture}")

    st_file = next((tdir / n for n in ST_TRANSFORMER_CONFIGS if (tdir / n).is_file()), None)
    st_cfg = _read_json(st_file) if st_file is not None else {}
    limit = position_limit(hf_config)
    if max_model_len is not None:
        if max_model_len < 1 or max_model_len > limit:
            raise ValueError(f"max_model_len={max_model_len} is out of range; this model allows 1..{limit}")
        sources["max_model_len"] = "argument"
    elif st_cfg.get("max_seq_length"):
        max_model_len = min(int(st_cfg["max_seq_length"]), limit)
        sources["max_model_len"] = f"{st_file.name if st_file else 'sentence_bert_config.json'} max_seq_length"
    elif (root / "modules.json").is_file() and (st_len := tokenizer_max_length(tdir)):
        # sentence-transformers >= 6 stores max_seq_length as the tokenizer's model_max_length.
        max_model_len = min(st_len, limit)
        sources["max_model_len"] = "tokenizer_config.json model_max_length (sentence-transformers)"
    elif (
        hf_config.get("position_embedding_type") == "absolute"  # vLLM's rule: absolute positions only (BERT's)
        and (tok_len := tokenizer_max_length(tdir))
        and tok_len < limit
    ):
        max_model_len = tok_len
        sources["max_model_len"] = "tokenizer_config.json model_max_length"
    else:
        max_model_len = limit
        sources["max_model_len"] = "config.json max_position_embeddings"

    tokenizer_path = adapter_root / "tokenizer.json"  # an adapter's own tokenizer first
    if not tokenizer_path.is_file():
        tokenizer_path = tdir / "tokenizer.json"
    if not tokenizer_path.is_file():
        tokenizer_path = root / "tokenizer.json"
    if not tokenizer_path.is_file() and (tdir / "vocab.txt").is_file():
        tokenizer_path = tdir / "vocab.txt"
    if tokenizer is not None:  # vLLM's --tokenizer: another folder or hub id holds the tokenizer
        tok_root = resolve_model_path(tokenizer, None, download_dir)
        tokenizer_path = next(
            (p for p in (tok_root / "tokenizer.json", tok_root / "vocab.txt") if p.is_file()),
            tok_root / "tokenizer.json",
        )
        tdir_note = str(tok_root)
    else:
        tdir_note = str(tdir)
    if not tokenizer_path.is_file():
        raise ValueError(f"no tokenizer.json (or vocab.txt) in {tdir_note}")
    # vLLM's LLM-as-reranker recipes: `method` (from_2_way_softmax; Qwen3-Reranker's is_original_qwen3_reranker
    # means it) makes one label of two vocabulary tokens, and the pair is the two texts joined, no separator
    method = hf_config.get("method") or ("from_2_way_softmax" if hf_config.get("is_original_qwen3_reranker") else None)
    if method not in (None, "from_2_way_softmax", "no_post_processing"):
        raise ValueError(f"method={method!r} is not supported; vLLM's: from_2_way_softmax, no_post_processing")
    if (convert == "classify" or method) and hf_config.get("classifier_from_token"):
        hf_config["classifier_from_token_ids"] = _token_ids(tokenizer_path, hf_config["classifier_from_token"])
        hf_config["num_labels"] = len(hf_config["classifier_from_token_ids"])
        hf_config.pop("id2label", None)
        if method == "from_2_way_softmax":
            if hf_config["num_labels"] != 2:
                raise ValueError("method='from_2_way_softmax' needs two classifier_from_token tokens (no, yes)")
            hf_config["classifier_2_way"], hf_config["num_labels"] = True, 1
    elif method:
        raise ValueError(f"method={method!r} needs classifier_from_token (the label tokens, e.g. ['no', 'yes'])")
    if method:
        hf_config.setdefault("use_sep_token", False)
    do_lower_case = bool(st_cfg.get("do_lower_case", False))

    id2label = {int(k): v for k, v in (hf_config.get("id2label") or {}).items()}
    # transformers 5 saves neither num_labels nor id2label when they are at its default of two labels
    num_labels = (
        int(hf_config.get("num_labels") or len(id2label) or 2)
        if architecture.endswith(("ForSequenceClassification", "ForTokenClassification"))
        else 0
    )
    if num_labels and len(id2label) != num_labels:
        id2label = {i: f"LABEL_{i}" for i in range(num_labels)}

    matryoshka = hf_config.get("matryoshka_dimensions")
    pooler_config = pooler_config or PoolerConfig()
    if st["pooling"] is not None:
        sources["pooling_type"] = "modules.json Pooling"
        if pooler_config.use_activation is None and colbert is None:
            # as sentence-transformers and vLLM 0.34 (get_pooling_config): normalized only with a Normalize module
            pooler_config = dataclasses.replace(pooler_config, use_activation=st["normalize"])
            sources["use_activation"] = f"modules.json ({'a' if st['normalize'] else 'no'} Normalize module)"
    if pooler_config.seq_pooling_type is not None:
        sources["pooling_type"] = "pooler_config"
    sources["dtype"] = "argument"

    st_model_cfg = root / "config_sentence_transformers.json"
    prompts, default_prompt, truncate_dim = {}, None, None
    declared_matryoshka = bool(hf_config.get("is_matryoshka", False) or matryoshka)
    if st_model_cfg.is_file():
        st_model = _read_json(st_model_cfg)
        prompts = {k: v for k, v in (st_model.get("prompts") or {}).items() if isinstance(v, str)}
        default_prompt = st_model.get("default_prompt_name")
        if default_prompt is not None and default_prompt not in prompts:  # sentence-transformers refuses it too
            names = ", ".join(prompts) or "none"
            raise ValueError(
                f"{st_model_cfg}: default_prompt_name {default_prompt!r} is not among the prompts ({names})"
            )
        if prompts:
            sources["prompts"] = "config_sentence_transformers.json"
        similarity = st_model.get("similarity_fn_name")
        if similarity not in (None, "cosine") and not (similarity == "dot" and st["normalize"]):
            logger.warning(
                "%s names similarity_fn_name %r; score and rerank return cosines here, as vLLM's do (rank by "
                "the vectors from embed to use %s)", st_model_cfg, similarity, similarity,
            )  # fmt: skip
        truncate_dim = st_model.get("truncate_dim")
        if truncate_dim is not None and pooler_config.dimensions is None:
            if isinstance(truncate_dim, bool) or not isinstance(truncate_dim, int) or truncate_dim < 1:
                raise ValueError(f"{st_model_cfg}: truncate_dim must be a positive integer, got {truncate_dim!r}")
            # sentence-transformers truncates every sentence embedding to it (not token embeddings): the model's
            # embed size, a Matryoshka one
            sources["dimensions"] = "config_sentence_transformers.json truncate_dim"
            if not matryoshka:
                hf_config = {**hf_config, "is_matryoshka": True}
    score_template = _saved_score_template(root, tokenizer_path.parent)
    if score_template is not None:
        sources["score_template"] = "sentence_bert_config.json modality_config message"
    from .models.registry import CAUSAL_FAMILIES

    mc = ModelConfig(
        model=str(model),
        # a decoder with vLLM's `is_causal: false` (gte-Qwen2) reads whole prompts both ways, as an encoder
        is_causal=(architecture.startswith(CAUSAL_FAMILIES) and hf_config.get("is_causal", True) is not False)
        or architecture == "ColQwen2",
        colqwen2=colqwen2,
        lora=lora,
        prompts=prompts,
        default_prompt_name=default_prompt,
        truncate_dim=truncate_dim if pooler_config.dimensions is None else None,
        score_template=score_template,
        pool_prompt=st["include_prompt"],
        path=root,
        hf_config=hf_config,
        architecture=architecture,
        dtype=dtype,
        max_model_len=max_model_len,
        max_position_len=limit,
        tokenizer_path=tokenizer_path,
        transformer_dir=tdir,
        do_lower_case=do_lower_case,
        st_pooling=st["pooling"],
        dense=tuple(st["dense"]),
        matryoshka_dimensions=tuple(int(d) for d in matryoshka) if matryoshka else None,
        is_matryoshka=bool(hf_config.get("is_matryoshka", False) or matryoshka),
        num_labels=num_labels,
        id2label=id2label,
        classifier_activation=_classifier_activation(hf_config, num_labels, root),
        pooler_config=pooler_config,
        colbert=colbert,
        splade=st["splade"] or SpladeSpec(),
        splade_embed=splade_embed,
        bge_m3=_read_bge_m3(root),
        sources=sources,
    )
    if mc.truncate_dim is not None and mc.truncate_dim >= mc.embed_dim:  # cuts nothing, as sentence-transformers
        mc.sources.pop("dimensions", None)
        mc = dataclasses.replace(mc, truncate_dim=None, is_matryoshka=declared_matryoshka)
    return mc
