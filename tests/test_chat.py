"""Chat templates rendered as transformers renders them (the reference), for chat-style pooling requests."""

from __future__ import annotations

import pytest

from polyvec.chat import ChatError, find_template, load_template, render

# A ChatML template (Qwen's style) and one that exercises tojson, loop controls and raise_exception.
CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
FANCY = """{{ bos_token }}{% for m in messages %}
{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}
{% if loop.index > 3 %}{% break %}{% endif %}
[{{ m['role'] | upper }}] {{ m['content'] | tojson }}
{% endfor %}{% if note is defined %}NOTE {{ note }}{% endif %}"""

CONVERSATION = [
    {"role": "system", "content": "You embed queries about aerodynamics."},
    {"role": "user", "content": "flutter of a swept wing — «heated»"},
    {"role": "assistant", "content": "an aeroelastic instability"},
    {"role": "user", "content": "fourth, cut by break"},
]


@pytest.mark.parametrize("template", [CHATML, FANCY])
@pytest.mark.parametrize("mode", ["plain", "generation", "continue"])
def test_render_equals_transformers(template, mode):
    from transformers.utils.chat_template_utils import render_jinja_template

    kwargs = {"add_generation_prompt": mode == "generation", "continue_final_message": mode == "continue"}
    conversation = CONVERSATION[:3]
    ours = render(template, conversation, special_tokens={"bos_token": "[CLS]"}, note="n1", **kwargs)
    ref = render_jinja_template([conversation], chat_template=template, bos_token="[CLS]", note="n1", **kwargs)
    ref = ref[0] if isinstance(ref, tuple) else ref
    ref = ref[0] if isinstance(ref, list) else ref
    assert ours == ref


def test_text_parts_join_and_images_are_refused():
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert render(CHATML, parts) == render(CHATML, [{"role": "user", "content": "a\nb"}])
    image = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}]}]
    with pytest.raises(ChatError, match="messages item 0 content part 1 is an image"):
        render(CHATML, image)
    with pytest.raises(ChatError, match="Cannot set both `continue_final_message` and `add_generation_prompt`"):
        render(CHATML, CONVERSATION, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(ChatError, match="the chat template failed: no tools"):
        render(FANCY, [{"role": "tool", "content": "x"}])
    with pytest.raises(ChatError, match="messages item 1 must be an object with a string 'role'"):
        render(CHATML, [{"role": "user", "content": "x"}, {"content": "y"}])


def test_the_sandbox_holds():
    with pytest.raises(Exception, match="unsafe|not safely|access"):
        render("{{ ''.__class__.__mro__[1].__subclasses__() }}", [{"role": "user", "content": "x"}])


def test_template_sources(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": [{"name": "default", "template": "T"}]}')
    assert find_template(tmp_path) == "T"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert find_template(tmp_path) == "J"
    assert find_template(tmp_path / "missing") is None
    assert load_template(str(tmp_path / "chat_template.jinja")) == "J"
    assert load_template("{{ messages }}") == "{{ messages }}"


def _transformers(template: str, conversation: list, **kwargs) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    ref = render_jinja_template([conversation], chat_template=template, **kwargs)
    ref = ref[0] if isinstance(ref, tuple) else ref
    return ref[0] if isinstance(ref, list) else ref


@pytest.mark.parametrize("final", ["end", "I am ", "", "a<|im_end|> b"])
def test_continue_final_message_cuts_at_transformers_marker(final):
    """The text is cut where transformers' marker lands (it searched for the content: "end" was found inside
    <|im_end|>, a trailing space was lost, an empty final message refused)."""
    conversation = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": final}]
    ours = render(CHATML, conversation, continue_final_message=True)
    assert ours == _transformers(CHATML, conversation, continue_final_message=True)
    assert ours.endswith("<|im_start|>assistant\n" + final)


def test_messages_as_vllm_hands_them_to_the_template():
    """Null content is empty text, tool-call arguments are objects, vLLM's other text parts are text, a
    developer message is a system message where the template has no such role."""
    calls = [{"id": "c1", "type": "function", "function": {"name": "get", "arguments": '{"city": "Paris"}'}}]
    template = (
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for t in m.tool_calls or [] %}[{{ t.function.name }}{{ t.function.arguments | tojson }}]{% endfor %}|"
        "{% endfor %}"
    )
    conversation = [
        {"role": "developer", "content": "Be brief"},
        {"role": "user", "content": ["plain", {"type": "output_text", "text": "out"}, {"type": "text", "text": None}]},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}], "tool_calls": []},
    ]
    assert (
        render(template, conversation)
        == 'system:Be brief|user:plain\nout|assistant:[get{"city": "Paris"}]|assistant:no|'
    )
    named = template.replace("{{ m.role }}", "{{ 'developer' if m.role == 'developer' else m.role }}")
    assert render(named, conversation[:1]) == "developer:Be brief|"  # a template that knows the role keeps it
    # a developer message later on joins the first system message
    late = [{"role": "system", "content": "A"}, {"role": "user", "content": "q"}, {"role": "developer", "content": "B"}]
    assert render(template, late) == "system:A\n\nB|user:q|"


