"""The ColBERT late-interaction recipe: query/document markers, query expansion and the document skiplist,
with its tokens resolved to ids once per engine (PyLate's `tokenize` / Stanford's tokenizers)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import ModelConfig
from ..tokenizer import PolyTokenizer
from .request import Request


@dataclass
class LateInteractionRecipe:
    """A ColBERT recipe with its tokens resolved to ids."""

    config: Any
    query_id: int
    document_id: int
    mask_id: int
    skip_ids: frozenset[int]

    @classmethod
    def resolve(cls, model_config: ModelConfig, tokenizer: PolyTokenizer) -> LateInteractionRecipe | None:
        """The model's recipe, or None when it is not a ColBERT model."""
        cb = model_config.colbert
        if cb is None:
            return None
        if cb.layout in ("vllm", "colqwen2"):  # no markers, expansion or skiplist (ColQwen2: prompt text instead)
            return cls(cb, -1, -1, -1, frozenset())
        ids = {}
        for name, token in (("query", cb.query_prefix), ("document", cb.document_prefix), ("mask", "[MASK]")):
            found = tokenizer.token_to_id(token)
            if found is None and token.strip() != token:
                found = tokenizer.token_to_id(token.strip())
            if found is None:
                raise ValueError(f"the ColBERT {name} token {token!r} is not in the tokenizer's vocabulary")
            ids[name] = found
        unk = tokenizer.token_to_id("[UNK]")
        skip = {unk if i is None else i for i in (tokenizer.token_to_id(w) for w in cb.skiplist_words)}
        return cls(cb, ids["query"], ids["document"], ids["mask"], frozenset(i for i in skip if i is not None))

    @property
    def inserts_marker(self) -> bool:
        """Whether a query/document marker goes after [CLS] (PyLate, Stanford; not vLLM's layout)."""
        return self.config.layout not in ("vllm", "colqwen2")

    def length(self, input_type: str | None) -> int:
        return self.config.query_length if input_type == "query" else self.config.document_length

    def apply(self, request: Request) -> None:
        """Insert the mode's marker after [CLS]; expand queries with [MASK]; mark document skiplist tokens."""
        cb, ids = self.config, request.prompt_token_ids
        mode = request.params.input_type or "document"
        if not self.inserts_marker:
            request.input_type = mode
            return
        ids = ids[:1] + [self.query_id if mode == "query" else self.document_id] + ids[1:]
        types = request.token_type_ids
        if types is not None:
            types = types[:1] + [0] + types[1:]
        if mode == "query" and cb.do_query_expansion and len(ids) < cb.query_length:
            if not cb.attend_to_expansion_tokens:
                request.num_key_tokens = len(ids)
            extra = cb.query_length - len(ids)
            ids = ids + [self.mask_id] * extra
            types = None if types is None else types + [0] * extra
        elif mode == "document":
            keep = [i for i, t in enumerate(ids) if t not in self.skip_ids]
            request.keep = keep if len(keep) < len(ids) else None
        request.prompt_token_ids, request.token_type_ids, request.input_type = ids, types, mode
