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