def test_each_message_carries_only_the_fields_vllm_passes_on():
    """vLLM builds each message anew: `tool_calls: null` (the OpenAI SDK's model_dump) left a Llama-3.1 template
    a None to measure (400), an assistant's `reasoning` never reached Qwen3's `reasoning_content`, a client's own
    `reasoning_content` or a user's `tool_calls` reached the template, and empty text parts added newlines."""
    template = (
        "{% for m in messages %}{{ m.role }}:{% if 'tool_calls' in m %}{{ m.tool_calls | length }}calls {% endif %}"
        "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}"
        "{% if m.name %} ({{ m.name }}){% endif %}{% if m.tool_call_id %} [{{ m.tool_call_id }}]{% endif %}|"
        "{% endfor %}"
    )
    conversation = [
        {"role": "user", "content": ["hello", "", {"type": "text", "text": ""}, "there"], "tool_calls": [{}],
         "reasoning_content": "no", "name": "ann", "extra": 1},
        {"role": "assistant", "content": "4", "tool_calls": None, "reasoning": "sum"},
        {"role": "assistant", "content": "x", "reasoning_content": "not vLLM's field"},
        {"role": "tool", "content": [{"type": "text", "text": "r1"}, "r2"], "tool_call_id": "c"},
    ]  # fmt: skip
    assert (
        render(template, conversation)
        == "user:hello\nthere (ann)|assistant:<think>sum</think>4|assistant:x|tool:r1\nr2 [c]|"
    )
    loops = (  # vLLM's "openai" format: parts kept as given, a tool's joined into one string
        "{% for m in messages %}<{{ m.role }}>{% if m.content is string %}{{ m.content }}{% else %}"
        "{% for p in m.content %}{{ p.text }},{% endfor %}{% endif %}|{% endfor %}"
    )
    tool = {"role": "tool", "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}]}
    user = {"role": "user", "content": ["a", "", "b"]}
    assert render(loops, [user, tool]) == "<user>a,,b,|<tool>r1\nr2|"
    late = [{"role": "user", "content": "q"}, {"role": "developer", "content": [{"type": "text", "text": "dev"}]}]
    assert render(loops, late) == "<system>dev|<user>q,|"  # merged system messages: one string, as vLLM's
    with pytest.raises(ChatError, match="messages item 0 'tool_calls' must be a list"):
        render(template, [{"role": "assistant", "content": "a", "tool_calls": {"id": 1}}])


def test_template_variables_and_names(tmp_path):
    """Request variables override the special tokens (as transformers lets them); a list of named templates
    gives "tool_use" to a request with tools; a --chat-template that looks like a path must exist."""
    conversation = [{"role": "user", "content": "hello"}]
    template = "{{ bos_token }}{{ messages[0].content }}"
    assert render(template, conversation, special_tokens={"bos_token": "<s>"}, bos_token="there") == "therehello"
    named = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]
    (tmp_path / "tokenizer_config.json").write_text(__import__("json").dumps({"chat_template": named}))
    assert find_template(tmp_path) == "D" and find_template(tmp_path, tools=True) == "T"
    with pytest.raises(ChatError, match="looks like a file path, but it cannot be read"):
        load_template(str(tmp_path / "nope.jinja"))


