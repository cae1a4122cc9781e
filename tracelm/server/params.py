"""OpenAI request bodies -> checked generation requests; every client mistake becomes an `ApiError` (4xx).

The checks follow the OpenAI API: unknown arguments are rejected, `null` means "not given", booleans
are not numbers, and values the engine cannot honour (best_of > 1, the legacy `functions`, ...) get a 400
that names the argument rather than being silently ignored.

`n`: that many choices sampled from one prefill of the prompt (checked against server.max_batch by the server).
`prompt` may hold several prompts (completions): each is checked and run as a request of its own, and the answer's
choices follow the prompts (prompt i's choice j at index i * n + j), as OpenAI numbers them.
`echo` (completions, not streamed): each choice's text begins with the prompt, and with `logprobs` its logprobs with
the prompt's tokens' (the first token's null: nothing precedes it); `max_tokens` 0 then scores the prompt alone.
Tools: `tools`, `tool_choice`, `parallel_tool_calls` (server/tools.py), and the conversation's tool turns: an
assistant message's `tool_calls` (its function.arguments a JSON object as text, given to the template as the
object, as transformers' templates expect) and `tool` messages answering them (`tool_call_id`).

Constrained output: `response_format` ({"type": "json_object"} or {"type": "json_schema", "json_schema": {"name",
"schema", "strict"}}) and, as vLLM spells them, `guided_regex` (the whole output matches the pattern) and
`guided_grammar` (a Lark grammar, llguidance's dialect), and as llama-server spells it, `grammar` (a GBNF grammar,
converted to Lark as it is read: the trace holds the grammar applied); at most one of them per request. `logit_bias`: an
object of token ids (as strings) to biases in [-100, 100], added to the logits before sampling.
"""

from __future__ import annotations

import json
import re
from typing import Any

import attrs

from tracelm.server.errors import bad, kind_of
from tracelm.server.tools import ToolRequest, parse_tools
from tracelm.state.errors import TracelmError, shown
from tracelm.state.records import Constraint

# Arguments every generation endpoint takes, plus tracelm's extensions (top_k, min_p, repetition_penalty,
# repeat_last_n, session_id).
_COMMON = frozenset({
    "model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "min_p",
    "repetition_penalty", "repeat_penalty", "repeat_last_n", "frequency_penalty", "presence_penalty", "seed",
    "stop", "n", "user", "session_id", "logprobs", "logit_bias", "response_format", "guided_regex", "guided_grammar",
    "grammar",
})
_COMPLETION = _COMMON | {"prompt", "echo", "best_of", "suffix"}
_CHAT = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "functions",
                   "function_call", "parallel_tool_calls", "store", "metadata"}
# Arguments accepted only at their neutral value (what the engine does anyway).
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "best_of": (1,), "suffix": ("",), "functions": ([],), "function_call": ("none",),
    "store": (False,),
}
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MAX_N = 128  # choices per request (OpenAI's bound; the server's is server.max_batch)
SESSION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
MAX_STOPS = 16
MAX_STOP_CHARS = 1024
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
MAX_TOKEN_ID = (1 << 31) - 1  # a token id as the request may write it (then checked against the vocabulary)


