"""Architecture name (from `config.json`) → polyvec model, and the tasks each kind of head serves.

A pooling model is a trunk (`encoder`: packed ids → hidden states) plus at most one classifier head. Which
head the checkpoint has decides its tasks:
  bare encoder (`*Model`)          → embed, token_embed
  `*ForSequenceClassification`     → classify
  `*ForTokenClassification`        → token_classify
  `*ForMaskedLM`                   → token_classify (vocabulary logits per token, e.g. SPLADE)
Decoders (Llama, Mistral, Qwen2, Qwen3) use the same heads; a `*ForCausalLM` checkpoint is converted by the
loader (`convert="embed"` → `*Model`, `convert="classify"` → `*ForSequenceClassification`), as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..config import ModelConfig
from ..layers.attention import AttentionMetadata
from .args import DecoderArgs, EncoderArgs, ModernBertArgs
from .bert import (
    BERT_HEAD_RULES,
    DISTILBERT_HEAD_RULES,
    DISTILBERT_RULES,
    ENCODER_RULES,
    ROBERTA_HEAD_RULES,
    BertEncoder,
    BertSequenceHead,
    DistilBertSequenceHead,
    MaskedLMHead,
    RobertaSequenceHead,
)
from .colpali import ColPaliTrunk
from .colqwen2 import ColQwen2Trunk
from .decoder import (
    DECODER_HEAD_RULES,
    DECODER_RULES,
    DecoderModel,
    Qwen2Model,
    Qwen3Model,
)
from .gemma3 import Gemma3TextModel
from .modernbert import (
    MODERNBERT_HEAD_RULES,
    MODERNBERT_RULES,
    ModernBertClassifier,
    ModernBertEncoder,
    ModernBertMaskedLMHead,
)
from .mpnet import MPNET_ENCODER_RULES, MPNetEncoder
from .roberta import RobertaEncoder
from .weights import Rule, load_mapped


class ScoreHead(nn.Linear):
    """Decoders' `*ForSequenceClassification` head: a linear layer on the last token; transformers' has no bias,
    but a checkpoint's `score.bias` is added, as vLLM adds it (zero where there is none)."""

    def __init__(self, hidden: int, num_labels: int):
        super().__init__(hidden, num_labels, bias=True)


@dataclass(frozen=True)
class Family:
    encoder: type[BertEncoder] | type[DecoderModel] | type[ModernBertEncoder]
    prefix: str  # base-model prefix in task checkpoints ("bert." in BertForMaskedLM)
    encoder_rules: list[Rule]
    head_rules: dict[str, list[Rule]]
    sequence_head: type[nn.Module]


FAMILIES: dict[str, Family] = {
    "Bert": Family(BertEncoder, "bert.", ENCODER_RULES, BERT_HEAD_RULES, BertSequenceHead),
    "DistilBert": Family(BertEncoder, "distilbert.", DISTILBERT_RULES, DISTILBERT_HEAD_RULES, DistilBertSequenceHead),
    "Roberta": Family(RobertaEncoder, "roberta.", ENCODER_RULES, ROBERTA_HEAD_RULES, RobertaSequenceHead),
    "XLMRoberta": Family(RobertaEncoder, "roberta.", ENCODER_RULES, ROBERTA_HEAD_RULES, RobertaSequenceHead),
    "Camembert": Family(RobertaEncoder, "roberta.", ENCODER_RULES, ROBERTA_HEAD_RULES, RobertaSequenceHead),
    "MPNet": Family(MPNetEncoder, "mpnet.", MPNET_ENCODER_RULES, ROBERTA_HEAD_RULES, RobertaSequenceHead),
    "ModernBert": Family(ModernBertEncoder, "model.", MODERNBERT_RULES, MODERNBERT_HEAD_RULES, ModernBertClassifier),
    "Llama": Family(DecoderModel, "model.", DECODER_RULES, DECODER_HEAD_RULES, ScoreHead),
    "Mistral": Family(DecoderModel, "model.", DECODER_RULES, DECODER_HEAD_RULES, ScoreHead),
    "Qwen2": Family(Qwen2Model, "model.", DECODER_RULES, DECODER_HEAD_RULES, ScoreHead),
    "Qwen3": Family(Qwen3Model, "model.", DECODER_RULES, DECODER_HEAD_RULES, ScoreHead),
    "Gemma3Text": Family(Gemma3TextModel, "model.", DECODER_RULES, DECODER_HEAD_RULES, ScoreHead),
}
CAUSAL_FAMILIES = tuple(name for name, f in FAMILIES.items() if f.encoder.causal)
HEADS = {
    "Model": ("embed", "token_embed"),
    # token_classify: the classifier on every token, as vLLM's sequence classifiers also serve it
    "ForSequenceClassification": ("classify", "token_classify"),
    "ForTokenClassification": ("token_classify",),
    "ForMaskedLM": ("token_classify", "embed_sparse"),  # vocabulary logits per token; SPLADE's sparse vector
}


