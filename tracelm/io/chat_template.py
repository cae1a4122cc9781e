"""Chat templates: render a conversation to prompt text with the model's Jinja template, sandboxed.

The environment matches the one Hugging Face's `apply_chat_template` gives templates (trim_blocks,
lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII),
so a GGUF's `tokenizer.chat_template` renders here exactly as it does there.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.exceptions import SecurityError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tracelm import TracelmError

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


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
