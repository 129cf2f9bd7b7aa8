"""Similarity scores between texts, shared by `LLM.score` and the server's score and rerank endpoints.

Pairing follows vLLM's `LLM.score`: 1:1 (two texts), 1:N (one text against a list), N:N (two lists of equal
length, scored pairwise). Embedding models score by the cosine of the two embeddings (each distinct text is
embedded once); cross-encoders (one-label classifiers) score the joint (text_1, text_2) input; late-interaction
models score by MaxSim (Khattab & Zaharia, "ColBERT", SIGIR 2020, https://arxiv.org/abs/2004.12832): for each
query token the best dot product over the document's tokens, summed over query tokens, in float32. text_1 is
encoded in query mode and text_2 in document mode, each text once, so a query's vectors serve all its documents.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .multimodal.image import is_image_object, is_image_prompt


class TemplateTooLong(ValueError):
    """A reranker's chat template alone is longer than max_model_len: no pair can fit."""


class SideError(ValueError):
    """Score sides that do not fit together; `side` (0 or 1) is the one an error names."""

    def __init__(self, message: str, side: int):
        super().__init__(message)
        self.side = side


def pair_indices(n1: int, n2: int, names: tuple[str, str] = ("text_1", "text_2")) -> list[tuple[int, int]]:
    if n1 == 1:
        return [(0, j) for j in range(n2)]
    if n1 == n2:
        return [(i, i) for i in range(n1)]
    message = f"{names[0]} has {n1} items and {names[1]} has {n2}: score takes 1:1, 1:N or N:N (equal lengths)"
    raise SideError(message, 1)


@dataclass
class ScorePlan:
    """What to run for a score request, and how to turn the outputs into one score per pair."""

    prompts: list
    task: str  # "embed" (bi-encoder) or "classify" (cross-encoder)
    pairs: list[tuple[int, int]]
    n1: int

    def origin(self, k: int) -> list[tuple[int, int]]:
        """The (side, item) behind prompt k: both of a cross-encoder's pair, else the one item."""
        if self.task == "classify":
            i, j = self.pairs[k]
            return [(0, i), (1, j)]
        return [(0, k)] if k < self.n1 else [(1, k - self.n1)]

    def describe(self, k: int, item: Callable[[int, int], str]) -> str:
        """Prompt k in the caller's words, `item(side, index)` naming one item: it, or both of a pair."""
        found = self.origin(k)
        return ("the pair of " if len(found) == 2 else "") + " and ".join(item(s, i) for s, i in found)

    def scores(self, outputs: list) -> list[float]:
        if self.task == "classify":
            return [float(o.outputs.data[0]) for o in outputs]
        if self.task == "token_embed":
            queries = [outputs[i].outputs.data for i in range(self.n1)]
            docs = [o.outputs.data for o in outputs[self.n1 :]]
            return maxsim_pairs(queries, docs, self.pairs)
        vecs = torch.stack([o.outputs.data for o in outputs])
        left = vecs[[i for i, _ in self.pairs]]
        right = vecs[[self.n1 + j for _, j in self.pairs]]
        return F.cosine_similarity(left.float(), right.float(), dim=-1).tolist()

    def params(self, base=None) -> list:
        """Per-prompt PoolingParams: late interaction encodes text_1 as queries and text_2 as documents."""
        from .pooling_params import PoolingParams

        base = base or PoolingParams()
        if self.task != "token_embed":
            return [base] * len(self.prompts)
        query = dataclasses.replace(base, input_type="query")
        doc = dataclasses.replace(base, input_type="document")
        return [query] * self.n1 + [doc] * (len(self.prompts) - self.n1)

    def pair_outputs(self, outputs: list) -> list[tuple]:
        """The output(s) each pair's score came from (for token counts)."""
        if self.task == "classify":
            return [(o,) for o in outputs]
        return [(outputs[i], outputs[self.n1 + j]) for i, j in self.pairs]


def truncate_text(text: str, tokenizer: Any, max_tokens: int) -> str:
    """The start of `text` that tokenizes to at most `max_tokens` content tokens (no special tokens), cut at a
    token's character boundary: vLLM's max_tokens_per_query / max_tokens_per_doc, applied to each side's text
    before the model's special tokens, prompts or pair composition. `tokenizer`: a `tokenizers.Tokenizer`."""
    while text:
        enc = tokenizer.encode(text, add_special_tokens=False)
        if len(enc.ids) <= max_tokens:
            break
        end = min(enc.offsets[max_tokens - 1][1], enc.offsets[max_tokens][0]) if max_tokens else 0
        text = text[: min(end, len(text) - 1)]  # re-checked: a cut can merge pieces differently
    return text


def check_token_limits(limits: dict[str, int], max_model_len: int) -> None:
    """vLLM's check of max_tokens_per_query / max_tokens_per_doc: SideError (0: the query's, 1: the document's)."""
    for side, (name, most) in enumerate(limits.items()):
        if most < 0:
            raise SideError(f"{name} must be a non-negative integer", side)
        if most >= max_model_len:
            raise SideError(f"{name} ({most}) must be less than max_model_len ({max_model_len}).", side)


