"""Chat templates: render a conversation to prompt text with the model's Jinja template, sandboxed.

The environment matches the one Hugging Face's `apply_chat_template` gives templates (trim_blocks,
lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII),
so a GGUF's `tokenizer.chat_template` renders here exactly as it does there. Tools are passed as transformers
passes them: `tools=[...]` (OpenAI's tool objects) as a variable of the render, and an assistant message's
`tool_calls` with each function's arguments as an object.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tracelm.state.errors import TracelmError

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}"
    "{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\n' + system_message + '\n<</SYS>>\n\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)

# Gemma's turn format; a system message is put in front of the first user turn (Gemma has no system role).
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}{% set first_user_prefix = messages[0]['content'] + '\n\n' %}"
    "{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

BUILTIN_TEMPLATES = {"chatml": CHATML_TEMPLATE, "llama-2": LLAMA2_TEMPLATE, "gemma": GEMMA_TEMPLATE}


class _TemplateRaised(Exception):
    """The template called raise_exception(message)."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators=None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}` (HF marks assistant text with it): renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


class _Sandbox(ImmutableSandboxedEnvironment):
    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        # The stock sandbox returns an Undefined that fails only when used; fail at once instead.
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__} is not allowed")


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _Generation])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise TracelmError(f"chat template syntax error at line {e.lineno}: {e.message}") from None


def render_chat(
    template: str | None,
    messages: list[dict],
    *,
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
    **extra: Any,
) -> str:
    """The prompt text for `messages` ([{"role": ..., "content": ...}, ...]); `None` uses ChatML."""
    compiled = _compile(CHATML_TEMPLATE if template is None else template)
    try:
        return compiled.render(
            messages=messages,
            bos_token=bos_token,
            eos_token=eos_token,
            add_generation_prompt=add_generation_prompt,
            **extra,
        )
    except _TemplateRaised as e:
        raise TracelmError(f"chat template rejected the conversation: {e}") from None
    except SecurityError as e:
        raise TracelmError(f"chat template tried an unsafe operation: {e}") from None
    except Exception as e:  # a template is code: any error in it is an error in the model's files
        raise TracelmError(f"chat template failed: {type(e).__name__}: {e}") from None


def chat_template_from_metadata(meta: Mapping[str, Any]) -> str | None:
    """The GGUF's default chat template (`tokenizer.chat_template`), or None when it has none."""
    template = meta.get("tokenizer.chat_template")
    return template if isinstance(template, str) and template.strip() else None


# ---------------------------------------------------------------- conversation -> token ids


def builtin_template_for(tokenizer: Any) -> str:
    """The built-in template for a vocabulary that carries none: Gemma's turns if it has `<start_of_turn>`,
    ChatML if it has `<|im_start|>`, Llama 2's [INST] format for a SentencePiece vocabulary with `<s>`, else
    ChatML."""
    if tokenizer.token_id("<start_of_turn>") is not None:
        return GEMMA_TEMPLATE
    if tokenizer.token_id("<|im_start|>") is not None:
        return CHATML_TEMPLATE
    if tokenizer.bos_id is not None and tokenizer.piece(tokenizer.bos_id) == "<s>":
        return LLAMA2_TEMPLATE
    return CHATML_TEMPLATE


_SENTINEL = "\U000f0000{}\U000f0001"  # private-use code points around a message number: no space, no markup