def test_templates_that_iterate_content_get_parts():
    """vLLM's "openai" content format: a template that loops over a message's content gets its parts as
    {"type": "text", "text"} dicts (it got one string and wrote nothing of it), as transformers passes them."""
    template = (
        "{% for message in messages %}<|{{ message.role }}|>"
        "{% for part in message.content %}{% if part.type == 'text' %}{{ part.text }}{% endif %}{% endfor %}\n"
        "{% endfor %}"
    )
    parts = [{"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "text", "text": "here"}]}]
    assert render(template, parts) == _transformers(template, parts) == "<|user|>lookhere"
    plain = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert render(template, plain) == "<|system|>be brief<|user|>hi"  # a string is one text part
    final = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b "}]}]
    cut = render(template, final, continue_final_message=True)
    assert cut == _transformers(template, final, continue_final_message=True) == "<|user|>ab "
    assert render(CHATML, parts) == render(CHATML, [{"role": "user", "content": "look\nhere"}])  # still "string"


def test_content_format_chosen_by_the_server_flag():
    """--chat-template-content-format forces vLLM's format over the detection (it was accepted and ignored):
    "openai" hands a template the typed parts even when it only prints the content, "string" the joined text."""
    from polyvec.entrypoints.cli import build_parser, server_options

    printing = "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    looping = "{% for m in messages %}{% for p in m.content %}<{{ p }}>{% endfor %}{% endfor %}"
    conversation = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert render(printing, conversation) == "[a\nb]"
    assert (
        render(printing, conversation, content_format_option="openai")
        == "[[{'type': 'text', 'text': 'a'}, {'type': 'text', 'text': 'b'}]]"
    )
    assert render(looping, conversation) == "<{'type': 'text', 'text': 'a'}><{'type': 'text', 'text': 'b'}>"
    assert render(looping, conversation, content_format_option="string") == "<a><\n><b>"
    args = build_parser().parse_args(["serve", "m", "--chat-template-content-format", "openai"])
    assert server_options(args)["chat_template_content_format"] == "openai"
    assert server_options(build_parser().parse_args(["serve", "m"]))["chat_template_content_format"] == "auto"


@pytest.mark.parametrize(
    "template,expected",
    [
        # loops over content through a filter or a slice (Llama 4's templates): parts ("string" lost the text)
        (
            "{% for m in messages %}{% for p in m['content'] | selectattr('type', 'equalto', 'text') %}{{ p['text'] }}"
            "{% endfor %}{% endfor %}",
            "openai",
        ),  # fmt: skip
        ("{% for m in messages %}{% for p in m['content'][0:] %}{{ p['text'] }}{% endfor %}{% endfor %}", "openai"),
        # messages under another name, and content through a macro parameter of any name
        (
            "{% set rest = messages[1:] %}{% for m in rest %}{% for c in m.content %}{{ c.text }}{% endfor %}"
            "{% endfor %}",
            "openai",
        ),  # fmt: skip
        (
            "{% set ns = namespace(rest=messages) %}{% for m in ns.rest %}{% for c in m['content'] %}{{ c.text }}"
            "{% endfor %}{% endfor %}",
            "openai",
        ),  # fmt: skip
        (
            "{% macro show(body) %}{% for c in body %}{{ c.text }}{% endfor %}{% endmacro %}"
            "{% for m in messages %}{{ show(m.content) }}{% endfor %}",
            "openai",
        ),  # fmt: skip
        # a loop over some other object's content is not the messages' ("openai" mangled {{ m['content'] }})
        (
            "{% set doc = {'content': ['a']} %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
            "{% for d in doc.content %}{% endfor %}",
            "string",
        ),  # fmt: skip
        ("{% for m in messages %}{% for t in m.tool_calls %}{{ t }}{% endfor %}{{ m.content }}{% endfor %}", "string"),
    ],
)
def test_content_format_detected_as_vllm_detects_it(template, expected):
    """vLLM 0.34's _detect_content_format: the loops it follows, and the ones it does not."""
    from polyvec.chat import content_format

    assert content_format(template) == expected
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    assert "hello world" in render(template, conversation)  # the text reaches the output, whichever the format


def test_score_templates_get_their_texts_as_strings():
    """vLLM hands a score template its query and document as plain strings, whatever the template loops over
    (the detected "openai" format gave it part dicts)."""
    from polyvec.scoring import pair_composer

    template = (
        "{% for m in messages %}<{{ m.role }}>{% if m.content is string %}{{ m.content }}"
        "{% else %}{% for p in m.content %}{{ p }}{% endfor %}{% endif %}{% endfor %}"
    )
    compose = pair_composer({}, template)
    assert compose is not None and compose("what is x", "x is y") == "<query>what is x<document>x is y"


def test_generation_blocks_render_their_body():
    """transformers' {% generation %} blocks (SmolLM3's and others' templates mark the assistant's turns with them)
    render as their body, as transformers renders them (a 400 'the chat template failed' before)."""
    template = (
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}<a>{{ m.content }}</a>"
        "{% endgeneration %}{% else %}<u>{{ m.content }}</u>{% endif %}{% endfor %}"
    )
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert render(template, conversation) == _transformers(template, conversation) == "<u>hi</u><a>hello</a>"


def test_named_templates_of_transformers_5_are_found(tmp_path):
    """transformers 5 saves named templates in additional_chat_templates/: "tool_use" for a request with tools (the
    default was used), and a template picked by name."""
    from polyvec.chat import find_template

    (tmp_path / "chat_template.jinja").write_text("DEFAULT")
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("TOOLS")
    (tmp_path / "additional_chat_templates" / "rerank.jinja").write_text("RERANK")
    assert find_template(tmp_path) == find_template(tmp_path, name="default") == "DEFAULT"
    assert find_template(tmp_path, tools=True) == "TOOLS"
    assert find_template(tmp_path, name="rerank") == "RERANK" and find_template(tmp_path, name="other") is None
