"""Chat templates: SmolLM2's template against transformers' apply_chat_template, the sandbox, errors."""

from __future__ import annotations

import pytest

from tracelm import TracelmError
from tracelm.io.chat_template import chat_template_from_metadata, render_chat
from tracelm.io.gguf_file import GGUFFile

CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is a llama? 🦙"},
    {"role": "assistant", "content": "A South American camelid."},
    {"role": "user", "content": "And an alpaca?"},
]




def apply_chat_template_hf(
    template: str, messages: list[dict], add_generation_prompt: bool = True, **tokens
) -> str:
    """transformers' own apply_chat_template, on a stand-in tokenizer that carries only the template."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models

    stand_in = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=stand_in, chat_template=template, **tokens)
    return hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


@pytest.fixture(scope="module")
def smol_template(smollm2_path) -> str:
    template = chat_template_from_metadata(GGUFFile(smollm2_path).metadata)
    assert template is not None and "<|im_start|>" in template
    return template


@pytest.mark.model
@pytest.mark.reference
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_template_matches_transformers(smol_template, add_generation_prompt):
    ours = render_chat(smol_template, CONVERSATION, add_generation_prompt=add_generation_prompt)
    assert ours == apply_chat_template_hf(smol_template, CONVERSATION, add_generation_prompt)
    assert ours.count("<|im_start|>") == 4 + add_generation_prompt


@pytest.mark.model
@pytest.mark.reference
def test_smollm2_template_adds_default_system_prompt(smol_template):
    messages = CONVERSATION[1:2]
    ours = render_chat(smol_template, messages)
    assert ours == apply_chat_template_hf(smol_template, messages)
    assert ours.startswith("<|im_start|>system\n") and "What is a llama?" in ours


@pytest.mark.reference
def test_hf_globals_match_transformers():
    template = (
        "{{ bos_token }}{% for m in messages %}{{ m | tojson }}{{ m | tojson(indent=2) }}{% endfor %}"
        "{% if messages | length > 3 %}{{ eos_token }}{% endif %}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}[{{ m.role }}]{% endfor %}\n"
        "  {% if add_generation_prompt %}\n    gen\n  {% endif %}\n"
    )
    tokens = {"bos_token": "<s>", "eos_token": "</s>"}
    ours = render_chat(template, CONVERSATION, **tokens)
    assert ours == apply_chat_template_hf(template, CONVERSATION, **tokens)
    assert "🦙" in ours and "<s>" in ours and "</s>" in ours  # tojson keeps non-ASCII as is


def test_fallback_is_chatml():
    assert render_chat(None, [{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render_chat(None, CONVERSATION[:1], add_generation_prompt=False) == (
        "<|im_start|>system\nYou answer briefly.<|im_end|>\n"
    )


def test_extra_variables_and_strftime_now():
    template = "{{ strftime_now('%Y') | length }} {{ tools | length }} {{ date_string | default('none') }}"
    assert render_chat(template, [], tools=[{"name": "f"}]) == "4 1 none"


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__ }}",
        "{{ cycler.__init__.__globals__.os }}",
        "{% set x = messages.append(1) %}",
        "{{ messages[0].update({'role': 'x'}) }}",
    ],
)
def test_sandbox_escapes_are_refused(template):
    with pytest.raises(TracelmError, match="unsafe"):
        render_chat(template, CONVERSATION)


def test_raise_exception_becomes_tracelm_error():
    template = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    template += "{% endif %}"
    with pytest.raises(TracelmError, match="System role not supported"):
        render_chat(template, CONVERSATION)
    assert render_chat(template, CONVERSATION[1:2]) == ""


def test_syntax_and_runtime_errors_are_tracelm_errors():
    with pytest.raises(TracelmError, match="syntax error at line 2"):
        render_chat("ok\n{% for m in messages %}", CONVERSATION)
    with pytest.raises(TracelmError, match="chat template failed"):
        render_chat("{{ messages[0]['content'] + 1 }}", CONVERSATION)


def test_chat_template_from_metadata():
    assert chat_template_from_metadata({"tokenizer.chat_template": "{{ x }}"}) == "{{ x }}"
    assert chat_template_from_metadata({}) is None
    assert chat_template_from_metadata({"tokenizer.chat_template": "  "}) is None