def _content_spans(template: str, messages: list[dict], text: str, kwargs: dict) -> list[tuple[int, int]] | None:
    """Where in the rendered `text` the messages' contents are. The template is rendered a second time with
    each non-empty content replaced by a sentinel (an empty one, as an assistant turn of tool calls has, stays:
    templates test it for truth); the text between sentinels is the template's own, and each content
    (as given, or stripped as templates often do) must sit between them. None if the two renders cannot be
    lined up (a template that looks into the content)."""
    marked = [
        {**m, "content": _SENTINEL.format(i)} if isinstance(m.get("content"), str) and m["content"] else m
        for i, m in enumerate(messages)
    ]
    try:
        skeleton = render_chat(template, marked, **kwargs)
    except TracelmError:
        return None
    parts = re.split("\U000f0000(\\d+)\U000f0001", skeleton)
    fixed, numbers = parts[0::2], [int(n) for n in parts[1::2]]
    if not text.startswith(fixed[0]):
        return None
    pos, spans = len(fixed[0]), []
    for k, i in enumerate(numbers):
        content = messages[i]["content"]
        after = fixed[k + 1]
        for candidate in dict.fromkeys((content, content.strip(), content.rstrip(), content.lstrip())):
            end = pos + len(candidate)
            if text.startswith(candidate, pos) and text.startswith(after, end):
                break
        else:
            return None
        spans.append((pos, end))
        pos = end + len(after)
    return spans if pos == len(text) else None


def encode_chat(
    tokenizer: Any,
    template: str | None,
    messages: list[dict],
    add_generation_prompt: bool = True,
    **extra: Any,
) -> list[int]:
    """Token ids of a conversation rendered with `template` (None: the built-in one for the vocabulary).

    Control tokens are matched in the template's own text, never in the messages' contents: a user who types
    `<|im_end|>` gets the characters, not the token. Everywhere else the ids are those of encoding the
    rendered text with parse_special=True (as transformers' apply_chat_template does); BOS is put in front
    when the vocabulary adds one and the template did not write it.
    """
    if template is None:
        template = builtin_template_for(tokenizer)
    kwargs = {
        "bos_token": tokenizer.piece(tokenizer.bos_id) if tokenizer.bos_id is not None else "",
        "eos_token": tokenizer.piece(tokenizer.eos_id) if tokenizer.eos_id is not None else "",
        "add_generation_prompt": add_generation_prompt,
        **extra,
    }
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise TracelmError(f"chat message {i} must be a mapping with a string 'role'")
    messages = [dict(m) for m in messages]
    text = render_chat(template, messages, **kwargs)
    specials = tokenizer.control_tokens()
    spans = _content_spans(template, messages, text, kwargs)
    if spans is None:  # the template transforms contents: find them as written, in order
        spans, pos = [], 0
        for m in messages:
            content = m.get("content")
            if not isinstance(content, str) or not content:
                continue
            at = text.find(content, pos)
            if at < 0:
                if any(s in content for s in specials):
                    raise TracelmError("the chat template changes message text that spells a control token; "
                                       "tracelm cannot keep it plain text")
                continue
            spans.append((at, at + len(content)))
            pos = at + len(content)
    ids = _encode_outside(tokenizer, text, specials, spans)
    if tokenizer.add_bos and tokenizer.bos_id is not None and ids[:1] != [tokenizer.bos_id]:
        ids.insert(0, tokenizer.bos_id)
    return ids


def _encode_outside(tokenizer: Any, text: str, specials: Mapping[str, int], spans: list[tuple[int, int]]):
    """Encode `text` with control tokens matched only outside `spans` (leftmost, longest first)."""
    ids: list[int] = []
    if not specials:
        return tokenizer.encode(text, add_bos=False, add_eos=False)
    pattern = getattr(tokenizer, "_control_pattern", None)
    if pattern is None:
        pattern = re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)))
        tokenizer._control_pattern = pattern
    pos = start = 0
    k = 0
    while True:
        m = pattern.search(text, pos)
        if m is None:
            break
        while k < len(spans) and spans[k][1] <= m.start():
            k += 1
        if k < len(spans) and spans[k][0] < m.end():  # overlaps a message's content: plain text
            pos = m.start() + 1
            continue
        if m.start() > start:
            ids += tokenizer.encode(text[start : m.start()], add_bos=False, add_eos=False)
        ids.append(specials[m.group()])
        start = pos = m.end()
    if start < len(text):
        ids += tokenizer.encode(text[start:], add_bos=False, add_eos=False)
    return ids