@attrs.frozen
class GenerationRequest:
    """What a completions or chat request asks for, checked; None = the server's default."""

    kind: str  # "completion" | "chat"
    model: str
    prompt: str | list[int] | None = None  # completions: text or token ids
    messages: list[dict[str, Any]] | None = None  # chat: [{"role", "content", ...}] with text content, for the template
    n: int = 1  # choices, sampled from one prefill
    max_tokens: int | None = None
    sampling: dict[str, Any] = attrs.Factory(dict)  # SamplingParams fields the request sets
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # top alternatives per token (0..), None = no logprobs
    session_id: str | None = None
    constraint_param: str | None = None  # the argument sampling["constraint"] came from (for its errors)
    tools: ToolRequest | None = None  # chat: tools, tool_choice, parallel_tool_calls
    predict_limit: float = 0.0  # seconds of generation after the prefill, 0: none (llama-server's t_max_predict_ms)
    echo: bool = False  # completions: the prompt before the text, with its tokens' logprobs when logprobs is given


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise bad("the request body is not UTF-8") from None
    if not text.strip():
        raise bad("the request body is empty; expected a JSON object")
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise bad(f"the request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise bad("the request body nests too deeply") from None
    except ValueError as e:
        raise bad(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, not {kind_of(body)}")
    return body


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _integer(body: dict[str, Any], key: str, lo: int, hi: int) -> int | None:
    x = body.get(key)
    if x is None:
        return None
    if isinstance(x, float) and x.is_integer():
        x = int(x)
    if isinstance(x, bool) or not isinstance(x, int):
        raise bad(f"'{key}' must be an integer, got {kind_of(x)}", key)
    if not lo <= x <= hi:
        raise bad(f"'{key}' must be between {lo} and {hi}, got {shown(x)}", key)
    return x


def _number(body: dict[str, Any], key: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    """A number within lo..hi, compared as given (an integer of any size, a float: NaN and infinities fail) before
    it becomes a float."""
    x = body.get(key)
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, int | float):
        raise bad(f"'{key}' must be a number, got {kind_of(x)}", key)
    if not lo <= x <= hi or (lo_open and x == lo):
        low = f"greater than {lo:g}" if lo_open else f"at least {lo:g}"
        raise bad(f"'{key}' must be {low} and at most {hi:g}, got {shown(x)}", key)
    return float(x)


def _boolean(body: dict[str, Any], key: str) -> bool | None:
    x = body.get(key)
    if x is not None and not isinstance(x, bool):
        raise bad(f"'{key}' must be a boolean, got {kind_of(x)}", key)
    return x


def _string(body: dict[str, Any], key: str) -> str | None:
    x = body.get(key)
    if x is not None and not isinstance(x, str):
        raise bad(f"'{key}' must be a string, got {kind_of(x)}", key)
    return x


def _stops(body: dict[str, Any]) -> tuple[str, ...]:
    x = body.get("stop")
    if x is None:
        return ()
    items = [x] if isinstance(x, str) else x
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad("'stop' must be a string or an array of strings", "stop")
    if len(items) > MAX_STOPS:
        raise bad(f"'stop' takes at most {MAX_STOPS} strings, got {len(items)}", "stop")
    if any(s == "" or len(s) > MAX_STOP_CHARS for s in items):
        raise bad(f"'stop' strings must have 1 to {MAX_STOP_CHARS} characters", "stop")
    return tuple(items)


def _response_format(x: Any) -> Constraint | None:
    """OpenAI's response_format: text (None), json_object, or json_schema {name, schema, strict, description}."""
    param = "response_format"
    if not isinstance(x, dict) or x.get("type") not in ("text", "json_object", "json_schema"):
        raise bad("'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": "
                  "\"json_schema\", \"json_schema\": {...}}", param)
    extra = set(x) - {"type", "json_schema"}
    if extra or (x["type"] != "json_schema" and "json_schema" in x):
        raise bad(f"'response_format': unexpected field {sorted(extra or {'json_schema'})[0]!r}", param)
    if x["type"] == "text":
        return None
    if x["type"] == "json_object":
        return Constraint("json_object")
    spec = x.get("json_schema")
    if not isinstance(spec, dict) or set(spec) - {"name", "schema", "strict", "description"}:
        raise bad("'response_format.json_schema' must be an object of name, schema, strict and description",
                  "response_format.json_schema")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise bad("'response_format.json_schema.name' is required (a string)", "response_format.json_schema.name")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise bad(f"'response_format.json_schema.schema' must be an object, got {kind_of(schema)}",
                  "response_format.json_schema.schema")
    strict = _boolean(spec, "strict")
    return Constraint("json_schema", json.dumps(schema, ensure_ascii=False), strict=bool(strict))


def _constraint(body: dict[str, Any]) -> tuple[Constraint | None, str | None]:
    """The request's constraint and the argument it came from: response_format, guided_regex, guided_grammar or
    grammar (GBNF)."""
    given = [k for k in ("response_format", "guided_regex", "guided_grammar", "grammar") if body.get(k) is not None]
    if len(given) > 1:
        raise bad(f"give at most one of 'response_format', 'guided_regex', 'guided_grammar' and 'grammar' (got "
                  f"{given})", given[1])
    if not given:
        return None, None
    key = given[0]
    if key == "response_format":
        c = _response_format(body[key])
        return c, (key if c is not None else None)
    source = _string(body, key)
    if not source:
        raise bad(f"'{key}' must be a non-empty string", key)
    if key == "grammar":
        from tracelm.session import lark_of_gbnf

        try:
            source = lark_of_gbnf(source, "'grammar'")
        except TracelmError as e:
            raise bad(str(e), key) from None
    return Constraint("regex" if key == "guided_regex" else "lark", source), key


def _logit_bias(body: dict[str, Any]) -> dict[int, float]:
    """OpenAI's logit_bias: {"token id": bias in [-100, 100]} (ids checked against the vocabulary later)."""
    x = body.get("logit_bias")
    if x is None:
        return {}
    if not isinstance(x, dict):
        raise bad(f"'logit_bias' must be an object of token ids to biases, got {kind_of(x)}", "logit_bias")
    if len(x) > MAX_LOGIT_BIAS:
        raise bad(f"'logit_bias' takes at most {MAX_LOGIT_BIAS} tokens, got {len(x)}", "logit_bias")
    out = {}
    for key in x:
        if not (isinstance(key, str) and key.isdigit() and key.isascii() and len(key) <= 10
                and int(key) <= MAX_TOKEN_ID):
            raise bad(f"'logit_bias' keys are token ids (0 to {MAX_TOKEN_ID}) written as decimal strings, got "
                      f"{shown(key)}", "logit_bias")
        bias = x[key]
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100.0 <= bias <= 100.0:
            raise bad(f"'logit_bias' {key}: a bias is a number from -100 to 100, got {shown(bias)}", "logit_bias")
        out[int(key)] = float(bias)
    return out


MAX_PROMPTS = 64  # prompts in one completions request (a batch, run max_batch sequences at a time)


def prompt_batch(body: dict[str, Any]) -> list[Any] | None:
    """The prompts of a completions request that holds several (OpenAI's array of strings or of token-id arrays),
    each to be checked as a request's own; None for one prompt (checked by `_prompt`)."""
    x = body.get("prompt")
    if not (isinstance(x, list) and len(x) > 1 and all(isinstance(p, str | list) for p in x)):
        return None
    if len(x) > MAX_PROMPTS:
        raise bad(f"'prompt' holds {len(x)} prompts; this server takes at most {MAX_PROMPTS} per request", "prompt")
    return x


def _prompt(body: dict[str, Any]) -> str | list[int]:
    x = body.get("prompt")
    if x is None:
        raise bad("'prompt' is required", "prompt")
    if isinstance(x, list) and len(x) == 1 and isinstance(x[0], str | list):
        x = x[0]  # one prompt in a batch of one
    if isinstance(x, str):
        return x
    if isinstance(x, list) and x and all(isinstance(i, int) and not isinstance(i, bool) for i in x):
        if not all(0 <= i <= MAX_TOKEN_ID for i in x):
            raise bad(f"'prompt' token ids are 0 to {MAX_TOKEN_ID}, got "
                      f"{shown(next(i for i in x if not 0 <= i <= MAX_TOKEN_ID))}", "prompt")
        return list(x)
    raise bad("'prompt' must be a string, an array of token ids, or an array holding one of those", "prompt")


def _content(m: dict[str, Any], i: int) -> str:
    c = m.get("content")
    if isinstance(c, str):
        return c
    if c is None and m.get("role") == "assistant":
        return ""
    if isinstance(c, list):
        texts = []
        for part in c:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad(f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) are supported",
                          f"messages[{i}].content")
            texts.append(part["text"])
        return "".join(texts)
    raise bad(f"messages[{i}].content must be a string or an array of text parts, got {kind_of(c)}",
              f"messages[{i}].content")


def _tool_calls(x: Any, i: int) -> list[dict[str, Any]]:
    """An assistant message's tool_calls, their arguments parsed (templates render them as JSON objects)."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(x, list) or not x:
        raise bad(f"'{where}' must be a non-empty array of tool calls, got {kind_of(x)}", where)
    out = []
    for j, call in enumerate(x):
        fn = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(fn.get("arguments"), str)
                and call.get("type", "function") == "function" and isinstance(call.get("id", ""), str)):
            raise bad(f"'{where}[{j}]' must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                      f"\"arguments\": a JSON string}}}}", f"{where}[{j}]")
        try:
            arguments = json.loads(fn["arguments"], parse_constant=_no_constant)
        except ValueError:
            raise bad(f"'{where}[{j}].function.arguments' is not valid JSON", f"{where}[{j}].function.arguments") \
                from None
        out.append({"id": call.get("id", ""), "type": "function",
                    "function": {"name": fn["name"], "arguments": arguments}})
    return out


def _message(m: Any, i: int) -> dict[str, Any]:
    if not isinstance(m, dict):
        raise bad(f"messages[{i}] must be an object, got {kind_of(m)}", f"messages[{i}]")
    role = m.get("role")
    if not isinstance(role, str) or role not in _ROLES:
        raise bad(f"messages[{i}].role must be one of {', '.join(_ROLES)}, got {role!r}", f"messages[{i}].role")
    allowed = {"role", "content", "name"} | {"assistant": {"tool_calls"}, "tool": {"tool_call_id"}}.get(role, set())
    if m.get("annotations") == []:  # as the openai client echoes an assistant message back
        allowed.add("annotations")
    extra = {k for k in m if m[k] is not None} - allowed
    if extra:
        raise bad(f"messages[{i}]: unsupported field {sorted(extra)[0]!r} (this server takes role, text content, "
                  "an assistant's tool_calls and a tool's tool_call_id)", f"messages[{i}]")
    out: dict[str, Any] = {"role": _ROLES[role], "content": _content(m, i)}
    if role == "assistant" and m.get("tool_calls") is not None:
        out["tool_calls"] = _tool_calls(m["tool_calls"], i)
    if role == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise bad(f"messages[{i}].tool_call_id is required (a string) in a tool message",
                      f"messages[{i}].tool_call_id")
        out["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            out["name"] = m["name"]
    return out


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    x = body.get("messages")
    if x is None:
        raise bad("'messages' is required", "messages")
    if not isinstance(x, list) or not x:
        raise bad("'messages' must be a non-empty array of messages", "messages")
    return [_message(m, i) for i, m in enumerate(x)]


def parse_request(body: dict[str, Any], kind: str) -> GenerationRequest:
    """Check a /v1/completions ("completion") or /v1/chat/completions ("chat") body."""
    _check_arguments(body, kind)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' is required: a model id from GET /v1/models", "model")
    sampling, constraint_param = _sampling(body)
    echo = kind == "completion" and bool(_boolean(body, "echo"))
    max_tokens, logprobs = _length_and_logprobs(body, kind, echo)
    stream, include_usage = _stream(body)
    if echo and stream:
        raise bad("'echo' with 'stream' is not supported by this server: ask without streaming", "echo")
    session_id, n = _session_and_n(body)
    tools = None
    if kind == "chat":
        tools = parse_tools(body)
        if tools is not None and tools.active and "constraint" in sampling:
            raise bad(f"'{constraint_param}' and 'tools' both constrain the reply: give tool_choice \"none\" or "
                      f"drop '{constraint_param}'", constraint_param)
    return GenerationRequest(
        kind=kind,
        model=model,
        prompt=_prompt(body) if kind == "completion" else None,
        messages=_messages(body) if kind == "chat" else None,
        max_tokens=max_tokens,
        sampling=sampling,
        seed=_integer(body, "seed", 0, (1 << 63) - 1),
        stop=_stops(body),
        stream=stream,
        include_usage=include_usage,
        logprobs=logprobs,
        session_id=session_id,
        constraint_param=constraint_param,
        n=n,
        tools=tools,
        echo=echo,
    )


def _check_arguments(body: dict[str, Any], kind: str) -> None:
    """Unknown arguments, and arguments at a value the engine cannot honour, are 400s that name them."""
    known = _COMPLETION if kind == "completion" else _CHAT
    for key in body:
        if key not in known:
            raise bad(f"Unrecognized request argument supplied: {key}", key, "unrecognized_argument")
    for key, neutral in _NEUTRAL.items():
        if key in body and body[key] is not None and body[key] not in neutral:
            raise bad(f"'{key}' = {json.dumps(body[key])[:60]} is not supported by this server", key, "unsupported")


def _sampling(body: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The SamplingParams fields the body sets, and the argument a constraint came from."""
    sampling: dict[str, Any] = {}
    for key, field, lo, hi, lo_open in (("temperature", "temperature", 0.0, 2.0, False),
                                        ("top_p", "top_p", 0.0, 1.0, True),
                                        ("min_p", "min_p", 0.0, 1.0, False),
                                        ("frequency_penalty", "frequency_penalty", -2.0, 2.0, False),
                                        ("presence_penalty", "presence_penalty", -2.0, 2.0, False),
                                        ("repetition_penalty", "repeat_penalty", 0.0, 10.0, True),
                                        ("repeat_penalty", "repeat_penalty", 0.0, 10.0, True)):
        value = _number(body, key, lo, hi, lo_open)
        if value is not None:
            sampling[field] = value
    for key, lo, hi in (("top_k", 0, 1 << 30), ("repeat_last_n", 0, 1 << 30)):
        value = _integer(body, key, lo, hi)
        if value is not None:
            sampling[key] = value
    constraint, constraint_param = _constraint(body)
    if constraint is not None:
        sampling["constraint"] = constraint
    if bias := _logit_bias(body):
        sampling["logit_bias"] = bias
    return sampling, constraint_param


def _length_and_logprobs(body: dict[str, Any], kind: str, echo: bool = False) -> tuple[int | None, int | None]:
    """max_tokens (chat: or max_completion_tokens; 0 only with echo: the prompt's logprobs alone) and the top
    alternatives per token (None: no logprobs)."""
    max_tokens = _integer(body, "max_tokens", 0 if echo else 1, 1 << 30)
    if kind != "chat":
        return max_tokens, _integer(body, "logprobs", 0, 5)
    mct = _integer(body, "max_completion_tokens", 1, 1 << 30)
    if mct is not None:
        if max_tokens is not None and max_tokens != mct:
            raise bad("give one of 'max_tokens' and 'max_completion_tokens'", "max_completion_tokens")
        max_tokens = mct
    top = _integer(body, "top_logprobs", 0, 20)
    if _boolean(body, "logprobs"):
        return max_tokens, top or 0
    if top is not None:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return max_tokens, None


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    """stream, and stream_options.include_usage."""
    stream = bool(_boolean(body, "stream"))
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise bad("'stream_options' is only allowed with 'stream': true", "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise bad("'stream_options' takes one key, include_usage", "stream_options")
    return stream, bool(_boolean(options, "include_usage"))


def _session_and_n(body: dict[str, Any]) -> tuple[str | None, int]:
    _string(body, "user")
    session_id = _string(body, "session_id")
    if session_id is not None and not SESSION_ID.fullmatch(session_id):
        raise bad("'session_id' must be 1-128 characters of letters, digits and . _ : -", "session_id")
    n = _integer(body, "n", 1, MAX_N) or 1
    if n > 1 and session_id is not None:
        raise bad("'n' > 1 cannot continue a session (which choice would it keep?): give n = 1 with 'session_id'",
                  "n")
    return session_id, n
