"""Chat-style prompts: a conversation rendered to text by the model's Jinja chat template, as transformers'
`apply_chat_template` renders it (a sandboxed environment with the same options, filters and globals), for
vLLM's chat-style embedding requests. Only text content is read; an image part is refused by name."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

CONTENT_TYPES = ("text", "input_text")


class ChatError(ValueError):
    """A conversation or template that cannot be rendered; the message names the message index."""


def find_template(model_dir: Path, tokenizer_dir: Path | None = None) -> str | None:
    """The checkpoint's own template: `chat_template.jinja`, else tokenizer_config.json's `chat_template`
    (a string, or a list of named templates of which "default" is used)."""
    for folder in dict.fromkeys(d for d in (tokenizer_dir, model_dir) if d is not None):
        jinja = folder / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text(encoding="utf-8")
        config = folder / "tokenizer_config.json"
        if config.is_file():
            value = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
            if isinstance(value, list):
                value = next((t.get("template") for t in value if t.get("name") == "default"), None)
            if isinstance(value, str):
                return value
    return None


def load_template(value: str) -> str:
    """`--chat-template`: a file path, else the template itself (vLLM takes either)."""
    path = Path(value).expanduser()
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError:  # a long inline template is not a path the OS can stat
        pass
    return value


def text_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Messages with their content as one string (text parts joined by newlines, vLLM's "string" content format)."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ChatError(f"messages item {i} must be an object with a string 'role'")
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in CONTENT_TYPES and isinstance(part.get("text"), str):
                    texts.append(part["text"])
                elif kind in ("image_url", "input_image", "image", "image_embeds", "image_pil"):
                    raise ChatError(f"messages item {i} content part {j} is an image; this model reads text only")
                else:
                    raise ChatError(f"messages item {i} content part {j} must be {{'type': 'text', 'text': str}}")
            content = "\n".join(texts)
        elif content is not None and not isinstance(content, str):
            raise ChatError(f"messages item {i} 'content' must be a string or a list of content parts")
        out.append({**message, "content": content})
    return out


@lru_cache(maxsize=32)
def _compile(template: str) -> Any:
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render(
    template: str,
    messages: Sequence[Any],
    *,
    add_generation_prompt: bool = False,
    continue_final_message: bool = False,
    special_tokens: dict[str, str] | None = None,
    **kwargs: Any,
) -> str:
    """The conversation as the template writes it; ChatError for a bad conversation or a failing template."""
    from jinja2 import TemplateError

    if add_generation_prompt and continue_final_message:
        raise ChatError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    conversation = text_messages(messages)
    if not conversation:
        raise ChatError("messages must not be empty")
    try:
        text = _compile(template).render(
            messages=conversation,
            add_generation_prompt=add_generation_prompt,
            **(special_tokens or {}),
            **kwargs,
        )
    except TemplateError as exc:
        raise ChatError(f"the chat template failed: {exc}") from None
    if continue_final_message:  # end the text right after the last message's content, as transformers does
        final = (conversation[-1].get("content") or "").strip()
        at = text.rfind(final)
        if not final or at < 0:
            raise ChatError("continue_final_message: the last message's content is not in the rendered text")
        text = text[: at + len(final)]
    return text
