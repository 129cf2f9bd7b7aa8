"""Prompt forms, as vLLM 0.34's `vllm.inputs` names them (`from polyvec import TokensPrompt`): plain dicts, so a
vLLM user's prompts pass unchanged."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NotRequired, TypedDict


class TextPrompt(TypedDict):
    """A text to tokenize, with the images of a page-image model (`multi_modal_data={"image": ...}`)."""

    prompt: str
    multi_modal_data: NotRequired[dict[str, Any]]


class TokensPrompt(TypedDict):
    """Token ids, passed to the model as they are (`token_type_ids` for a cross-encoder's pair)."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    token_type_ids: NotRequired[list[int]]
    multi_modal_data: NotRequired[dict[str, Any]]


PromptType = str | TextPrompt | TokensPrompt | Sequence[int]
"""One prompt: a string, a TextPrompt, a TokensPrompt or a list of token ids."""
