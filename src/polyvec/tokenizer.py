"""Tokenization with the `tokenizers` library, with sentence-transformers' truncation semantics.

Truncation keeps the special tokens ([CLS] ... [SEP]) and cuts the text on the right, as a transformers
tokenizer called with `truncation=True, max_length=n` does, or on the left (`truncation_side="left"`: keep the
last tokens, transformers' `truncation_side`). The `tokenizers` object carries its truncation setting as mutable
state, so each length and side gets its own configured copy: encoding stays safe to call from several threads
at once (the server tokenizes in worker threads). Prompts need no character offsets, so they come from
`encode_batch_fast`, which skips computing them (the same ids as `encode_batch`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast

from tokenizers import Tokenizer


@dataclass
class TokenizedPrompt:
    input_ids: list[int]
    token_type_ids: list[int] | None
    """Segment ids; None when all are 0 (single texts), which the model runner then does not look up."""
    num_input_tokens: int
    """Length before truncation (what the caller sent, in tokens)."""


def _prompt(enc, num_input_tokens: int) -> TokenizedPrompt:
    types = enc.type_ids  # `ids` and `type_ids` are fresh lists; all-zero segment ids are left out
    return TokenizedPrompt(enc.ids, types if any(types) else None, num_input_tokens)


TruncationSide = Literal["left", "right"]
"""Which end truncation cuts: "right" keeps the first tokens (the default), "left" the last ones."""


class PromptTooLongError(ValueError):
    def __init__(self, index: int, num_tokens: int, max_length: int):
        super().__init__(f"input {index} has {num_tokens} tokens, more than the maximum of {max_length}")
        self.index, self.num_tokens, self.max_length = index, num_tokens, max_length


def _cut(seq: list[int], max_length: int, left: bool) -> list[int]:
    return seq[max(len(seq) - max_length, 0) :] if left else seq[:max_length]


class PolyTokenizer:
    def __init__(self, path: Path, do_lower_case: bool = False, model_max_length: int | None = None):
        if path.name == "vocab.txt":
            from tokenizers.implementations import BertWordPieceTokenizer

            base = BertWordPieceTokenizer(str(path), lowercase=True)._tokenizer
        else:
            base = Tokenizer.from_file(str(path))
        # Checkpoints often ship tokenizer.json with padding/truncation baked in; the engine packs sequences
        # itself and truncates explicitly.
        base.no_padding()
        base.no_truncation()
        self._base = base
        self._serialized = base.to_str()
        self._truncating: dict[tuple[int, str], Tokenizer] = {}
        self._lock = threading.Lock()
        self.do_lower_case = do_lower_case
        self.model_max_length = model_max_length

    @property
    def vocab_size(self) -> int:
        return self._base.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._base.token_to_id(token)

    def _truncating_copy(self, max_length: int, side: TruncationSide = "right") -> Tokenizer:
        key = (max_length, side)
        tok = self._truncating.get(key)
        if tok is None:
            with self._lock:
                tok = self._truncating.get(key)
                if tok is None:
                    tok = Tokenizer.from_str(self._serialized)
                    tok.enable_truncation(max_length, strategy="longest_first", direction=side)
                    self._truncating[key] = tok
        return tok

    def encode(
        self,
        texts: Sequence[str | tuple[str, str]],
        max_length: int,
        truncate: bool,
        add_special_tokens: bool = True,
        truncation_side: TruncationSide = "right",
    ) -> list[TokenizedPrompt]:
        """Encode strings (or string pairs); with `truncate=False`, over-long input raises PromptTooLongError;
        with `truncate`, the text is cut at `truncation_side`, special tokens kept."""
        if self.do_lower_case:
            texts = [t.lower() if isinstance(t, str) else (t[0].lower(), t[1].lower()) for t in texts]
        if truncate and max_length < self._num_special(any(isinstance(t, tuple) for t in texts), add_special_tokens):
            # Too short for the special tokens themselves, where `tokenizers` would not cut at all: keep the
            # first (left: last) max_length tokens, as token-id prompts are cut.
            full = self._base.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
            left = truncation_side == "left"
            return [
                TokenizedPrompt(
                    _cut(enc.ids, max_length, left),
                    _cut(enc.type_ids, max_length, left) if any(enc.type_ids) else None,
                    len(enc.ids),
                )
                for enc in full
            ]
        if truncate and all(isinstance(t, str) for t in texts):
            return self._encode_truncating(cast(Sequence[str], texts), max_length, add_special_tokens, truncation_side)
        full = self._base.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
        out: list[TokenizedPrompt] = []
        too_long = [i for i, enc in enumerate(full) if len(enc.ids) > max_length]
        if too_long and not truncate:
            i = too_long[0]
            raise PromptTooLongError(i, len(full[i].ids), max_length)
        cut = dict(
            zip(
                too_long,
                self._truncating_copy(max_length, truncation_side).encode_batch_fast(
                    [texts[i] for i in too_long], add_special_tokens=add_special_tokens
                ),
            )
        )
        for i, enc in enumerate(full):
            used = cut.get(i, enc)
            out.append(_prompt(used, len(enc.ids)))
        return out

    def _num_special(self, pair: bool, add_special_tokens: bool) -> int:
        processor = self._base.post_processor
        return processor.num_special_tokens_to_add(pair) if add_special_tokens and processor else 0

    def _encode_truncating(
        self, texts: Sequence[str], max_length: int, add_special_tokens: bool, side: TruncationSide = "right"
    ) -> list[TokenizedPrompt]:
        """Single texts, cut to max_length in one pass (a full pass, then the long texts again, took 1.2-1.5x
        as long on Cranfield plus Vaswani): the length before truncation is the kept part plus the
        `overflowing` pieces the truncating tokenizer returns, each less the special tokens it also gets."""
        processor = self._base.post_processor
        special = processor.num_special_tokens_to_add(False) if add_special_tokens and processor else 0
        # Either side, the overflowing pieces partition the cut-off tokens (stride 0).
        encoded = self._truncating_copy(max_length, side).encode_batch_fast(
            texts, add_special_tokens=add_special_tokens
        )
        return [_prompt(enc, len(enc.ids) + sum(len(o.ids) - special for o in enc.overflowing)) for enc in encoded]

    def tokenize(self, text: str, add_special_tokens: bool = True) -> tuple[list[int], list[str]]:
        if self.do_lower_case:
            text = text.lower()
        enc = self._base.encode(text, add_special_tokens=add_special_tokens)
        return list(enc.ids), list(enc.tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._base.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self._base.id_to_token(i)
