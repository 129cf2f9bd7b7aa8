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
    query_id: int | None  # None: no marker for that mode (PyLate's empty prefix)
    document_id: int | None
    mask_id: int | None  # what query expansion pads with (None: no expansion)
    skip_ids: frozenset[int]

    @classmethod
    def resolve(cls, model_config: ModelConfig, tokenizer: PolyTokenizer) -> LateInteractionRecipe | None:
        """The model's recipe, or None when it is not a ColBERT model."""
        cb = model_config.colbert
        if cb is None:
            return None
        if cb.layout in ("vllm", "colqwen2"):  # no markers, expansion or skiplist (ColQwen2: prompt text instead)
            return cls(cb, None, None, None, frozenset())
        ids: dict[str, int | None] = {}
        for name, token in (("query", cb.query_prefix), ("document", cb.document_prefix)):
            if not token:  # PyLate: an empty prefix inserts nothing
                ids[name] = None
                continue
            found = tokenizer.token_to_id(token)
            if found is None and token.strip() != token:
                found = tokenizer.token_to_id(token.strip())
            if found is None:
                raise ValueError(f"the ColBERT {name} token {token!r} is not in the tokenizer's vocabulary")
            ids[name] = found
        mask = None
        if cb.do_query_expansion:  # PyLate pads queries with the mask token, else EOS, else the pad token
            names = ("mask_token", "eos_token", "pad_token")
            mask = next((i for i in map(tokenizer.special_token_id, names) if i is not None), None)
            if mask is None:
                mask = tokenizer.token_to_id("[MASK]")
            if mask is None:
                raise ValueError("query expansion needs a mask, EOS or pad token, and the tokenizer has none")
        unk = tokenizer.special_token_id("unk_token")
        unk = tokenizer.token_to_id("[UNK]") if unk is None else unk
        skip = {unk if i is None else i for i in (tokenizer.token_to_id(w) for w in cb.skiplist_words)}
        return cls(cb, ids["query"], ids["document"], mask, frozenset(i for i in skip if i is not None))

    @property
    def edits_tokens(self) -> bool:
        """Whether the recipe adds or drops tokens (markers, query expansion, skiplist; an image model's prompt):
        vLLM's ColBERT layout keeps the text's tokens as they are."""
        return self.config.layout != "vllm"

    @property
    def inserts_marker(self) -> bool:
        """Whether a query/document marker goes after [CLS] (PyLate, Stanford; not vLLM's layout)."""
        return self.config.layout not in ("vllm", "colqwen2")

    def length(self, input_type: str | None) -> int:
        return self.config.query_length if input_type == "query" else self.config.document_length

    def marker(self, input_type: str | None) -> int | None:
        """The token inserted after [CLS] in this mode, if any."""
        if not self.inserts_marker:
            return None
        return self.query_id if input_type == "query" else self.document_id

    def apply(self, request: Request) -> None:
        """Insert the mode's marker after [CLS]; expand queries with [MASK]; mark document skiplist tokens."""
        cb, ids = self.config, request.prompt_token_ids
        mode = request.params.input_type or "document"
        if not self.inserts_marker:
            request.input_type = mode
            return
        types = request.token_type_ids
        marker = self.marker(mode)
        if marker is not None:
            ids = ids[:1] + [marker] + ids[1:]
            types = None if types is None else types[:1] + [0] + types[1:]
        if mode == "query" and self.mask_id is not None and len(ids) < cb.query_length:
            if not cb.attend_to_expansion_tokens:
                request.num_key_tokens = len(ids)
            extra = cb.query_length - len(ids)
            ids = ids + [self.mask_id] * extra
            types = None if types is None else types + [0] * extra
        elif mode == "document":
            keep = [i for i, t in enumerate(ids) if t not in self.skip_ids]
            request.keep = keep if len(keep) < len(ids) else None
        request.prompt_token_ids, request.token_type_ids, request.input_type = ids, types, mode
