"""Runs one scheduled batch: packs it, runs the model on the device, pools every request.

The packed batch is flat `input_ids` [T] plus the `AttentionMetadata` (`cu_seqlens`, positions); no token of
padding enters attention between real tokens. Where the platform asks for it (CPU with oneDNN), the token
count is rounded up to a bucket (at most 1/16 more tokens, as dummy sequences): oneDNN compiles a matmul
kernel for every new row count, and packed batches would have a new size almost every step; bucket sizes
recur and stay in its cache. For causal models a batch entry may be one chunk of a long prompt: it starts at
its context offset, reads/writes the request's KV cache, and its hidden states go into the request's
`PoolingState` instead of the pooler, until its last chunk. Device specifics live in `polyvec.platforms`.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Iterator
from typing import cast

import torch
from torch import nn

from ..config import EngineConfig, ModelConfig
from ..layers.activation import Dense
from ..layers.attention import AttentionMetadata, KVCache
from ..layers.pooler import Pooler, PoolingState
from ..models.colpali import ColPaliTrunk
from ..models.colqwen2 import PROJECTION_KEYS, ColQwen2Trunk, ImageBatch
from ..models.decoder import DecoderModel
from ..models.lora import merge_lora
from ..models.qwen2_vl import mrope_positions
from ..models.registry import PoolingModel, build_model
from ..models.weights import read_state_dict
from ..platforms import get_platform
from .request import Request
from .scheduler import ScheduledChunk

logger = logging.getLogger(__name__)

# Bucket sizes per doubling of the token count: 1/16 steps pad ≤ 6.25% (~3% on average); 1/32 steps padded
# half that but made 190 sizes, whose ~760 primitives did not fit in the cache (see platforms/cpu.py).
BUCKETS_PER_DOUBLING = 16


def bucket_padding(num_tokens: int, max_len: int) -> list[int]:
    """Lengths of the dummy sequences that round `num_tokens` up to its bucket: a multiple of 1/16 of the
    power of two below it (at least 8), so at most 16 bucket sizes per doubling and 112 up to 8,192, whose
    projections all fit in the primitive cache polyvec sets (platforms/cpu.py); each dummy sequence holds at
    most `max_len` tokens (the model's positions)."""
    step = max(8, (1 << (max(num_tokens, 1).bit_length() - 1)) // BUCKETS_PER_DOUBLING)
    pad = -num_tokens % step
    return [min(max_len, pad - start) for start in range(0, pad, max_len)]


def _load_dense_stack(model_config: ModelConfig, device: torch.device, on_tokens: bool) -> nn.Module | None:
    specs = [s for s in model_config.dense if s.on_tokens == on_tokens]
    if not specs:
        return None
    layers = []
    for spec in specs:
        layer = Dense(spec.in_features, spec.out_features, spec.bias, spec.activation, spec.use_residual)
        state = read_state_dict(spec.path)
        layer.load_state_dict({k: v for k, v in state.items() if k.startswith(("linear.", "residual."))})
        layers.append(layer)
    return nn.Sequential(*layers).to(device=device, dtype=torch.float32).eval().requires_grad_(False)


def _load_linear(path, device: torch.device) -> nn.Linear:
    """A torch.save'd nn.Linear state dict (bge-m3's colbert_linear.pt, sparse_linear.pt), in float32."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    out, inp = state["weight"].shape
    layer = nn.Linear(inp, out, bias="bias" in state)
    layer.load_state_dict(state)
    return layer.to(device=device, dtype=torch.float32).eval().requires_grad_(False)


def _bge_m3_ids(model_config: ModelConfig) -> tuple[tuple[int, ...], int | None]:
    """bge-m3's special ids: those its sparse output leaves out (cls, eos, pad, unk), and the leading one its token
    vectors leave out (<s>, its cls token), as vLLM's BOS filter does."""
    from ..tokenizer import PolyTokenizer

    tokenizer = PolyTokenizer(model_config.tokenizer_path)
    unused = (tokenizer.special_token_id(k) for k in ("cls_token", "eos_token", "pad_token", "unk_token"))
    first = (tokenizer.special_token_id(k) for k in ("cls_token", "bos_token"))
    return tuple(sorted({i for i in unused if i is not None})), next((i for i in first if i is not None), None)


class ModelRunner:
    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig):
        self.model_config = model_config
        self.device = engine_config.resolve_device()
        self.platform = get_platform(self.device, engine_config.kernels)
        self.platform.configure_threads(engine_config.num_threads)
        # The trunk's weights sit beside its config.json (a subfolder in old sentence-transformers layouts).
        state = read_state_dict(model_config.transformer_dir)
        if model_config.lora is not None:
            merge_lora(state, model_config.lora)
        self.model: PoolingModel = build_model(model_config, state, self.device)
        token_projection = _load_dense_stack(model_config, self.device, on_tokens=True)
        if model_config.colqwen2 is not None:  # its projection beside the language model, with a bias
            prefix = next(p for p in PROJECTION_KEYS if p + "weight" in state)
            weight, bias = state[prefix + "weight"], state.get(prefix + "bias")
            token_projection = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
            token_projection.load_state_dict({"weight": weight} | ({"bias": bias} if bias is not None else {}))
            token_projection = token_projection.to(self.device).eval().requires_grad_(False)
            cast("ColQwen2Trunk | ColPaliTrunk", self.model.encoder).visual.prepare(self.device, model_config.dtype)
        elif model_config.colbert is not None and model_config.colbert.layout in ("stanford", "vllm"):
            # Stanford ColBERT and vLLM's keep the projection (`linear` or `colbert_linear`, no bias) beside the
            # trunk's weights.
            names = [p + n for p in ("", "model.", "bert.") for n in ("linear.weight", "colbert_linear.weight")]
            key = next((k for k in names if k in state), None)
            if key is not None:
                weight = state[key]
                token_projection = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
                token_projection.weight.data.copy_(weight)
                token_projection = token_projection.to(self.device).eval().requires_grad_(False)
                model_config.colbert = dataclasses.replace(model_config.colbert, dim=weight.shape[0])
            elif token_projection is None:  # else a sentence-transformers Dense folder, vLLM's fallback
                raise ValueError(
                    f"{model_config.transformer_dir}: the checkpoint has no ColBERT projection (linear.weight, or a "
                    "sentence-transformers Dense module)"
                )
        del state
        sparse_head: nn.Module | None = None
        skip_ids: tuple[int, ...] = ()
        drop_first: int | None = None
        if model_config.bge_m3 is not None:  # FlagEmbedding's bge-m3 heads: multi-vector and sparse
            token_projection = _load_linear(model_config.bge_m3.colbert_path, self.device)
            sparse_head = _load_linear(model_config.bge_m3.sparse_path, self.device)
            skip_ids, drop_first = _bge_m3_ids(model_config)
        args = self.model.encoder.args
        head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads  # decoders name it
        self.packed_attention = not self.causal and self.platform.packed_attention(model_config.dtype, head_dim)
        self.int8 = engine_config.quantization == "int8"
        self.platform.prepare_model(self.model, model_config, engine_config.quantization)
        self.pad_to_bucket = self.platform.pads_to_bucket(self.packed_attention)
        head = self.platform.prepare_head
        for name in ("sequence_head", "token_head"):
            if (module := getattr(self.model, name)) is not None:
                setattr(self.model, name, head(module))
        embed_projection = _load_dense_stack(model_config, self.device, on_tokens=False)
        self.pooler = Pooler(
            embed_projection=None if embed_projection is None else head(embed_projection),
            token_projection=None if token_projection is None else head(token_projection),
            sequence_head=self.model.sequence_head,
            token_head=self.model.token_classifier,
            classifier_activation_name=model_config.classifier_activation,
            splade=model_config.splade,
            sparse_head=None if sparse_head is None else head(sparse_head),
            sparse_skip_ids=skip_ids,
            token_drop_first=drop_first,
            sparse_filter_ids=(model_config.hf_config.get("bos_token_id"), model_config.hf_config.get("eos_token_id")),
            vocab_size=int(model_config.hf_config.get("vocab_size", 0)) or None,
            logit_mean=model_config.pooler_config.logit_mean,
            logit_sigma=model_config.pooler_config.logit_sigma,
            device=self.device,
        )

    @property
    def causal(self) -> bool:
        return self.model.causal

    @property
    def _decoder(self) -> DecoderModel:
        encoder = self.model.encoder
        if isinstance(encoder, ColQwen2Trunk):
            return encoder.decoder
        assert isinstance(encoder, DecoderModel), "only causal models keep KV caches"
        return encoder

    def kv_bytes_per_token(self) -> int:
        layers, heads, dim = self._decoder.kv_shape()
        return 2 * layers * heads * dim * self.model_config.dtype.itemsize

    def allocate_kv_cache(self, num_tokens: int) -> KVCache:
        layers, heads, dim = self._decoder.kv_shape()
        return KVCache(layers, num_tokens, heads, dim, self.model_config.dtype, self.device)

    def bucket_sizes(self, max_tokens: int) -> list[int]:
        """Every token count a batch of at most `max_tokens` tokens is padded to (empty without buckets)."""
        if not self.pad_to_bucket:
            return []
        max_len = self.model_config.max_model_len
        return sorted({n + sum(bucket_padding(n, max_len)) for n in range(1, max_tokens + 1)})

    def warmup(self, max_tokens: int) -> Iterator[int]:
        """Compile every shape-specific kernel a batch can need, one bucket size per step (yields the size), so
        serving reaches its steady-state memory and speed before traffic does. A server runs it while idle."""
        sizes = self.bucket_sizes(max_tokens)
        if not sizes:
            return
        with torch.inference_mode():  # one short real forward shows the platform which kernels the model calls
            n = min(sizes[0], self.model_config.max_model_len)
            ids = torch.zeros(n, dtype=torch.long, device=self.device)
            self.model(ids, None, AttentionMetadata.build([n], self.device, None, packed=self.packed_attention))
        for size in sizes:
            self.platform.warm_kernels(self.model, size)
            yield size
        self.platform.release_memory()

    def _images(self, requests: list[Request]) -> ImageBatch:
        """A ColQwen2 or ColPali batch's images (whole requests: image prompts are never split) and, for
        ColQwen2, every token's multimodal rotary positions."""
        spec = self.model_config.colqwen2
        assert spec is not None
        merge = int(spec.vision_config.get("spatial_merge_size", 2))
        patches, grids, positions = [], [], []
        for r in requests:
            pixels = r.images or []
            patches += [p.patches for p in pixels]
            grids += [p.grid_thw for p in pixels]
            if spec.family == "qwen2_vl":  # ColPali's positions are the metadata's
                positions.append(
                    mrope_positions(r.prompt_token_ids, spec.image_token_id, [p.grid_thw for p in pixels], merge)
                )
        empty = torch.zeros(0, 0)
        return ImageBatch(
            torch.cat(patches).to(self.device) if patches else empty,
            grids,
            torch.cat(positions, dim=1).to(self.device) if positions else None,
        )

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk[Request]]) -> tuple[list[torch.Tensor | None], torch.Tensor]:
        """Outputs of the requests whose last chunk this is (None for the others), and the batch's final
        hidden states [T, H] (prefix caching stores some of them)."""
        requests = [c.request for c in chunks]
        lens = [c.num_tokens for c in chunks]
        if self.causal:
            ids = list(
                itertools.chain.from_iterable(
                    c.request.prompt_token_ids[c.start : c.start + c.num_tokens] for c in chunks
                )
            )
        else:
            ids = list(itertools.chain.from_iterable(r.prompt_token_ids for r in requests))
        total = len(ids)
        padding = bucket_padding(total, self.model_config.max_model_len) if self.pad_to_bucket else []
        ids.extend([0] * sum(padding))
        input_ids = torch.tensor(ids, dtype=torch.long).to(self.device, non_blocking=True)
        token_type_ids = None
        if any(r.token_type_ids is not None and any(r.token_type_ids) for r in requests):
            token_type_ids = torch.tensor(
                list(itertools.chain.from_iterable(r.token_type_ids or [0] * r.num_tokens for r in requests))
                + [0] * sum(padding),
                dtype=torch.long,
            ).to(self.device, non_blocking=True)
        if self.causal:
            meta = AttentionMetadata.build_causal(
                lens, [c.start for c in chunks], [r.kv_cache for r in requests], self.device
            )
            if self.model_config.colqwen2 is not None:
                meta.images = self._images(requests)
        else:
            key_lens = None
            if any(r.num_key_tokens is not None for r in requests):
                key_lens = [r.num_key_tokens or r.num_tokens for r in requests] + padding
            meta = AttentionMetadata.build(lens + padding, self.device, key_lens, packed=self.packed_attention)
            if self.model_config.colqwen2 is not None:  # ColPali: bidirectional, whole prompts
                meta.images = self._images(requests)
        hidden = self.model(input_ids, token_type_ids, meta)
        if padding:
            meta, hidden, input_ids = meta.first(len(chunks)), hidden[:total], input_ids[:total]
        whole = [c.is_whole for c in chunks]
        outputs = self.pooler(
            hidden,
            meta,
            input_ids,
            [r.spec if w else None for r, w in zip(requests, whole)],
            [r.keep for r in requests],
        )
        for k in range(max((len(r.extra) for r in requests), default=0)):  # more tasks from the same hidden states
            extra = self.pooler(
                hidden,
                meta,
                input_ids,
                [r.extra[k][1] if len(r.extra) > k else None for r in requests],
                [r.keep for r in requests],
            )
            for i, r in enumerate(requests):
                if len(r.extra) > k:
                    first = outputs[i]
                    multi = first if isinstance(first, dict) else {r.params.task: first}
                    multi[r.extra[k][0]] = extra[i]
                    outputs[i] = multi
        for i, r in enumerate(requests):
            if r.by_task and whole[i] and not isinstance(outputs[i], dict):  # a list of one task
                outputs[i] = {r.params.task: outputs[i]}
        if not all(whole):
            starts = meta.cu_seqlens.tolist()
            for i, c in enumerate(chunks):
                if whole[i]:
                    continue
                r = c.request
                if r.pool_state is None:
                    r.pool_state = PoolingState(r.spec)
                r.pool_state.update(
                    hidden[starts[i] : starts[i + 1]].float(), input_ids[starts[i] : starts[i + 1]], c.start
                )
                if c.is_last:
                    outputs[i] = self.pooler.finish(r.pool_state, r.keep)
        if self.device.type != "cpu":
            outputs = [
                {t: x.cpu() for t, x in o.items()} if isinstance(o, dict) else o.cpu() if o is not None else None
                for o in outputs
            ]
        self.platform.after_batch()
        return outputs, hidden
