"""Tokenization with the `tokenizers` library, with sentence-transformers' truncation semantics.

Truncation keeps the special tokens ([CLS] ... [SEP]) and cuts the text on the right, as a transformers
tokenizer called with `truncation=True, max_length=n` does, or on the left (`truncation_side="left"`: keep the
last tokens, transformers' `truncation_side`). The `tokenizers` object carries its truncation setting as mutable
state, so each length and side gets its own configured copy: encoding stays safe to call from several threads
at once (the server tokenizes in worker threads). Prompts need no character offsets, so they come from
`encode_batch_fast`, which skips computing them (the same ids as `encode_batch`).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, cast

from tokenizers import AddedToken, Tokenizer, normalizers


@dataclass
class TokenizedPrompt:
    input_ids: list[int]
    token_type_ids: list[int] | None
    """Segment ids; None when all are 0 (single texts), which the model runner then does not look up."""
    num_input_tokens: int
    """Length before truncation (what the caller sent, in tokens); for a text being cut that is over 256 Ki
    characters (and 32 per token kept), the length of the part of it read (_PART_CHARS)."""


def _prompt(enc, num_input_tokens: int) -> TokenizedPrompt:
    types = enc.type_ids  # `ids` and `type_ids` are fresh lists; all-zero segment ids are left out
    return TokenizedPrompt(enc.ids, types if any(types) else None, num_input_tokens)


TruncationSide = Literal["left", "right"]
"""Which end truncation cuts: "right" keeps the first tokens (the default), "left" the last ones."""


_CHARS_PER_TOKEN = 32
_PART_CHARS = 1 << 18
"""A text being cut that is longer than these (characters per token kept, or characters) is read in part (see
PolyTokenizer._part); its length before truncation is then that of the part."""
_GROUP_CHARS = 1 << 20


def _word_boundary(text: str, positions: range) -> int | None:
    """The first position (in the order given) of a space with a character other than whitespace on each side:
    where a text can be cut into words that tokenize as in the whole (see PolyTokenizer._part)."""
    for i in positions:
        if text[i] == " " and not text[i - 1].isspace() and not text[i + 1].isspace():
            return i
    return None


def _splits_at_spaces(serialized: str) -> bool:
    """Whether a tokenizer (its JSON) pre-tokenizes at spaces, so that words are tokenized each on their own: BERT's,
    byte-level BPE's regex, Metaspace that splits, whitespace splitters; not a model run over the whole text
    (SentencePiece tokenizers with no pre-tokenizer)."""
    splitting = {"BertPreTokenizer", "Whitespace", "WhitespaceSplit"}

    def splits(pre: Any) -> bool:
        if not isinstance(pre, dict):
            return False
        kind = pre.get("type")
        if kind == "Sequence":
            return any(splits(p) for p in pre.get("pretokenizers") or ())
        if kind == "ByteLevel":
            return bool(pre.get("use_regex", True))
        if kind == "Metaspace":
            return bool(pre.get("split", True))
        return kind in splitting

    return splits(json.loads(serialized).get("pre_tokenizer"))


def _groups(items: list[int], sizes: list[int], most: int) -> list[list[int]]:
    """`items` in order, in consecutive groups of at most `most` total size (an item larger alone)."""
    groups: list[list[int]] = [[]]
    total = 0
    for item, size in zip(items, sizes):
        if groups[-1] and total + size > most:
            groups.append([])
            total = 0
        groups[-1].append(item)
        total += size
    return [g for g in groups if g]


class PromptTooLongError(ValueError):
    def __init__(self, index: int, num_tokens: int, max_length: int, at_least: bool = False):
        """`at_least`: `num_tokens` counts a part of the text only (a huge one), the whole has more."""
        has = f"at least {num_tokens}" if at_least else str(num_tokens)
        super().__init__(f"input {index} has {has} tokens, more than the maximum of {max_length}")
        self.index, self.num_tokens, self.max_length, self.at_least = index, num_tokens, max_length, at_least


_CLEAN_UP = [(" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m")]
_CLEAN_UP += [(" 's", "'s"), (" 've", "'ve"), (" 're", "'re")]


def _cut(seq: list[int], max_length: int, left: bool) -> list[int]:
    return seq[max(len(seq) - max_length, 0) :] if left else seq[:max_length]


def _read_config(path: Path) -> dict[str, Any]:
    """A tokenizer's JSON settings file ({} when there is none)."""
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _wordpiece_options(folder: Path) -> dict[str, Any]:
    """A BERT-family tokenizer's normalizer settings from tokenizer_config.json, with transformers' BertTokenizer
    defaults (lowercase, accents stripped when lowercasing, CJK characters split)."""
    cfg = _read_config(folder / "tokenizer_config.json")
    return {
        "lowercase": bool(cfg.get("do_lower_case", True)),
        "strip_accents": cfg.get("strip_accents"),
        "handle_chinese_chars": bool(cfg.get("tokenize_chinese_chars", True)),
    }


