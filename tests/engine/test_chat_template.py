"""Chat template rendering must match transformers byte for byte.

The model was fine-tuned on prompts transformers rendered; one stray newline
or a missing default system prompt silently changes its behaviour.
"""
from __future__ import annotations

import jinja2
import pytest

from core.chat_template import _compile, render_chat_template
from core.tokenizer import Tokenizer


SYSTEM = {"role": "system", "content": "You are terse."}
USER = {"role": "user", "content": "What is 2+2? Answer with <b>tags</b> & émoji 🙂"}
ASSISTANT = {"role": "assistant", "content": "4"}
USER2 = {"role": "user", "content": "And 3+3?\n\nThink  step by step."}

CONVERSATIONS = {
    "system+user": [SYSTEM, USER],
    "user only": [USER],
    "multi-turn": [USER, ASSISTANT, USER2],
    "system multi-turn": [SYSTEM, USER, ASSISTANT, USER2],
    "ends with assistant": [USER, ASSISTANT],
}


@pytest.mark.parametrize("agp", [True, False])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_model_template_matches_reference(tok: Tokenizer, hf, name: str, agp: bool) -> None:
    msgs = CONVERSATIONS[name]
    ours = tok.apply_chat_template(msgs, add_generation_prompt=agp)
    assert ours == hf.apply_chat_template(msgs, add_generation_prompt=agp, tokenize=False)
    assert tok.apply_chat_template(msgs, add_generation_prompt=agp, tokenize=True) == hf.encode(
        ours, add_special_tokens=False)


def test_user_only_gets_default_system_prompt(tok: Tokenizer) -> None:
    text = tok.apply_chat_template([USER])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>assistant\n")


# Templates exercising the environment features transformers sets up.
GENERIC_TEMPLATES = {
    "whitespace": "{% for m in messages %}\n  {% if m.role == 'user' %}\n    [U] {{ m.content }}\n"
                  "  {% else %}\n    [A] {{ m.content }}\n  {% endif %}\n{% endfor %}\n"
                  "{% if add_generation_prompt %}[A]{% endif %}",
    "tojson": "{{ bos_token }}{{ messages | tojson }}|{{ messages[0] | tojson(indent=2) }}{{ eos_token }}",
    "loopcontrols": "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
                    "{% if m.role == 'assistant' %}{% continue %}{% endif %}{{ m.content }};{% endfor %}",
    "namespace": "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
                 "{{ ns.n }} {{ dict(a=1) | tojson }} {{ strftime_now('%Y') }}",
    "generation": "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}<{{ m.content }}>"
                  "{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}",
    "tools": "{% if tools %}{{ tools | tojson }}{% endif %}{{ custom | default('none') }}{{ messages | length }}",
}


@pytest.mark.parametrize("name", list(GENERIC_TEMPLATES))
def test_generic_templates_match_transformers(name: str) -> None:
    utils = pytest.importorskip("transformers.utils.chat_template_utils")
    template = GENERIC_TEMPLATES[name]
    msgs = [SYSTEM, USER, ASSISTANT, USER2]
    for agp in (True, False):
        extra = {"custom": "x", "tools": [{"name": "f"}]} if name == "tools" else {}
        ours = render_chat_template(template, msgs, agp, "<s>", "</s>", **extra)
        ref, _ = utils.render_jinja_template(conversations=[msgs], chat_template=template, add_generation_prompt=agp,
                                             bos_token="<s>", eos_token="</s>", **extra)
        assert ours == ref[0]


def test_template_compiled_once() -> None:
    template = GENERIC_TEMPLATES["whitespace"]
    assert _compile(template) is _compile(template)


def test_raise_exception_surfaces_as_template_error() -> None:
    template = "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok"
    assert render_chat_template(template, [USER], True, None, None) == "ok"
    with pytest.raises(jinja2.TemplateError, match="first must be user"):
        render_chat_template(template, [SYSTEM], True, None, None)


def test_sandbox_rejects_private_namespace_attributes() -> None:
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat_template("{% set ns = namespace(_x=1) %}", [USER], True, None, None)


def test_none_values_are_dropped_like_transformers() -> None:
    msgs = [{"role": "assistant", "content": None, "tool_calls": [{"name": "f"}]}, {"role": "user", "content": "a",
                                                                                    "name": None}]
    template = "{% for m in messages %}{{ m.content | default('-') }}{{ m.name is defined }};{% endfor %}"
    assert render_chat_template(template, msgs, False, None, None) == "-False;aFalse;"


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ("hello", "messages must be a list"),
        ([["user", "hi"]], "messages[0] must be a dict"),
        ([{"content": "hi"}], "messages[0].role"),
        ([USER, ASSISTANT, {"role": 3, "content": "x"}], "messages[2].role"),
        ([USER, {"role": "", "content": "x"}], "messages[1].role"),
        ([USER, {"role": "assistant"}], "messages[1].content"),
        ([{"role": "user", "content": None}], "messages[0].content"),
        ([{"role": "user", "content": 42}], "messages[0].content"),
    ],
)
def test_invalid_messages_name_the_field(messages: object, field: str) -> None:
    with pytest.raises(ValueError) as err:
        render_chat_template("{{ messages }}", messages, True, None, None)  # type: ignore[arg-type]
    assert field in str(err.value)


def test_tokenizer_without_template_is_an_error(tok: Tokenizer) -> None:
    bare = Tokenizer(tok.backend, bos_token=tok.bos_token, eos_token=tok.eos_token)
    with pytest.raises(ValueError, match="no chat_template"):
        bare.apply_chat_template([USER])
