"""Tool calls on /v1/chat/completions: OpenAI's `tools` and `tool_choice`, checked; the grammar a tool call is
generated under; the calls parsed back out of the generated text.

The tools are rendered by the model's own chat template (as transformers' `apply_chat_template(tools=...)` passes
them). tracelm knows one tool-call format, the one Qwen2.5's and Hermes-style templates teach the model:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
    </tool_call>

one block per call. The markers are single tokens in such vocabularies (Qwen2.5: user-defined tokens no text can
spell); where the vocabulary has no such token they are plain text. A model whose template has no tools section, or
another format, gets a 400 naming `tools`.

Generation is constrained by a Lark grammar (llguidance) whose calls are the known format with each function's
arguments under its `parameters` JSON schema (`%json`): `required` is one or more calls (one when
`parallel_tool_calls` is false), a named function exactly one call of it, `auto` free text, optionally followed by
calls (text cannot contain the marker token, so a call it starts is always a valid one), or one bare call without
the markers (`{"name": ..., "arguments": ...}` alone, as small models such as Qwen2.5-Coder-0.5B often answer): text
cannot start like one, so such a reply is a valid call too. `none` renders no tools and constrains nothing.
`ToolCallSplitter` turns the text into content and calls, piece by piece (streaming) or at once. Under `auto` it
also takes a call written as a fenced block (```json, then {"name": ..., "arguments": ...} naming a function of the
request, then ```). A call is sent once: a repeat (same name and arguments) is dropped, and so is any call after
the first when `parallel_tool_calls` is false; the engine ends a reply at its first dropped call (`ExcessCalls`:
small models repeat one call until max_tokens). No <tool_call> markup and no call cut short reaches `content`.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import attrs

from tracelm.server.errors import bad, kind_of
from tracelm.session import closed_schema, unspellable

OPEN, CLOSE = "<tool_call>", "</tool_call>"
BARE = '{"name"'  # how a bare call (no markers) begins, whitespace aside
FENCE = "```"  # a call written as a Markdown code block (```json ... ```), as small models do under `auto`
FENCE_LANGUAGES = ("", "json", "tool_call")  # the info strings of a fence that may hold a call
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_TOOLS = 128
# JSON whitespace inside arguments as tracelm's other JSON grammars allow it (tracelm/io/grammar.py)
WHITESPACE = r"(?: |\n[ \t]{0,20})"
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@attrs.frozen
class Function:
    """One tool of a request: a function the model may call, its arguments under `parameters` (a JSON schema)."""

    name: str
    parameters: dict[str, Any]
    strict: bool = False  # OpenAI's strict: objects hold only the properties they name


@attrs.frozen
class ToolChoice:
    """`tool_choice`: mode "auto", "none", "required" or "function" (exactly one call of `name`)."""

    mode: str
    name: str | None = None


@attrs.frozen
class ToolRequest:
    """What a chat request asks of tools: the tool objects as the template renders them, their functions, the
    choice, and whether several calls may come in one reply."""

    tools: tuple[dict[str, Any], ...]
    functions: tuple[Function, ...]
    choice: ToolChoice
    parallel: bool = True

    @property
    def active(self) -> bool:
        """The model may call a tool (tools rendered, the reply parsed for calls)."""
        return self.choice.mode != "none"


@attrs.frozen
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object as text

    def openai(self, index: int | None = None) -> dict[str, Any]:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def _function(tool: Any, i: int) -> Function:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise bad(f"'{where}' must be {{\"type\": \"function\", \"function\": {{\"name\", \"parameters\", "
                  "...}}", where)
    if set(tool) - {"type", "function"}:
        raise bad(f"'{where}': unexpected field {sorted(set(tool) - {'type', 'function'})[0]!r}", where)
    fn = tool["function"]
    extra = set(fn) - {"name", "description", "parameters", "strict"}
    if extra:
        raise bad(f"'{where}.function': unexpected field {sorted(extra)[0]!r}", f"{where}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise bad(f"'{where}.function.name' must be 1 to 64 letters, digits, '_' or '-', got "
                  f"{json.dumps(name)[:80]}", f"{where}.function.name")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise bad(f"'{where}.function.description' must be a string, got {kind_of(fn['description'])}",
                  f"{where}.function.description")
    parameters = fn.get("parameters", EMPTY_PARAMETERS)
    if not isinstance(parameters, dict):
        raise bad(f"'{where}.function.parameters' must be a JSON schema object, got {kind_of(parameters)}",
                  f"{where}.function.parameters")
    if parameters.get("type", "object") != "object":
        raise bad(f"'{where}.function.parameters' must describe an object (\"type\": \"object\"), got type "
                  f"{json.dumps(parameters.get('type'))[:40]}", f"{where}.function.parameters")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad(f"'{where}.function.strict' must be a boolean, got {kind_of(strict)}", f"{where}.function.strict")
    return Function(name, parameters, bool(strict))


def _choice(x: Any, names: set[str]) -> ToolChoice:
    if x is None:
        return ToolChoice("auto" if names else "none")
    if isinstance(x, str):
        if x not in ("auto", "none", "required"):
            raise bad(f"'tool_choice' must be \"auto\", \"none\", \"required\" or {{\"type\": \"function\", "
                      f"\"function\": {{\"name\": ...}}}}, got {json.dumps(x)[:60]}", "tool_choice")
        if x != "none" and not names:
            raise bad(f"'tool_choice' {x!r} needs 'tools'", "tool_choice")
        return ToolChoice(x)
    fn = x.get("function") if isinstance(x, dict) and x.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad("'tool_choice' must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"function\": "
                  "{\"name\": ...}}", "tool_choice")
    if fn["name"] not in names:
        known = ", ".join(sorted(names)) or "none"
        raise bad(f"'tool_choice' names the function {fn['name'][:64]!r}, which is not in 'tools' (given: {known})",
                  "tool_choice")
    return ToolChoice("function", fn["name"])


def parse_tools(body: dict[str, Any]) -> ToolRequest | None:
    """The request's tools (None without any): `tools`, `tool_choice`, `parallel_tool_calls`, checked."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None and choice is None:
        return None
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise bad(f"'tools' must be an array of tools, got {kind_of(tools)}", "tools")
    if len(tools) > MAX_TOOLS:
        raise bad(f"'tools' takes at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    functions = tuple(_function(t, i) for i, t in enumerate(tools))
    names = [f.name for f in functions]
    if len(set(names)) < len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise bad(f"'tools' names the function {dup!r} twice", "tools")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad(f"'parallel_tool_calls' must be a boolean, got {kind_of(parallel)}", "parallel_tool_calls")
    if not functions and choice is None:
        return None
    return ToolRequest(tuple(tools), functions, _choice(choice, set(names)), parallel is not False)


# ---------------------------------------------------------------- the template and the vocabulary


def template_tool_format(template: str | None) -> str | None:
    """Why the chat template cannot take tools (None: it renders them and teaches tracelm's <tool_call> format)."""
    if template is None or not re.search(r"\btools\b", template):
        return "this model's chat template has no tools section: the model was not trained to call tools"
    if OPEN not in template:
        return (f"this model's chat template asks for tool calls in a format tracelm does not parse (it knows the "
                f"{OPEN} JSON blocks of Qwen2.5 / Hermes-style templates)")
    return None


def _marker(tok: Any, text: str) -> str:
    """The marker in the grammar: its token (`<[id]>`) where the vocabulary has it as a token no text can spell
    (as tracelm/io/grammar.py marks them), else the literal text."""
    i = tok.token_id(text)
    return f"<[{i}]>" if i is not None and unspellable(tok, i) else json.dumps(text)


def _arguments_schema(fn: Function) -> dict[str, Any]:
    schema = closed_schema(fn.parameters) if fn.strict else dict(fn.parameters)
    options = {"whitespace_pattern": WHITESPACE, **({} if fn.strict else {"lenient": True})}
    return {**schema, "x-guidance": {**options, **schema.get("x-guidance", {})}}


def tool_grammar(req: ToolRequest, tok: Any) -> str:
    """The Lark grammar (llguidance's dialect) of a reply under `req` (see the module docstring)."""
    open_, close = _marker(tok, OPEN), _marker(tok, CLOSE)
    chosen = [f for f in req.functions if req.choice.mode != "function" or f.name == req.choice.name]
    lines = [f"call: {open_} \"\\n\" fn \"\\n\" {close}",
             f"fn: {' | '.join(f'fn_{k}' for k in range(len(chosen)))}"]
    for k, fn in enumerate(chosen):
        head = json.dumps(f'{{"name": "{fn.name}", "arguments": ')
        lines.append(f"fn_{k}: {head} args_{k} \"}}\"")
        lines.append(f"args_{k}: %json {json.dumps(_arguments_schema(fn), ensure_ascii=False)}")
    calls = "calls: call (\"\\n\" call)*" if req.parallel and req.choice.mode != "function" else "calls: call"
    if req.choice.mode == "auto":  # text that does not begin like a bare call, then calls; or a bare call
        start = ["start: TEXT | TEXT? calls | fn", r'TEXT: /(.|\n)+/ & ~/[ \t\n]*\{[ \t\n]*"name"(.|\n)*/']
    else:
        start = ["start: calls"]
    return "\n".join([*start, calls, *lines]) + "\n"


def function_grammar(fn: Function) -> str:
    """A grammar of one function's arguments alone: to name a bad `parameters` schema in its error."""
    return f"start: %json {json.dumps(_arguments_schema(fn), ensure_ascii=False)}\n"


# ---------------------------------------------------------------- generated text -> content and calls


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _call(block: str, names: set[str]) -> ToolCall | None:
    """One block's call, or None when it is not one (not JSON, no such function, arguments not an object)."""
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string, as the API returns them
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


def _fenced_calls(block: str, names: set[str]) -> list[ToolCall] | None:
    """The calls of a fenced block (```json + a call object, or an array of them, + ```), or None when it holds
    none (another language, not JSON, or not calls of the request's functions)."""
    head, _, body = block[len(FENCE) : -len(FENCE)].partition("\n")
    if head.strip().lower() not in FENCE_LANGUAGES:
        return None
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    items = obj if isinstance(obj, list) and obj else [obj]
    calls = [_call(json.dumps(x, ensure_ascii=False), names) for x in items]
    return None if any(c is None for c in calls) else calls


def _begins_bare(text: str) -> bool:
    compact = re.sub(r"\s+", "", text)
    return BARE.startswith(compact) or compact.startswith(BARE)


def _hold(text: str) -> int:
    """How many trailing characters of content to hold back: a suffix that may begin a call marker or a fence,
    and the whitespace before it (dropped if a call follows)."""
    k = next((k for k in range(min(len(OPEN) - 1, len(text)), 0, -1)
              if OPEN.startswith(text[-k:]) or FENCE.startswith(text[-k:])), 0)
    return len(text) - len(text[: len(text) - k].rstrip())


class ToolCallSplitter:
    """A reply's text, fed piece by piece, as what to send: ("content", text) and ("call", ToolCall) items.

    Content goes out as it comes, except what might begin a <tool_call> marker or a code fence; each block becomes a
    call once its </tool_call> arrives, each fenced block (```json) once its closing fence does, if it holds calls of
    known functions (else it is content). A call is sent once: one that repeats an earlier one (name and arguments),
    or a second one when `parallel` is false, is dropped and counted in `excess`. Markup never reaches the content:
    a <tool_call> block that is not a call, or one cut short, is dropped, as is a bare call cut short."""

    def __init__(self, names: set[str], parallel: bool = True):
        self.names = names
        self.parallel = parallel
        self.buffer = ""
        self.in_call = False
        self.in_fence = False
        self.space = ""  # whitespace before a fence, held back until the fence turns out to be content
        self.calls = 0
        self.excess = 0  # calls dropped: repeats, or beyond the one allowed
        self.seen: set[tuple[str, str]] = set()
        self.sent = False  # content has gone out (so the reply is not a bare call)

    def _maybe_bare(self) -> bool:
        """Nothing sent yet and the reply so far begins like a bare call: hold it all until the end."""
        return not self.sent and not self.calls and not self.excess and _begins_bare(self.buffer)

    def push(self, text: str) -> list[tuple[str, Any]]:
        self.buffer += text
        out: list[tuple[str, Any]] = []
        while True:
            if not (self.in_call or self.in_fence) and self._maybe_bare():
                return out
            if self.in_call:
                end = self.buffer.find(CLOSE)
                if end < 0:
                    return out
                block, self.buffer = self.buffer[: end + len(CLOSE)], self.buffer[end + len(CLOSE) :].lstrip()
                call = _call(block[len(OPEN) : end].strip(), self.names)
                if call is not None:
                    self._accept(out, call)
                self.in_call = False
            elif self.in_fence:
                end = self.buffer.find(FENCE, len(FENCE))
                if end < 0:
                    return out
                block, self.buffer = self.buffer[: end + len(FENCE)], self.buffer[end + len(FENCE) :]
                calls = _fenced_calls(block, self.names)
                if calls is None:
                    self._content(out, self.space + block)
                else:
                    self.buffer = self.buffer.lstrip()
                    for call in calls:
                        self._accept(out, call)
                self.in_fence, self.space = False, ""
            else:
                marks = [i for i in (self.buffer.find(OPEN), self.buffer.find(FENCE)) if i >= 0]
                if not marks:
                    keep = _hold(self.buffer)
                    self._content(out, self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    return out
                at = min(marks)
                before = self.buffer[:at].rstrip()
                self._content(out, before)
                self.in_call = self.buffer.startswith(OPEN, at)
                self.in_fence = not self.in_call
                self.space = self.buffer[len(before) : at] if self.in_fence else ""
                self.buffer = self.buffer[at:]

    def finish(self) -> list[tuple[str, Any]]:
        """What is left at the end of the reply: a bare call, else held-back text as content (an unfinished
        <tool_call> block or bare call is dropped: a call cut short is no call, and its markup no content)."""
        out: list[tuple[str, Any]] = []
        if not (self.in_call or self.in_fence) and self._maybe_bare():
            call = _call(self.buffer.strip(), self.names)
            if call is not None:
                self._accept(out, call)
        elif self.in_fence:  # an unclosed fence: text the model wrote, unless a call was being written in it
            body = self.buffer[len(FENCE) :].partition("\n")[2]
            if not _begins_bare(body) or not body.strip():
                self._content(out, self.space + self.buffer)
        elif not self.in_call:
            self._content(out, self.buffer if not self.calls else self.buffer.rstrip())
        self.buffer, self.in_call, self.in_fence, self.space = "", False, False, ""
        return out

    def _accept(self, out: list[tuple[str, Any]], call: ToolCall) -> None:
        key = (call.name, json.dumps(json.loads(call.arguments), sort_keys=True))
        if key in self.seen or (self.calls and not self.parallel):
            self.excess += 1
            return
        self.seen.add(key)
        out.append(("call", call))
        self.calls += 1

    def _content(self, out: list[tuple[str, Any]], text: str) -> None:
        if text:
            out.append(("content", text))
            self.sent = True


class ExcessCalls:
    """For the engine, per choice: True once the reply has written a call the splitter drops (a repeat of an
    earlier call, or a second one when `parallel` is false). Small models loop on one call until max_tokens; the
    reply can end there, its calls complete."""

    def __init__(self, names: set[str], parallel: bool = True):
        self.splitter = ToolCallSplitter(names, parallel)

    def __call__(self, text: str) -> bool:
        self.splitter.push(text)
        return self.splitter.excess > 0


def split_reply(text: str, names: set[str], parallel: bool = True) -> tuple[str | None, list[ToolCall]]:
    """A whole reply as (content, calls); content None when the reply is only calls."""
    s = ToolCallSplitter(names, parallel)
    items = s.push(text) + s.finish()
    calls = [x for kind, x in items if kind == "call"]
    content = "".join(x for kind, x in items if kind == "content")
    return (content if content.strip() or not calls else None), calls