_BERT_FAMILY = ("Bert", "DistilBert", "Electra", "MPNet", "SqueezeBert", "LayoutLM", "Funnel", "Lxmert", "MobileBert",
                "ConvBert")  # fmt: skip
_BERT_CLASSES = {f"{name}Tokenizer{fast}" for name in _BERT_FAMILY for fast in ("", "Fast")}
_BERT_MODEL_TYPES = {name.lower() for name in _BERT_FAMILY}  # where tokenizer_config.json names no class


def _bert_normalizer(base: Tokenizer, folder: Path) -> None:
    """transformers' BERT-family tokenizers take do_lower_case, strip_accents and tokenize_chinese_chars from
    tokenizer_config.json (do_lower_case true where it says nothing) over tokenizer.json's normalizer, which they
    rebuild where the two differ: so here too, or the same folder tokenizes otherwise ("Hello" whole against
    [UNK] in a cased vocabulary)."""
    cfg = _read_config(folder / "tokenizer_config.json")
    named = cfg.get("tokenizer_class")
    if named is None:  # transformers picks the class by config.json's model_type then
        if _read_config(folder / "config.json").get("model_type") not in _BERT_MODEL_TYPES:
            return
    elif named not in _BERT_CLASSES:
        return
    state = json.loads(base.to_str()).get("normalizer") or {}
    if state.get("type") != "BertNormalizer":
        return
    want = _wordpiece_options(folder)  # BertTokenizer's reading of the config, its defaults included
    if any(state.get(k) != v for k, v in want.items()):
        base.normalizer = normalizers.BertNormalizer(clean_text=bool(state.get("clean_text", True)), **want)


_BERT_SPECIAL = {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
                 "mask_token": "[MASK]"}  # fmt: skip


@lru_cache(maxsize=8)
def special_tokens_map(folder: Path) -> dict[str, str]:
    """bos_token, cls_token, mask_token, ... of the tokenizer in `folder` (tokenizer_config.json's, those of
    special_tokens_map.json first where both name one, as transformers loads them)."""
    config = {**_read_config(folder / "tokenizer_config.json"), **_read_config(folder / "special_tokens_map.json")}
    if not (folder / "tokenizer.json").is_file() and (folder / "vocab.txt").is_file():
        config = {**_BERT_SPECIAL, **config}  # a vocab.txt-only tokenizer is BertTokenizer, with its defaults
    tokens = {}
    for key, value in config.items():
        if key.endswith("_token") and isinstance(value, dict):
            value = value.get("content")
        if key.endswith("_token") and isinstance(value, str):
            tokens[key] = value
    return tokens


_SPECIAL_ATTRIBUTES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_list(value: Any) -> list[Any]:
    """additional_special_tokens / extra_special_tokens: a list, or (transformers 5) a dict of named tokens."""
    return list(value.values()) if isinstance(value, dict) else list(value) if isinstance(value, list) else []


