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

# vLLM's text part types, each with the field that holds its text
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal", "thinking": "thinking"}
# transformers' marker for continue_final_message: the text is cut where it lands
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatError(ValueError):
    """A conversation or template that cannot be rendered; the message names the message index."""


def find_template(
    model_dir: Path, tokenizer_dir: Path | None = None, tools: bool = False, name: str | None = None
) -> str | None:
    """The checkpoint's own template: `chat_template.jinja`, else tokenizer_config.json's `chat_template`
    (a string, or a list of named templates of which "default" is used, or "tool_use" for a request with
    tools where there is one, as transformers picks). `name`: that named template only (None or "default":
    the default one)."""
    name = None if name == "default" else name
    for folder in dict.fromkeys(d for d in (tokenizer_dir, model_dir) if d is not None):
        # transformers 5 saves named templates beside the default one, "tool_use" picked for tools
        extra = folder / "additional_chat_templates"
        pick = name or ("tool_use" if tools and (extra / "tool_use.jinja").is_file() else None)
        if pick is not None and (extra / f"{pick}.jinja").is_file():
            return (extra / f"{pick}.jinja").read_text(encoding="utf-8")
        jinja = folder / "chat_template.jinja"
        if jinja.is_file() and name is None:
            return jinja.read_text(encoding="utf-8")
        config = folder / "tokenizer_config.json"
        if config.is_file():
            value = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
            if isinstance(value, list):
                named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
                pick = name or ("tool_use" if tools and "tool_use" in named else "default")
                value = named.get(pick)
            elif name is not None:
                value = None
            if isinstance(value, str):
                return value
    return None


def load_template(value: str) -> str:
    """`--chat-template`: a file path, else the template itself (vLLM takes either); a value without any of
    `{`, `}` or a newline is a path, and one that cannot be read is refused (as vLLM refuses it)."""
    path = Path(value).expanduser()
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:  # a long inline template is not a path the OS can stat
        if not any(c in value for c in "{}\n"):
            raise ChatError(
                f"the chat template {value!r} looks like a file path, but it cannot be read: {exc}"
            ) from None
    return value