def split_architecture(architecture: str) -> tuple[Family, str]:
    for family_name in sorted(FAMILIES, key=len, reverse=True):
        if architecture.startswith(family_name) and architecture[len(family_name) :] in HEADS:
            return FAMILIES[family_name], architecture[len(family_name) :]
    supported = [f + h for f in FAMILIES for h in HEADS]
    raise ValueError(f"architecture {architecture!r} is not supported; supported: {', '.join(supported)}")


class PoolingModel(nn.Module):
    """Trunk + head, with the tasks they serve. Heads stay in float32 whatever the trunk's dtype."""

    def __init__(self, model_config: ModelConfig):
        super().__init__()
        self.encoder: BertEncoder | DecoderModel | ModernBertEncoder | ColQwen2Trunk | ColPaliTrunk
        self.sequence_head: nn.Module | None = None
        self.token_head: nn.Module | None = None
        self.supported_tasks: tuple[str, ...]
        if model_config.colqwen2 is not None:  # Qwen2-VL + a token projection (in the pooler)
            spec = model_config.colqwen2
            self.family, self.head_kind = FAMILIES["Qwen2"], "Model"
            self.supported_tasks = ("token_embed",)
            trunk = ColPaliTrunk if spec.family == "paligemma" else ColQwen2Trunk
            self.encoder = trunk(model_config.hf_config, spec.vision_config, spec.image_token_id)
            self.causal = self.encoder.causal
            self.default_pooling = "LAST"
            return
        family, head = split_architecture(model_config.architecture)
        self.family, self.head_kind = family, head
        self.supported_tasks = HEADS[head]
        if issubclass(family.encoder, DecoderModel):
            self.encoder = family.encoder(DecoderArgs.from_hf(model_config.hf_config))
        elif issubclass(family.encoder, ModernBertEncoder):
            self.encoder = family.encoder(ModernBertArgs.from_hf(model_config.hf_config))
        else:
            self.encoder = family.encoder(EncoderArgs.from_hf(model_config.hf_config))
        args = self.encoder.args
        hidden = args.hidden_size
        self.causal = bool(self.encoder.causal)
        # What transformers' classifiers read (CLS for encoders, the last token for decoders, causal or not);
        # embedders usually override it through their sentence-transformers Pooling module.
        self.default_pooling = "LAST" if isinstance(self.encoder, DecoderModel) else "CLS"
        if isinstance(args, ModernBertArgs):  # its heads: a dense → act → norm block before the last layer
            self.default_pooling = "MEAN" if args.classifier_pooling == "mean" else "CLS"
            if head == "ForSequenceClassification":
                self.sequence_head = ModernBertClassifier(args, model_config.num_labels)
            elif head == "ForTokenClassification":
                self.token_head = ModernBertClassifier(args, model_config.num_labels)
            elif head == "ForMaskedLM":
                self.token_head = ModernBertMaskedLMHead(args)
        elif head == "ForSequenceClassification":
            self.sequence_head = family.sequence_head(hidden, model_config.num_labels)
        elif head == "ForTokenClassification":
            self.token_head = nn.Linear(hidden, model_config.num_labels)
        elif head == "ForMaskedLM":
            if not isinstance(args, EncoderArgs):  # no decoder family has masked-LM weight rules
                raise ValueError(f"architecture {model_config.architecture!r} is not supported")
            self.token_head = MaskedLMHead(hidden, args.vocab_size, args.hidden_act, args.layer_norm_eps)

    @property
    def token_classifier(self) -> nn.Module | None:
        """What token_classify applies to each token: the token head; for a sequence classifier, its head after
        the pooling step, as vLLM applies it (BERT's `classifier` without its pooler layer, RoBERTa's whole
        classification head, a decoder's score)."""
        if self.token_head is not None:
            return self.token_head
        head = self.sequence_head
        if isinstance(head, ModernBertClassifier):
            return head
        return getattr(head, "classifier", head) if head is not None else None

    def forward(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.encoder(input_ids, token_type_ids, meta)  # [T, H]

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        if isinstance(self.encoder, (ColQwen2Trunk, ColPaliTrunk)):
            self.encoder.load_weights(state)
            return
        rules = list(self.family.head_rules.get(self.head_kind, [])) + list(self.family.encoder_rules)
        tied = self.head_kind == "ForMaskedLM"
        from_tokens = (
            self.causal
            and self.head_kind == "ForSequenceClassification"
            and not any(k.endswith("score.weight") for k in state)
        )
        optional = ("token_head.decoder.weight",) if tied else ("sequence_head.",) if from_tokens else ()
        if isinstance(self.sequence_head, ScoreHead) and not any(k.endswith("score.bias") for k in state):
            state = {**state, "score.bias": torch.zeros(self.sequence_head.out_features)}
        load_mapped(self, state, rules, strip_prefixes=(self.family.prefix,), optional=optional)
        if from_tokens:
            self._score_from_lm_head(state)
        decoders = ("predictions.decoder.weight", "lm_head.decoder.weight", "vocab_projector.weight")
        if tied and not any(k.endswith(decoders) or k == "decoder.weight" for k in state):
            # ForMaskedLM: a masked-LM head on an encoder (the constructor refuses decoders)
            assert isinstance(self.token_head, (MaskedLMHead, ModernBertMaskedLMHead))
            if isinstance(self.encoder, ModernBertEncoder):
                embeddings = self.encoder.tok_embeddings.weight
            else:
                assert isinstance(self.encoder, BertEncoder)
                embeddings = self.encoder.embeddings.word_embeddings.weight
            with torch.no_grad():  # tied decoder: the checkpoint stores the input embeddings only
                self.token_head.decoder.weight.copy_(embeddings)

    def _score_from_lm_head(self, state: dict[str, torch.Tensor]) -> None:
        """A `*ForCausalLM` served with convert="classify" and no `score` weights: vLLM's
        `classifier_from_token` (hf_overrides) names the vocabulary tokens whose LM-head rows become the
        classifier (e.g. ["no", "yes"] for a yes/no reranker); their logits are the labels' logits."""
        # Only causal (decoder) classifiers get here, and their sequence head is a ScoreHead.
        assert isinstance(self.encoder, DecoderModel) and isinstance(self.sequence_head, ScoreHead)
        token_ids = self.encoder.args.classifier_from_token_ids
        if not token_ids:
            raise ValueError(
                "this causal LM checkpoint has no `score` weights; to serve it with convert='classify' "
                "name the label tokens with hf_overrides={'classifier_from_token': [...]}"
            )
        lm_head = state.get("lm_head.weight")
        if lm_head is None:  # tied embeddings
            lm_head = self.encoder.embed_tokens.weight
        rows = lm_head[list(token_ids)].float()
        if self.encoder.args.classifier_2_way:  # logit(second) - logit(first): vLLM's from_2_way_softmax
            rows = rows[1:] - rows[:1]
        with torch.no_grad():
            self.sequence_head.weight.copy_(rows)
            self.sequence_head.bias.zero_()


def _materialize(model: nn.Module, device: str) -> None:
    """Meta parameters and buffers → uninitialised ones on `device` (shared ones stay shared). `Module.to_empty`
    does the same through `empty_like`, whose meta path imports sympy, which a start does not need."""
    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None:
                    continue
                if id(t) not in made:
                    new = torch.empty(t.shape, dtype=t.dtype, device=device)
                    made[id(t)] = nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new
                table[name] = made[id(t)]  # type: ignore[assignment]


def build_model(model_config: ModelConfig, state: dict[str, torch.Tensor], device: torch.device) -> PoolingModel:
    with torch.device("meta"):
        model = PoolingModel(model_config)
    _materialize(model, "cpu")
    model.load_weights(state)
    model.encoder.to(device=device, dtype=model_config.dtype)
    for head in (model.sequence_head, model.token_head):
        if head is not None:
            head.to(device=device, dtype=torch.float32)
    if isinstance(model.token_head, (MaskedLMHead, ModernBertMaskedLMHead)) and model_config.dtype == torch.bfloat16:
        # A vocabulary-wide decoder is most of a SPLADE model's work: it runs in the trunk's bfloat16 (AMX),
        # its logits in float32; float32 models keep it in float32.
        model.token_head.decoder.to(dtype=model_config.dtype)
    return model.eval().requires_grad_(False)