def _declared_tokens(folder: Path) -> list[AddedToken]:
    """The added and special tokens a checkpoint declares outside tokenizer.json, in the order transformers adds
    the missing ones: tokenizer_config.json's added_tokens_decoder by id, the named special tokens, the extra
    ones. Without them a text's "<extra>" would be split into pieces where transformers keeps one token."""
    config = _read_config(folder / "tokenizer_config.json")
    declared: list[AddedToken] = []
    decoder = config.get("added_tokens_decoder")
    if isinstance(decoder, dict):
        for _, spec in sorted(decoder.items(), key=lambda item: int(item[0]) if str(item[0]).isdigit() else 0):
            if isinstance(spec, dict) and isinstance(spec.get("content"), str):
                options = ("single_word", "lstrip", "rstrip", "normalized", "special")
                declared.append(AddedToken(spec["content"], **{k: bool(spec[k]) for k in options if k in spec}))
    added = _read_config(folder / "added_tokens.json")  # older checkpoints' {token: id}, read by transformers too
    for text, _ in sorted(added.items(), key=lambda item: item[1] if isinstance(item[1], int) else 0):
        declared.append(AddedToken(str(text), special=False, normalized=True))
    named = special_tokens_map(folder)
    declared += [AddedToken(named[k], special=True, normalized=False) for k in _SPECIAL_ATTRIBUTES if k in named]
    smap = _read_config(folder / "special_tokens_map.json")
    for key in ("additional_special_tokens", "extra_special_tokens"):
        for token in _token_list(smap.get(key)) or _token_list(config.get(key)):
            content = token.get("content") if isinstance(token, dict) else token
            if isinstance(content, str):
                declared.append(AddedToken(content, special=True, normalized=False))
    return declared


def _add_declared_tokens(base: Tokenizer, folder: Path) -> None:
    """Adds the declared tokens tokenizer.json lacks, as transformers does when it loads the tokenizer (a token
    of the vocabulary keeps its id; a new one is numbered after it)."""
    present = {token.content for token in base.get_added_tokens_decoder().values()}
    missing: list[AddedToken] = []
    for token in _declared_tokens(folder):
        if token.content not in present:
            present.add(token.content)
            missing.append(token)
    if missing:
        base.add_tokens(missing)