def text_messages(messages: Sequence[Any], parts: bool = False) -> list[dict[str, Any]]:
    """Messages as vLLM hands them to the template: content as one string (text parts joined by newlines, empty
    ones skipped: its "string" content format; null content ""), or with `parts` as a list of {"type": "text",
    "text"} parts (its "openai" format, for templates that iterate over the content). Each message is built anew
    from the fields vLLM passes on: role, content, a string name or task, an assistant's tool calls (arguments
    parsed from JSON to objects) and reasoning (also as `reasoning_content`), a tool's call id (its content one
    string in either format), a developer's tools."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ChatError(f"messages item {i} must be an object with a string 'role'")
        role, content = message["role"], message.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(part, str):  # a plain string part
                    texts.append(part)
                elif kind in TEXT_PARTS and isinstance(part.get(TEXT_PARTS[kind]), str):
                    texts.append(part[TEXT_PARTS[kind]])
                elif kind in ("text", "refusal") and part.get(TEXT_PARTS[kind]) is None:
                    continue  # skipped, as vLLM skips a text part without text
                elif kind in ("image_url", "input_image", "image", "image_embeds", "image_pil"):
                    raise ChatError(f"messages item {i} content part {j} is an image; this model reads text only")
                else:
                    raise ChatError(f"messages item {i} content part {j} must be {{'type': 'text', 'text': str}}")
        elif content is None:
            texts = []
        elif isinstance(content, str):
            texts = [content]
        else:
            raise ChatError(f"messages item {i} 'content' must be a string or a list of content parts")
        if parts and role != "tool":  # vLLM joins a tool's text parts into one string in either format
            built: dict[str, Any] = {"role": role, "content": [{"type": "text", "text": t} for t in texts]}
        else:  # vLLM's string format drops empty texts before joining
            built = {"role": role, "content": "\n".join(t for t in texts if t or parts)}
        if role == "assistant":
            if message.get("tool_calls") is not None:
                built["tool_calls"] = message["tool_calls"]
                built = _with_parsed_tool_calls(i, built)
            if message.get("reasoning") is not None:  # what Qwen3-style templates read as reasoning_content
                built["reasoning"] = built["reasoning_content"] = message["reasoning"]
        elif role == "tool" and "tool_call_id" in message:
            built["tool_call_id"] = message["tool_call_id"]
        for key in ("name", "task"):
            if isinstance(message.get(key), str):
                built[key] = message[key]
        if role == "developer":
            built["tools"] = message.get("tools")
        out.append(built)
    return out


def _with_parsed_tool_calls(i: int, message: dict[str, Any]) -> dict[str, Any]:
    """vLLM's treatment of an assistant's tool_calls: none dropped; each a function whose `arguments` JSON text
    becomes an object (what tool-use templates expect), anything else an empty object."""
    calls = message["tool_calls"]
    if not isinstance(calls, list):
        raise ChatError(f"messages item {i} 'tool_calls' must be a list of function call objects")
    if not calls:
        return {k: v for k, v in message.items() if k != "tool_calls"}
    parsed_calls = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise ChatError(f"messages item {i} tool_calls item {j} must be a function call object")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments else {}
            except json.JSONDecodeError:
                arguments = {}
        arguments = arguments if isinstance(arguments, dict) else {}
        parsed_calls.append({**call, "function": {**function, "arguments": arguments}})
    return {**message, "tool_calls": parsed_calls}


@lru_cache(maxsize=32)
def content_format(template: str) -> str:
    """vLLM's detection of a template's content format: "openai" when it loops over a message's content (each
    part then a {"type", "text"} dict), else "string" (the parts joined as one text). As vLLM reads it: loops
    over `messages` or a name set from it, their items' `content` (through filters, tests and slices), a macro
    parameter given that content, or a bare `content` outside macros."""
    from jinja2 import nodes

    try:
        tree = _compile(template).environment.parse(template)
    except Exception:
        return "string"

    def name_of(node: nodes.Node, target: bool = False) -> str | None:
        """`x` or `ns.rest` as a dotted name (read, or assigned when `target`)."""
        if isinstance(node, nodes.Name):
            return node.name if target or node.ctx == "load" else None
        if isinstance(node, nodes.Getattr):
            base = name_of(node.node)
            return None if base is None else f"{base}.{node.attr}"
        return None

    def unwrap(node: nodes.Node) -> nodes.Node:  # messages | selectattr(...), x is defined, x[1:]
        while True:
            if isinstance(node, (nodes.Filter, nodes.Test)) and node.node is not None:
                node = node.node
            elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
                node = node.node
            else:
                return node

    def reads(node: nodes.Node, names: set[str], key: str | None = None) -> bool:
        node = unwrap(node)
        if key is None:
            return name_of(node) in names
        if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == key:
            return name_of(node.node) in names
        return isinstance(node, nodes.Getattr) and node.attr == key and name_of(node.node) in names

    aliases, changed = {"messages"}, True
    while changed:  # {% set rest = messages[1:] %}, namespace(rest=messages), ns.rest = messages
        changed = False
        for assign in tree.find_all(nodes.Assign):
            targets = []
            if isinstance(assign.node, nodes.Call) and name_of(assign.node.node) == "namespace":
                base = name_of(assign.target, target=True)
                targets = [f"{base}.{kw.key}" for kw in assign.node.kwargs if base and reads(kw.value, aliases)]
            elif reads(assign.node, aliases):
                targets = [t for t in [name_of(assign.target, target=True)] if t]
                if isinstance(assign.target, nodes.NSRef):
                    targets = [f"{assign.target.name}.{assign.target.attr}"]
            for target in targets:
                if target not in aliases:
                    aliases.add(target)
                    changed = True
    loops = list(tree.find_all(nodes.For))
    items = {loop.target.name for loop in loops if isinstance(loop.target, nodes.Name) and reads(loop.iter, aliases)}
    in_macros: set[int] = set()
    macro_params: dict[int, set[str]] = {}
    for macro in tree.find_all(nodes.Macro):
        params = set()
        for call in tree.find_all(nodes.Call):
            if name_of(call.node) != macro.name:
                continue
            params |= {macro.args[i].name for i, arg in enumerate(call.args[: len(macro.args)])
                       if reads(arg, items, "content")}  # fmt: skip
            params |= {kw.key for kw in call.kwargs if reads(kw.value, items, "content")}
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            macro_params[id(loop)] = params
    for loop in loops:
        if reads(loop.iter, items, "content"):
            return "openai"
        if isinstance(loop.iter, nodes.Name):
            if loop.iter.name in macro_params.get(id(loop), set()):
                return "openai"
            if id(loop) not in in_macros and loop.iter.name == "content":
                return "openai"
    return "string"


def _developer_as_system(template: str, conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A template that never names the developer role gets those messages as system messages, merged into one
    first system message (vLLM's rule)."""
    if (
        not any(m["role"] == "developer" for m in conversation)
        or "'developer'" in template
        or '"developer"' in template
    ):
        return conversation
    converted = [
        {**{k: v for k, v in m.items() if k != "tools"}, "role": "system"} if m["role"] == "developer" else m
        for m in conversation
    ]
    systems = [i for i, m in enumerate(converted) if m["role"] == "system"]
    if systems == [0]:
        return converted
    texts = [converted[i]["content"] for i in systems]
    texts = [t if isinstance(t, str) else "\n".join(p["text"] for p in t) for t in texts]  # "openai" parts
    # one string in either content format, as vLLM merges them
    joined = "\n\n".join(t for t in texts if t)
    return [{"role": "system", "content": joined}, *(m for m in converted if m["role"] != "system")]