def cut_side(side: Any, most: int, tokenizer: Any) -> Any:
    """One side of a score call with its texts cut to `most` content tokens (`truncate_text`; 0: as it is);
    other items (images, content parts, token ids) unchanged."""
    if not most:
        return side

    def cut(item: Any) -> Any:
        return truncate_text(item, tokenizer, most) if isinstance(item, str) and not is_image_prompt(item) else item

    return cut(side) if isinstance(side, str) else [cut(x) for x in side]


def iter_maxsim(queries: list[torch.Tensor], docs: list[torch.Tensor], chunk: int = 128, budget: int = 1 << 25):
    """Exact MaxSim of every query against every document, one document chunk at a time.

    Yields `(doc_index, scores)`: the chunk's document positions [n] and their scores [n_queries, n]. All query
    tokens are concatenated (no padding) into one [Tq, d] matrix. Documents are visited in length order and each
    chunk is padded to its longest document by repeating the document's own first vector (a duplicate cannot
    change a max, so no mask is needed). One matmul per block of query tokens gives [Tq, n, Ld] (the block keeps
    it under `budget` floats); the max over Ld and a per-query sum over its tokens give the scores, in float32.
    """
    q_flat = torch.cat([x.float() for x in queries])  # [Tq, d]
    owner = torch.repeat_interleave(torch.arange(len(queries)), torch.tensor([x.shape[0] for x in queries]))
    order = sorted(range(len(docs)), key=lambda i: docs[i].shape[0])
    for start in range(0, len(order), chunk):
        ids = order[start : start + chunk]
        width = max(docs[i].shape[0] for i in ids)
        padded = torch.stack(
            [torch.cat([docs[i], docs[i][:1].expand(width - docs[i].shape[0], -1)]).float() for i in ids]
        )  # [n, Ld, d]
        n = len(ids)
        flat = padded.reshape(n * width, -1).T  # [d, n*Ld]
        block = max(1, budget // (n * width))
        per_token = torch.cat(
            [(q_flat[t : t + block] @ flat).view(-1, n, width).amax(dim=2) for t in range(0, q_flat.shape[0], block)]
        )  # [Tq, n]
        yield torch.tensor(ids), q_flat.new_zeros(len(queries), n).index_add_(0, owner, per_token)


def maxsim_pairs(queries: list[torch.Tensor], docs: list[torch.Tensor], pairs: list[tuple[int, int]]) -> list[float]:
    """MaxSim for each (query, document) pair; each query's vectors serve all its documents."""
    matrix = torch.empty(len(queries), len(docs))
    for doc_index, scores in iter_maxsim(queries, docs):
        matrix[:, doc_index] = scores
    return [float(matrix[i, j]) for i, j in pairs]


def _items(side: Any) -> list[Any]:
    """One side of a score call as a list: a text, a prompt dict or an image (PIL or bytes) is one item."""
    return [side] if isinstance(side, (str, dict)) or is_image_object(side) else list(side)


Compose = Callable[[str, str], str]
"""A cross-encoder's one text for a (query, document) pair of texts, where it is not the tokenizer's text pair."""


def pair_template(model_config: Any, cross_encoder: bool, given: str | None) -> tuple[str | None, dict[str, Any], bool]:
    """A cross-encoder's pair template, its saved variables and whether the rendered pair gets the tokenizer's
    special tokens: the one given (--chat-template, LLM.score(chat_template=); yes, as vLLM tokenizes it), else
    the one a sentence-transformers CrossEncoder's config names (no, as sentence-transformers renders it; a
    ValueError where the checkpoint lacks it), else none (the text pair)."""
    saved = model_config.score_template
    if not cross_encoder or given is not None or saved is None:
        return (given if cross_encoder else None), {}, True
    if saved.template is None:
        raise ValueError(
            f"{model_config.path / 'sentence_bert_config.json'} declares message inputs, but the checkpoint has no "
            f"{saved.name!r} chat template: give one (--chat-template, LLM.score(chat_template=))"
        )
    return saved.template, dict(saved.variables), False


def pair_composer(
    hf_config: dict[str, Any],
    template: str | None,
    special_tokens: dict[str, str] | None = None,
    variables: dict[str, Any] | None = None,
    fit_to: tuple[Any, int] | None = None,
    special_tokens_added: bool = True,
) -> Compose | None:
    """How a cross-encoder joins a pair of texts, as vLLM 0.34 does: through a chat template given explicitly
    (`--chat-template`, `LLM.score(chat_template=)`: messages of roles "query" and "document", e.g. the
    Qwen3-Reranker template), else, for an LLM served as reranker (`use_sep_token` false, what vLLM's `method`
    recipes set), the two texts joined without a separator; None: the tokenizer's text pair. `fit_to`: a
    `tokenizers.Tokenizer` and the most tokens a prompt may have: a rendered pair longer than that has its
    document cut so that it fits, the template's words after the document kept (cut from the end, they would be
    lost, and the score read in the middle of the document), counted with the special tokens the pair gets
    (`special_tokens_added`)."""
    if template is not None:
        from .chat import render

        given = dict(variables or {})  # apply_chat_template's own options among them, as vLLM passes them on
        options = {k: bool(given.pop(k)) for k in ("add_generation_prompt", "continue_final_message") if k in given}

        def rendered(query: str, document: str) -> str:
            roles = [{"role": "query", "content": query}, {"role": "document", "content": document}]
            # plain string content, as vLLM hands score templates their texts (no content-format conversion)
            return render(
                template,
                roles,
                special_tokens=special_tokens,
                variables=given,
                content_format_option="string",
                **options,
            )

        if fit_to is None:
            return rendered
        tokenizer, most = fit_to

        def fitted(query: str, document: str) -> str:
            text = rendered(query, document)
            for _ in range(6):  # the document first, then the query; a cut can tokenize a little differently
                over = len(tokenizer.encode(text, add_special_tokens=special_tokens_added).ids) - most
                if over <= 0:
                    return text
                doc = len(tokenizer.encode(document, add_special_tokens=False).ids)
                if doc:
                    document = truncate_text(document, tokenizer, max(doc - over, 0))
                else:
                    kept = len(tokenizer.encode(query, add_special_tokens=False).ids) - over
                    query = truncate_text(query, tokenizer, max(kept, 0))
                text = rendered(query, document)
            if len(tokenizer.encode(text, add_special_tokens=special_tokens_added).ids) > most:
                raise TemplateTooLong(f"the chat template's own words exceed max_model_len={most}: no pair can fit")
            return text

        return fitted
    if not hf_config.get("use_sep_token", True):
        return lambda query, document: query + document
    return None


def plan_scores(
    text_1,
    text_2,
    supported_tasks: tuple[str, ...],
    cross_encoder: bool,
    late_interaction: bool = False,
    names: tuple[str, str] = ("text_1", "text_2"),
    compose: Compose | None = None,
) -> ScorePlan:
    """`names`: the sides as the caller's request calls them, for SideError's messages; `compose`: a
    cross-encoder's pair of texts as one text (see pair_composer)."""
    texts_1, texts_2 = _items(text_1), _items(text_2)
    for side, texts in enumerate((texts_1, texts_2)):
        if not texts:
            raise SideError(f"{names[side]} is empty: score needs at least one item on each side", side)
    pairs = pair_indices(len(texts_1), len(texts_2), names)
    if cross_encoder:
        for side, texts in enumerate((texts_1, texts_2)):  # as vLLM: a text-only model's pairs are of texts
            bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
            if bad is not None:
                raise SideError(
                    f"{names[side]} item {bad} is a {type(texts[bad]).__name__}, not a text: a cross-encoder scores "
                    "pairs of texts",
                    side,
                )
            bad = next((i for i, t in enumerate(texts) if is_image_prompt(t)), None)
            if bad is not None:  # an image_url part arrives as its data: URL; never score it as text
                raise SideError(
                    f"{names[side]} item {bad} is an image (a data:image URL); this model reads text only", side
                )
        joined = [
            compose(q, d) if compose is not None and isinstance(q, str) and isinstance(d, str) else (q, d)
            for q, d in ((texts_1[i], texts_2[j]) for i, j in pairs)
        ]
        return ScorePlan(joined, "classify", pairs, len(texts_1))
    if late_interaction:
        return ScorePlan(texts_1 + texts_2, "token_embed", pairs, len(texts_1))
    if "embed" not in supported_tasks:
        raise ValueError(
            f"score needs an embedding model or a cross-encoder (one-label classifier); this "
            f"model supports: {', '.join(supported_tasks)}"
        )
    return ScorePlan(texts_1 + texts_2, "embed", pairs, len(texts_1))


def lexical_matching_score(a, b) -> float:
    """bge-m3's lexical matching score of two sparse outputs (`SparseEmbeddingOutput`): the sum over the
    vocabulary ids both hold of the product of their weights (a sparse dot product)."""
    return float((a.data * b.data).sum())


def colbert_score(query: torch.Tensor, doc: torch.Tensor) -> float:
    """bge-m3's multi-vector score: MaxSim summed over the query's vectors, divided by their number."""
    return float((query.float() @ doc.float().T).max(dim=1).values.sum() / query.shape[0])


def bge_m3_score(dense: float, sparse: float, colbert: float, weights=(0.4, 0.2, 0.4)) -> float:
    """bge-m3's combined score: FlagEmbedding's weighted sum of the dense, sparse and multi-vector scores, divided
    by the weights' sum; the default weights are the bge-m3 model card's (FlagEmbedding's compute_score defaults
    to equal weights: pass (1, 1, 1) for its numbers)."""
    w = list(weights)
    return (w[0] * dense + w[1] * sparse + w[2] * colbert) / sum(w)