class PolyTokenizer:
    def __init__(self, path: Path, do_lower_case: bool = False, model_max_length: int | None = None):
        self.path = path
        if path.name == "vocab.txt":
            from tokenizers.implementations import BertWordPieceTokenizer

            named: dict[str, Any] = special_tokens_map(path.parent)  # a checkpoint's own [CLS], [SEP], ...
            special = {k: named[k] for k in _BERT_SPECIAL}
            base = BertWordPieceTokenizer(str(path), **_wordpiece_options(path.parent), **special)._tokenizer
        else:
            base = Tokenizer.from_file(str(path))
            _bert_normalizer(base, path.parent)
        # Checkpoints often ship tokenizer.json with padding/truncation baked in; the engine packs sequences
        # itself and truncates explicitly.
        base.no_padding()
        base.no_truncation()
        _add_declared_tokens(base, path.parent)
        self._base = base
        self._serialized = base.to_str()
        self._splits_at_spaces = _splits_at_spaces(self._serialized)
        self._truncating: dict[tuple[int, str], Tokenizer] = {}
        self._lock = threading.Lock()
        self.do_lower_case = do_lower_case
        self.model_max_length = model_max_length
        cfg = _read_config(path.parent / "tokenizer_config.json")
        side = cfg.get("truncation_side", "right")
        if side not in ("left", "right"):  # transformers refuses it too
            raise ValueError(
                f"{path.parent / 'tokenizer_config.json'}: truncation_side must be 'left' or 'right', got {side!r}"
            )
        # where a text is cut unless a request says (transformers' and vLLM's default: the tokenizer's own side)
        self.default_truncation_side: TruncationSide = side
        # transformers' decode: the WordPiece-era clean-up where the config asks for it (never on BPE, unless forced)
        self.clean_up_spaces = bool(cfg.get("clean_up_tokenization_spaces")) and (
            type(base.model).__name__ != "BPE"
            or bool(cfg.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"))
        )

    @property
    def vocab_size(self) -> int:
        return self._base.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._base.token_to_id(token)

    def special_token_id(self, name: str) -> int | None:
        """The id of the special token `name` (cls_token, mask_token, pad_token, ...), None where there is none."""
        token = special_tokens_map(self.path.parent).get(name)
        return None if token is None else self._base.token_to_id(token)

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

    def encode_prompts(
        self,
        texts: Sequence[str | tuple[str, str]],
        max_length: int,
        truncate: bool,
        add_special_tokens: bool = True,
        truncation_side: TruncationSide = "right",
        lower_case: bool | None = None,
    ) -> list[TokenizedPrompt]:
        """Encode strings (or string pairs); with `truncate=False`, over-long input raises PromptTooLongError;
        with `truncate`, the text is cut at `truncation_side`, special tokens kept. `lower_case`: lowercase the
        texts first (None: as the model's do_lower_case says)."""
        if self.do_lower_case if lower_case is None else lower_case:
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
        if not truncate and max_length < 1 << 40:  # refused if too long: a huge text's part may show it already
            most = max(max_length * _CHARS_PER_TOKEN, _PART_CHARS)
            for i, text in enumerate(texts):
                seen = self._part_length(text, most, add_special_tokens) if isinstance(text, str) else None
                if seen is not None and seen > max_length:
                    raise PromptTooLongError(i, seen, max_length, at_least=True)
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
        tok = self._truncating_copy(max_length, side)
        most = max(max_length * _CHARS_PER_TOKEN, _PART_CHARS)
        content = max_length - special
        out: list[Any] = [None] * len(texts)
        whole = []
        for i, text in enumerate(texts):
            part = self._part(tok, text, most, content, add_special_tokens, side) if len(text) > most else None
            if part is not None:
                out[i] = _prompt(part, len(part.ids) + sum(len(o.ids) - special for o in part.overflowing))
            else:
                whole.append(i)
        # In groups of characters: each token cut off is an Encoding of its own until its group is counted
        for group in _groups(whole, [len(texts[i]) for i in whole], _GROUP_CHARS):
            encoded = tok.encode_batch_fast([texts[i] for i in group], add_special_tokens=add_special_tokens)
            for i, enc in zip(group, encoded):
                # Either side, the overflowing pieces partition the cut-off tokens (stride 0).
                out[i] = _prompt(enc, len(enc.ids) + sum(len(o.ids) - special for o in enc.overflowing))
        return out

    def _part_length(self, text: str, most: int, add_special_tokens: bool) -> int | None:
        """The tokens of a text of more than `most` characters up to its last word boundary within them (fewer
        than the whole text's: the same tokens, up to that word; see _part); None for a shorter text, or where
        that cannot be shown."""
        head = self._piece(text, most, "right") if len(text) > most else None
        return None if head is None else len(self._base.encode(head, add_special_tokens=add_special_tokens).ids)

    def _piece(self, text: str, most: int, side: TruncationSide) -> str | None:
        """The text up to its last (left: from its first) word boundary within `most` characters, where this
        tokenizer splits words: a single space between two other characters. None where there is none."""
        if not self._splits_at_spaces:
            return None
        if side == "right":
            cut = _word_boundary(text, range(min(most, len(text) - 2), max(most // 2, 1), -1))
            return None if cut is None else text[:cut]
        start = len(text) - most
        cut = _word_boundary(text, range(start, min(start + most // 2, len(text) - 1)))
        return None if cut is None else text[cut:]

    def _part(
        self, tok: Tokenizer, text: str, most: int, content: int, add_special_tokens: bool, side: TruncationSide
    ) -> Any:
        """A text of more than `most` characters, truncated from a part of it (`_piece`) rather than tokenized
        whole: words are tokenized each on their own, so the part's tokens are the whole text's, up to that word.
        None where that cannot be shown: no such part, or too few tokens in it to be cut there."""
        part = self._piece(text, most, side)
        if part is None:
            return None
        enc = tok.encode(part, add_special_tokens=add_special_tokens)
        # Left, the part's first word is read without what came before it (a Strip normalizer, an added token's
        # rstrip would read it otherwise): only tokens after it may be kept
        first = (part.find(" ", 1) % (len(part) + 1)) if side == "left" else 0  # no other word: none kept
        if sum(1 for m, (start, _) in zip(enc.special_tokens_mask, enc.offsets) if not m and start >= first) < content:
            return None  # not cut in the part past that: it may run on past
        return enc

    def token_ids(self, text: str, add_special_tokens: bool = True) -> tuple[list[int], list[str]]:
        """One text's ids and token strings."""
        if self.do_lower_case:
            text = text.lower()
        enc = self._base.encode(text, add_special_tokens=add_special_tokens)
        return list(enc.ids), list(enc.tokens)

    # transformers' tokenizer calls, for code written against vLLM's `LLM.get_tokenizer()` (an HF tokenizer)

    def encode(
        self,
        text: str,
        text_pair: str | None = None,
        add_special_tokens: bool = True,
        truncation: bool = False,
        max_length: int | None = None,
    ) -> list[int]:
        """One text's (or text pair's) ids, as `PreTrainedTokenizer.encode` gives them."""
        return self._encode_one(text, text_pair, add_special_tokens, truncation, max_length).input_ids

    def __call__(
        self,
        text: str | Sequence[str],
        text_pair: str | Sequence[str] | None = None,
        add_special_tokens: bool = True,
        truncation: bool = False,
        max_length: int | None = None,
    ) -> dict[str, list]:
        """`input_ids`, `token_type_ids` and `attention_mask`, a list per text for a list of texts (no padding)."""
        many = not isinstance(text, str)
        texts = list(text) if many else [text]
        pairs = [None] * len(texts) if text_pair is None else list(text_pair) if many else [text_pair]
        if len(pairs) != len(texts):
            raise ValueError(f"{len(texts)} texts and {len(pairs)} text pairs")
        encs = [self._encode_one(t, p, add_special_tokens, truncation, max_length) for t, p in zip(texts, pairs)]
        out: dict[str, list] = {
            "input_ids": [e.input_ids for e in encs],
            "token_type_ids": [e.token_type_ids or [0] * len(e.input_ids) for e in encs],
            "attention_mask": [[1] * len(e.input_ids) for e in encs],
        }
        return out if many else {k: v[0] for k, v in out.items()}

    def _encode_one(
        self, text: object, pair: object, add_special_tokens: bool, truncation: bool, max_length: int | None
    ) -> TokenizedPrompt:
        if not isinstance(text, str) or not isinstance(pair, str | None):
            raise TypeError(f"a text (and a text pair) to encode, got {type(text).__name__} and {type(pair).__name__}")
        limit = max_length if max_length is not None else self.model_max_length
        cut = limit if truncation else None  # without a limit, transformers does not cut either
        # an empty text_pair is no pair in transformers (it tests the pair's truth)
        item: str | tuple[str, str] = (text, pair) if pair else text
        max_len = 1 << 62 if cut is None else cut
        side = self.default_truncation_side  # transformers' cuts on the tokenizer's side
        (enc,) = self.encode_prompts([item], max_len, cut is not None, add_special_tokens, truncation_side=side)
        return enc

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[str]:
        """Token strings, special tokens left out unless asked for (transformers' default)."""
        return self.token_ids(text, add_special_tokens)[1]

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | None | list[str | None]:
        return self.id_to_token(ids) if isinstance(ids, int) else [self.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        return self.token_to_id(tokens) if isinstance(tokens, str) else [self.token_to_id(t) for t in tokens]

    def batch_decode(
        self,
        sequences: Sequence[Sequence[int]],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
    ) -> list[str]:
        return [self.decode(ids, skip_special_tokens, clean_up_tokenization_spaces) for ids in sequences]

    def get_vocab(self) -> dict[str, int]:
        return self._base.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def decode(
        self, ids: Sequence[int], skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None
    ) -> str:
        """Text of ids; special tokens kept unless asked, cleaned up as the tokenizer config says unless asked
        (transformers' defaults)."""
        text = self._base.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if clean_up_tokenization_spaces is False:
            return text
        return self.clean_up(text, force=bool(clean_up_tokenization_spaces))

    def clean_up(self, text: str, force: bool = False) -> str:
        """Decoded text as transformers' `decode` gives it: with `clean_up_tokenization_spaces` (or `force`), no
        space before punctuation and English contractions."""
        if not (self.clean_up_spaces or force):
            return text
        for spaced, joined in _CLEAN_UP:
            text = text.replace(spaced, joined)
        return text

    def id_to_token(self, i: int) -> str | None:
        return self._base.id_to_token(i)

    # vLLM's TokenizerLike (what LLM.get_tokenizer() gives its users), from the tokenizer's own files

    @property
    def all_special_tokens(self) -> list[str]:
        """The named special tokens, then the additional ones, each once (transformers' order)."""
        named = special_tokens_map(self.path.parent)
        tokens: list[Any] = [named[k] for k in _SPECIAL_ATTRIBUTES if k in named]
        for key in ("additional_special_tokens", "extra_special_tokens"):  # the second is transformers 5's
            extra = _token_list(_read_config(self.path.parent / "special_tokens_map.json").get(key))
            extra = extra or _token_list(_read_config(self.path.parent / "tokenizer_config.json").get(key))
            tokens += [t.get("content") if isinstance(t, dict) else t for t in extra]
        return [t for t in dict.fromkeys(tokens) if isinstance(t, str)]

    @property
    def all_special_ids(self) -> list[int]:
        return [i for i in map(self._base.token_to_id, self.all_special_tokens) if i is not None]

    @property
    def bos_token_id(self) -> int | None:
        return self.special_token_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self.special_token_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self.special_token_id("pad_token")

    @property
    def is_fast(self) -> bool:
        return True  # a `tokenizers` tokenizer, as transformers' fast ones

    @property
    def max_token_id(self) -> int:
        return max(self.get_vocab().values())

    @property
    def truncation_side(self) -> str:
        return self.default_truncation_side

    def num_special_tokens_to_add(self, pair: bool = False) -> int:
        return self._num_special(pair, True)

    def get_added_vocab(self) -> dict[str, int]:
        return {token.content: i for i, token in self._base.get_added_tokens_decoder().items()}

    def convert_tokens_to_string(self, tokens: Sequence[str]) -> str:
        decoder = self._base.decoder
        return decoder.decode(list(tokens)) if decoder is not None else " ".join(tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Any],
        tools: list[dict[str, Any]] | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        tokenize: bool = True,
        **kwargs: Any,
    ) -> str | list[int]:
        """The conversation through the tokenizer's chat template (or `chat_template`): its ids (the template
        writes the special tokens itself), or with tokenize=False its text, as transformers' defaults."""
        from .chat import ChatError, find_template, render

        template = chat_template or find_template(self.path.parent, tools=bool(tools))
        if template is None:
            raise ValueError("this tokenizer has no chat template; pass chat_template")
        variables = {**kwargs, **({"tools": tools} if tools is not None else {})}
        try:
            text = render(
                template,
                messages,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                special_tokens=special_tokens_map(self.path.parent),
                variables=variables,
            )
        except ChatError as exc:
            raise ValueError(str(exc)) from None
        return self.encode(text, add_special_tokens=False) if tokenize else text