def _generation_extension() -> Any:
    """transformers' `{% generation %} ... {% endgeneration %}` blocks (they mark the assistant's tokens for
    training masks): rendered as their body."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    return Generation


@lru_cache(maxsize=32)
def _compile(template: str) -> Any:
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    extensions = [loopcontrols, _generation_extension()]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=extensions)
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render(
    template: str,
    messages: Sequence[Any],
    /,
    *,
    add_generation_prompt: bool = False,
    continue_final_message: bool = False,
    special_tokens: dict[str, str] | None = None,
    content_format_option: str = "auto",
    variables: dict[str, Any] | None = None,
    **kwargs: Any,
) -> str:
    """The conversation as the template writes it; ChatError for a bad conversation or a failing template.
    `content_format_option` is vLLM's --chat-template-content-format: "string", "openai", or "auto" (detected).
    `variables` (a request's chat_template_kwargs, whatever their names) and `kwargs` are the template's."""
    from jinja2 import TemplateError

    if add_generation_prompt and continue_final_message:
        raise ChatError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    chosen = content_format(template) if content_format_option == "auto" else content_format_option
    parts = chosen == "openai"
    conversation = _developer_as_system(template, text_messages(messages, parts))
    if not conversation:
        raise ChatError("messages must not be empty")
    if continue_final_message:  # transformers' way: a marker after the last message's text, the text cut there
        final = conversation[-1]["content"]
        if parts:
            if not final:
                raise ChatError("continue_final_message: the last message has no text to continue")
            final = [*final[:-1], {**final[-1], "text": final[-1]["text"] + _CONTINUE_TAG}]
        else:
            final = final + _CONTINUE_TAG
        conversation[-1] = {**conversation[-1], "content": final}
    try:
        # the request's variables may override the special tokens, never the conversation or the prompt flag
        context = {**(special_tokens or {}), **(variables or {}), **kwargs}
        text = _compile(template).render(
            {**context, "messages": conversation, "add_generation_prompt": add_generation_prompt}
        )
    except TemplateError as exc:
        raise ChatError(f"the chat template failed: {exc}") from None
    except Exception as exc:
        # raised by the template's own expressions or filters (a request's variable of another type, 1/0, a runaway
        # macro): the template and its inputs are the client's, as vLLM answers them (400)
        raise ChatError(f"the chat template failed: {type(exc).__name__}: {exc}") from None
    if continue_final_message:
        at = text.rfind(_CONTINUE_TAG.strip())
        if at < 0:
            raise ChatError("continue_final_message: the last message's content is not in the rendered text")
        # a template that keeps spacing keeps the final text's own trailing spaces; one that trims, does not
        text = text[:at] if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
    return text
