"""Chat templates: render a conversation to prompt text with the model's Jinja template, sandboxed.

The environment matches the one Hugging Face's `apply_chat_template` gives templates (trim_blocks,
lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII),
so a GGUF's `tokenizer.chat_template` renders here exactly as it does there. Tools are passed as transformers
passes them: `tools=[...]` (OpenAI's tool objects) as a variable of the render, and an assistant message's
`tool_calls` with each function's arguments as an object.

A template is code from a model file or a request, so it renders under a budget (`RenderBudget`): CPU seconds
and output characters, in a worker process (see `_Worker` for why), over budget a TracelmError naming the budget.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import pickle
import re
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple

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


class _OverBudget(Exception):
    """A string or list the template is about to build is larger than the output budget."""


class _Sandbox(ImmutableSandboxedEnvironment):
    # `*`, `+` and `**` go through call_binop (and are never folded at compile time), so `'x' * 10**9` is refused
    # before it is built; what else grows memory meets the worker's address-space limit
    intercepted_binops = frozenset({"*", "+", "**"})
    max_chars = 1_000_000  # set per render by the worker (RenderBudget.max_chars)

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        # The stock sandbox returns an Undefined that fails only when used; fail at once instead.
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__} is not allowed")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        size = _binop_size(operator, left, right)
        if size > self.max_chars:
            raise _OverBudget(f"{operator!r} would build {size} items")
        return super().call_binop(context, operator, left, right)


def _binop_size(operator: str, left: Any, right: Any) -> int:
    """How large the result of `left operator right` would be: items of a sequence, digits of a power (0: small)."""
    sized = (str, list, tuple)
    if operator == "*" and isinstance(left, sized) and isinstance(right, int):
        return len(left) * right
    if operator == "*" and isinstance(right, sized) and isinstance(left, int):
        return len(right) * left
    if operator == "+" and isinstance(left, sized) and isinstance(right, sized):
        return len(left) + len(right)
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        return right * max(abs(left), 1).bit_length() // 3  # about the decimal digits of left ** right
    return 0


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


class RenderBudget(NamedTuple):
    """What one rendering may take: CPU seconds of its worker, and characters of output (or of any string or list
    it builds). Over either, render_chat raises a TracelmError naming it."""

    cpu_seconds: float = 2.0
    max_chars: int = 1_000_000


DEFAULT_BUDGET = RenderBudget()


def render_chat(
    template: str | None,
    messages: list[dict],
    *,
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
    budget: RenderBudget | None = None,
    **extra: Any,
) -> str:
    """The prompt text for `messages` ([{"role": ..., "content": ...}, ...]); `None` uses ChatML. Rendered in a
    worker process under `budget` (DEFAULT_BUDGET when None)."""
    variables = dict(messages=messages, bos_token=bos_token, eos_token=eos_token,
                     add_generation_prompt=add_generation_prompt, **extra)
    try:
        request = pickle.dumps((CHATML_TEMPLATE if template is None else template, variables, budget or DEFAULT_BUDGET))
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        raise TracelmError(f"chat template variables must be plain data: {e}") from None
    return _POOL.render(request, budget or DEFAULT_BUDGET)


def _render_here(template: str, variables: dict[str, Any], max_chars: int) -> str:
    """Render in this process (the worker's side), the output counted as it is produced."""
    compiled = _compile(template)
    compiled.environment.max_chars = max_chars
    out, size = [], 0
    try:
        for piece in compiled.generate(**variables):
            size += len(piece)
            if size > max_chars:
                raise _OverBudget(f"{size} characters")
            out.append(piece)
    except _OverBudget:
        raise TracelmError(f"chat template: rendering output over {max_chars} characters "
                           "(template_max_chars)") from None
    except _TemplateRaised as e:
        raise TracelmError(f"chat template rejected the conversation: {e}") from None
    except SecurityError as e:
        raise TracelmError(f"chat template tried an unsafe operation: {e}") from None
    except MemoryError:
        raise  # the worker reports it (and is replaced)
    except Exception as e:  # a template is code: any error in it is an error in the model's files
        raise TracelmError(f"chat template failed: {type(e).__name__}: {e}") from None
    return "".join(out)


# ---------------------------------------------------------------- the render worker
#
# Why a worker process: a template can loop in C (`'x' * 10**9` or `2 ** 10**9`, a filter over a huge string)
# where no sandbox hook runs, so a step budget inside the interpreter cannot promise a bound, and a thread cannot
# be stopped: it would go on burning CPU after the request has gone. A process can be killed. One is started per
# concurrent render (at most _POOL_SIZE) and kept: a render is then one pickle out and one JSON frame back through
# pipes, about 0.2 ms more than rendering in-process (SmolLM2's template on 4 messages: ~0.04 ms in-process, ~0.25 ms
# through the worker, measured once on a busy machine), small against any prefill. The parent watches
# the worker's CPU time (/proc/PID/stat) while it waits and kills it the moment the budget is spent (a wall-clock
# limit of WALL_FACTOR x the budget backs that up); the worker also sets RLIMIT_CPU before each render (killed by
# SIGXCPU should its parent be gone) and RLIMIT_AS to its size at start + WORKER_MEMORY_MB, each only as high as
# the limits it was started with (`ulimit -v`, `ulimit -t`), never raising a hard one. A killed worker is
# replaced by the next render. Replies are JSON, never pickle: the parent trusts nothing the sandbox produced.

WORKER_MEMORY_MB = 512  # address space a worker may add to what it has after start (its interpreter + jinja2)
WALL_FACTOR = 10  # a render also ends after this many times its CPU budget of wall time (a loaded machine)
POLL_SECONDS = 0.02  # how often the parent looks at a busy worker's CPU time
_POOL_SIZE = 4  # renders at once (each its own worker); more wait for one
_FRAME = struct.Struct(">I")


def _over_cpu(budget: RenderBudget) -> TracelmError:
    return TracelmError(f"chat template: rendering exceeded {float(budget.cpu_seconds)!r} s of CPU "
                        "(template_cpu_seconds)")


def _cpu_seconds(pid: int, started: float) -> float:
    """CPU time (user + system) process `pid` has used; wall time since `started` where /proc is not there."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return time.monotonic() - started
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _read_exact(fd: int, n: int) -> bytes:
    chunks = []
    while n:
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


class _Worker:
    """One render process (`serve_renders`), fed requests through its stdin and answering on its stdout."""

    def __init__(self) -> None:
        roots = {str(Path(__file__).resolve().parents[2]), str(Path(jinja2.__file__).resolve().parents[1])}
        code = ("import sys; sys.path[:0] = sys.argv[1:]; "
                "from tracelm.io.chat_template import serve_renders; serve_renders()")
        env = {k: os.environ[k] for k in ("TZ", "LANG", "LC_ALL", "LC_TIME") if k in os.environ}  # no secrets
        try:
            self.proc = subprocess.Popen([sys.executable, "-I", "-c", code, *roots], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, bufsize=0, env=env, close_fds=True,
                                         start_new_session=True)  # a terminal's Ctrl-C is the parent's, not its
        except OSError as e:
            raise TracelmError(f"chat template: cannot start the render worker: {e.strerror or e}") from None

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.alive:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            pipe.close()

    def render(self, request: bytes, budget: RenderBudget) -> str:
        """Send one request, wait for its reply while the budget lasts; the worker is killed when it does not."""
        started = time.monotonic()
        cpu0 = _cpu_seconds(self.proc.pid, started)
        try:
            self.proc.stdin.write(_FRAME.pack(len(request)) + request)
            while not select.select([self.proc.stdout], [], [], POLL_SECONDS)[0]:
                used = _cpu_seconds(self.proc.pid, started) - cpu0
                if used > budget.cpu_seconds or time.monotonic() - started > WALL_FACTOR * budget.cpu_seconds:
                    self.kill()
                    raise _over_cpu(budget)
            fd = self.proc.stdout.fileno()
            reply = json.loads(_read_exact(fd, _FRAME.unpack(_read_exact(fd, _FRAME.size))[0]))
        except (EOFError, BrokenPipeError):
            raise self._died(budget) from None
        if "error" in reply:
            if reply.get("fatal"):
                self.kill()
            raise TracelmError(reply["error"])
        return reply["text"]

    def _died(self, budget: RenderBudget) -> TracelmError:
        code = self.proc.wait()
        self.kill()
        if code == -signal.SIGXCPU:
            return _over_cpu(budget)
        return TracelmError(f"chat template: the render worker ended (exit status {code}) while rendering")


class _Pool:
    """Workers kept between renders, at most `size` of them busy at once."""

    def __init__(self, size: int):
        self._idle: list[_Worker] = []
        self._slots = threading.BoundedSemaphore(size)
        self._lock = threading.Lock()

    def render(self, request: bytes, budget: RenderBudget) -> str:
        with self._slots:
            with self._lock:
                worker = self._idle.pop() if self._idle else None
            if worker is None or not worker.alive:
                worker = _Worker()
            try:
                return worker.render(request, budget)  # a TracelmError leaves it idle, or killed when over budget
            except BaseException:
                if not isinstance(sys.exc_info()[1], TracelmError):  # interrupted mid-render: it may still be busy
                    worker.kill()
                raise
            finally:
                if worker.alive:
                    with self._lock:
                        self._idle.append(worker)

    def pids(self) -> list[int]:
        """The live workers' process ids."""
        with self._lock:
            return [w.proc.pid for w in self._idle if w.alive]

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for w in idle:
            w.kill()


_POOL = _Pool(_POOL_SIZE)
atexit.register(_POOL.close)


def serve_renders() -> None:
    """The worker's loop: read a pickled (template, variables, budget) from stdin, answer one JSON frame on
    stdout ({"text"} or {"error", "fatal"}), until stdin closes."""
    import resource

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when a render stops (it kills the worker)
    page = os.sysconf("SC_PAGE_SIZE")
    size = int(Path("/proc/self/statm").read_text().split()[0]) * page
    given = {which: resource.getrlimit(which) for which in (resource.RLIMIT_AS, resource.RLIMIT_CPU)}
    _limit(resource, given, resource.RLIMIT_AS, size + (WORKER_MEMORY_MB << 20))
    stdin, stdout = sys.stdin.buffer.raw, sys.stdout.buffer.raw
    while True:
        try:
            head = _read_exact(stdin.fileno(), _FRAME.size)
        except EOFError:
            return
        template, variables, budget = pickle.loads(_read_exact(stdin.fileno(), _FRAME.unpack(head)[0]))
        used = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
        _limit(resource, given, resource.RLIMIT_CPU, int(used + budget.cpu_seconds) + 2)
        reply = _answer(template, variables, budget)
        data = json.dumps(reply).encode()  # ASCII: any lone surrogate of a message travels escaped
        _write_all(stdout.fileno(), _FRAME.pack(len(data)) + data)
        if reply.get("fatal"):
            return


def _limit(resource: Any, given: dict[int, tuple[int, int]], which: int, wanted: int) -> None:
    """Set the soft limit `which` to `wanted`, or to the soft limit the worker was started with when that is lower
    (`ulimit -v`, `ulimit -t`): never above what the process was given, and its hard limit never touched (raising
    a hard limit is not allowed, and the render would fail on every chat)."""
    soft, hard = given[which]
    if soft != resource.RLIM_INFINITY:
        wanted = min(wanted, soft)
    resource.setrlimit(which, (wanted, hard))


def _answer(template: str, variables: dict[str, Any], budget: RenderBudget) -> dict[str, Any]:
    try:
        return {"text": _render_here(template, variables, budget.max_chars)}
    except TracelmError as e:
        return {"error": str(e)}
    except MemoryError:
        return {"error": f"chat template: rendering exceeded the render worker's {WORKER_MEMORY_MB} MB of memory",
                "fatal": True}


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def chat_template_from_metadata(meta: Mapping[str, Any]) -> str | None:
    """The GGUF's default chat template (`tokenizer.chat_template`), or None when it has none."""
    template = meta.get("tokenizer.chat_template")
    return template if isinstance(template, str) and template.strip() else None


# ---------------------------------------------------------------- conversation -> token ids


BUILTIN_TEMPLATES = {"chatml": CHATML_TEMPLATE, "llama2": LLAMA2_TEMPLATE, "gemma": GEMMA_TEMPLATE}


def template_named(value: str) -> str:
    """A chat template as a config's `chat_template` (llama.cpp's --chat-template) gives it: a built-in's name, or
    Jinja text as it is. Anything else is a TracelmError naming the built-ins."""
    if value in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[value]
    if "{{" in value or "{%" in value:
        return value
    raise TracelmError(f"chat_template {value[:40]!r}: neither a built-in template ({', '.join(BUILTIN_TEMPLATES)}) "
                       "nor Jinja text ({{ ... }} / {% ... %}); --chat-template-file reads one from a file")


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
    *,
    budget: RenderBudget | None = None,
    **extra: Any,
) -> list[int]:
    """Token ids of a conversation rendered with `template` (None: the built-in one for the vocabulary).

    Control tokens are matched in the template's own text, never in the messages' contents: a user who types
    `<|im_end|>` gets the characters, not the token. Everywhere else the ids are those of encoding the
    rendered text with parse_special=True (as transformers' apply_chat_template does); BOS is put in front
    when the vocabulary adds one and the template did not write it. Each rendering runs under `budget`.
    """
    if template is None:
        template = builtin_template_for(tokenizer)
    kwargs = {
        "bos_token": tokenizer.piece(tokenizer.bos_id) if tokenizer.bos_id is not None else "",
        "eos_token": tokenizer.piece(tokenizer.eos_id) if tokenizer.eos_id is not None else "",
        "add_generation_prompt": add_generation_prompt,
        "budget": budget,
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
