"""`tracelm serve`: tool calls (tools, tool_choice, tool turns in the conversation), n choices from one prefill, any
model name served (and --strict-model's 404). On the tiny synthetic model, given a chat template with a tools
section in the Qwen2.5 / Hermes <tool_call> format (its markers plain text in the byte-level vocabulary); the
pieces in-process (the grammar against Qwen2.5's own vocabulary, where the markers are tokens, the splitter, the
template against transformers' apply_chat_template)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_server_helpers import ServerProcess, assert_openai_error
from tracelm.server.params import parse_request
from tracelm.server.queue import choice_seed
from tracelm.server.tools import (
    Function,
    ToolChoice,
    ToolRequest,
    split_reply,
    template_tool_format,
    tool_grammar,
)

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is in the test extra")

# A small template in the shape of Qwen2.5's: the tools as JSON in a system turn, an assistant's calls as
# <tool_call> blocks, tool results in their own turn.
TOOLS_TEMPLATE = (
    "{%- if tools %}S:Tools:{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n"
    "Reply <tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}A:{% if message.content %}{{ message.content }}"
    "{% endif %}{% for tc in message.tool_calls %}\n<tool_call>\n{\"name\": \"{{ tc.function.name }}\", "
    "\"arguments\": {{ tc.function.arguments | tojson }}}\n</tool_call>{% endfor %}\n"
    "{%- elif message.role == 'tool' %}T:{{ message.content }}\n"
    "{%- else %}{{ message.role[0] | upper }}:{{ message.content }}\n{%- endif %}"
    "{%- endfor %}{% if add_generation_prompt %}A:{% endif %}"
)
CONTEXT = 1024
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"type": "string",
                                                                        "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": WEATHER_SCHEMA, "strict": True}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "strict": True, "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def with_template(src: Path, dst: Path, template: str, context: int) -> Path:
    """A copy of a GGUF with another chat template and context length (gguf-py's own metadata copier)."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    reader = gguf.GGUFReader(str(src))
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    writer = gguf.GGUFWriter(str(dst), arch=arch, endianess=reader.endianess)
    copy_with_new_metadata(reader, writer, {
        gguf.Keys.Tokenizer.CHAT_TEMPLATE: MetadataDetails(gguf.GGUFValueType.STRING, template),
        f"{arch}.context_length": MetadataDetails(gguf.GGUFValueType.UINT32, context),
    }, [])
    return dst


@pytest.fixture(scope="module")
def tools_gguf(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path) -> Path:
    return with_template(tiny_gguf, tmp_path_factory.mktemp("tools") / "tiny-tools.gguf", TOOLS_TEMPLATE, CONTEXT)


def serve(work: Path, model: Path, context: int = CONTEXT, **server) -> ServerProcess:
    config = {"model": str(model), "context": context, "max_tokens": 12, "threads": 1,
              "sampling": {"temperature": 0.0}, "server": {"queue_size": 4, "max_batch": 4, **server}}
    return ServerProcess(work, config)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tools_gguf: Path):
    work = tmp_path_factory.mktemp("tools-server")
    s = serve(work, tools_gguf, trace_dir=str(work / "traces"))
    s.traces = work / "traces"
    s.model_id = tools_gguf.stem
    yield s
    s.stop()


def chat(server: ServerProcess, **body):
    return server.request("POST", "/v1/chat/completions", {"model": server.model_id, "messages": ASK, **body})


def ok(reply) -> dict:
    assert reply.status == 200, reply.text
    return reply.json()


def sse(reply) -> list[dict]:
    """The data chunks of a streamed reply, [DONE] last."""
    assert reply.status == 200, reply.text
    frames = [ln[len("data: "):] for ln in reply.text.splitlines() if ln.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    return [json.loads(f) for f in frames[:-1]]


def valid_call(call: dict, name: str, schema: dict) -> dict:
    assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] == name
    args = json.loads(call["function"]["arguments"])
    jsonschema.validate(args, schema)
    return args


# --- tool calls -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_validates_against_its_schema(server, choice):
    reply = ok(chat(server, tools=[TIME_TOOL, WEATHER], tool_choice=choice, max_tokens=300, temperature=1.0,
                    seed=3, parallel_tool_calls=False))
    c = reply["choices"][0]
    assert c["finish_reason"] == "tool_calls", c
    assert c["message"]["content"] is None and len(c["message"]["tool_calls"]) == 1
    name = c["message"]["tool_calls"][0]["function"]["name"]
    if isinstance(choice, dict):
        assert name == "get_weather"
    valid_call(c["message"]["tool_calls"][0], name, WEATHER_SCHEMA if name == "get_weather" else
               TIME_TOOL["function"]["parameters"])


def test_tool_calls_stream_as_deltas_equal_to_the_whole_reply(server):
    body = {"tools": [WEATHER], "tool_choice": "required", "max_tokens": 300, "temperature": 0.9, "seed": 11,
            "parallel_tool_calls": False}
    whole = ok(chat(server, **body))["choices"][0]
    chunks = sse(chat(server, stream=True, **body))
    calls: dict[int, dict] = {}
    finish = None
    for ch in chunks:
        (c,) = ch["choices"]
        assert c["index"] == 0
        for d in c["delta"].get("tool_calls") or []:
            slot = calls.setdefault(d["index"], {"id": None, "name": "", "arguments": ""})
            slot["id"] = d.get("id") or slot["id"]
            slot["name"] += d.get("function", {}).get("name", "")
            slot["arguments"] += d["function"].get("arguments", "")
        assert not c["delta"].get("content")
        finish = c["finish_reason"] or finish
    assert finish == "tool_calls" and list(calls) == list(range(len(whole["message"]["tool_calls"])))
    for k, call in calls.items():
        theirs = whole["message"]["tool_calls"][k]["function"]
        assert (call["name"], json.loads(call["arguments"])) == (theirs["name"], json.loads(theirs["arguments"]))
        assert call["id"].startswith("call_")


def test_auto_and_none_are_plain_text_unless_a_call_comes(server):
    for choice in ("auto", "none"):
        c = ok(chat(server, tools=[WEATHER], tool_choice=choice, max_tokens=8))["choices"][0]
        message = c["message"]
        if message.get("tool_calls"):  # auto: a call the random model started is a valid one
            assert choice == "auto"
            valid_call(message["tool_calls"][0], "get_weather", WEATHER_SCHEMA)
        else:
            assert isinstance(message["content"], str) and c["finish_reason"] in ("stop", "length")
    # none renders no tools: the prompt is the plain conversation's
    plain = ok(chat(server, max_tokens=1))["usage"]["prompt_tokens"]
    assert ok(chat(server, tools=[WEATHER], tool_choice="none", max_tokens=1))["usage"]["prompt_tokens"] == plain
    assert ok(chat(server, tools=[WEATHER], tool_choice="auto", max_tokens=1))["usage"]["prompt_tokens"] > plain + 50


def test_tool_turns_are_accepted_and_rendered(server):
    first = ok(chat(server, tools=[WEATHER], tool_choice="required", max_tokens=300, seed=5))["choices"][0]
    call = first["message"]["tool_calls"][0]
    turns = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call], "refusal": None},
             {"role": "tool", "tool_call_id": call["id"], "content": "{\"temperature\": 21}"}]
    base = ok(chat(server, tools=[WEATHER], max_tokens=1))["usage"]["prompt_tokens"]
    reply = ok(server.request("POST", "/v1/chat/completions", {"model": server.model_id, "messages": turns,
                                                                "tools": [WEATHER], "max_tokens": 4}))
    rendered = len(f"\n<tool_call>\n{{\"name\": \"get_weather\", \"arguments\": {call['function']['arguments']}}}"
                   "\n</tool_call>\nT:{\"temperature\": 21}\n")
    assert reply["usage"]["prompt_tokens"] - base >= rendered // 2  # the byte-level vocabulary's few merges


BAD_TOOL_REQUESTS = [
    ({"tools": [{"type": "function", "function": {"name": "x", "parameters": {
        "type": "object", "properties": {"a": {"type": "foo"}}}}}], "tool_choice": "required"},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "bad name!"}}]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x", "parameters": []}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "tool", "content": "21"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, "messages[0]"),
    ({"n": 5}, "n"),
    ({"n": 0}, "n"),
    ({"n": 2, "session_id": "s1"}, "n"),
]


@pytest.mark.parametrize("body, param", BAD_TOOL_REQUESTS, ids=[p for _b, p in BAD_TOOL_REQUESTS])
def test_bad_tool_and_n_requests_are_400s_naming_the_field(server, body, param):
    assert_openai_error(chat(server, **body), 400, param)
    assert ok(chat(server, max_tokens=1))["choices"]  # still serving


def test_a_template_without_tools_refuses_them(tmp_path, tiny_gguf):
    assert "no tools section" in template_tool_format(None)
    assert "no tools section" in template_tool_format("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert "format" in template_tool_format("{% if tools %}{{ tools | tojson }}[TOOL_CALLS]{% endif %}")
    assert template_tool_format(TOOLS_TEMPLATE) is None
    s = serve(tmp_path / "plain", tiny_gguf, context=128, strict_model=True)
    try:
        body = {"model": tiny_gguf.stem, "messages": ASK, "tools": [WEATHER]}
        assert_openai_error(s.request("POST", "/v1/chat/completions", body), 400, "tools")
        ok(s.request("POST", "/v1/chat/completions", {**body, "tool_choice": "none", "max_tokens": 2}))
        # --strict-model: another name is a 404, the loaded one's serves
        assert_openai_error(s.request("POST", "/v1/chat/completions", {**body, "model": "gpt-4o"}), 404, "model",
                            "model_not_found")
        assert_openai_error(s.request("POST", "/v1/completions", {"model": "gpt-4o", "prompt": "hi"}), 404, "model")
    finally:
        s.stop()


# --- any model name, n choices ------------------------------------------------------------------------------


def test_any_model_name_is_served_by_the_loaded_model(server):
    for name in ("gpt-4o", "llama3", server.model_id):
        reply = ok(server.request("POST", "/v1/completions", {"model": name, "prompt": "hello", "max_tokens": 2}))
        assert reply["model"] == server.model_id
    assert_openai_error(server.request("GET", "/v1/models/gpt-4o"), 404, code="model_not_found")  # a lookup stays


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
def test_n_choices_from_one_prefill_reproducible_with_a_seed(server, endpoint):
    def ask(**kw):
        if endpoint == "chat":
            return ok(chat(server, max_tokens=10, temperature=1.0, seed=42, **kw))
        return ok(server.request("POST", "/v1/completions", {"model": "any", "prompt": "hello there", "max_tokens": 10,
                                                            "temperature": 1.0, "seed": 42, **kw}))

    def text(c):
        return c["message"]["content"] if endpoint == "chat" else c["text"]

    one, three = ask(), ask(n=3)
    assert [c["index"] for c in three["choices"]] == [0, 1, 2]
    u = three["usage"]
    assert u["prefill_passes"] == 1 and one["usage"]["prefill_passes"] == 1
    assert u["prompt_tokens"] == one["usage"]["prompt_tokens"]
    assert u["completion_tokens"] == u["total_tokens"] - u["prompt_tokens"] >= 3
    assert text(three["choices"][0]) == text(one["choices"][0])  # choice 0 has the request's own seed
    assert len({text(c) for c in three["choices"]}) == 3  # the others their own
    assert [text(c) for c in ask(n=3)["choices"]] == [text(c) for c in three["choices"]]  # reproducible
    assert server.health()["counters"]["forks"] >= 4


def test_n_choices_stream_with_their_index(server):
    body = {"max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 2}
    whole = ok(chat(server, **body))
    chunks = sse(chat(server, stream=True, stream_options={"include_usage": True}, **body))
    texts, finishes, roles = ["", ""], [None, None], 0
    for ch in chunks[:-1]:
        (c,) = ch["choices"]
        roles += c["delta"].get("role") == "assistant"
        texts[c["index"]] += c["delta"].get("content") or ""
        finishes[c["index"]] = c["finish_reason"] or finishes[c["index"]]
    assert roles == 2
    assert texts == [c["message"]["content"] for c in whole["choices"]]
    assert finishes == [c["finish_reason"] for c in whole["choices"]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]


def test_choice_seeds():
    assert choice_seed(42, 0) == 42
    seeds = {choice_seed(42, i) for i in range(1, 9)}
    assert len(seeds) == 8 and all(0 <= s < 1 << 63 for s in seeds) and 42 not in seeds
    assert choice_seed(42, 1) == choice_seed(42, 1) != choice_seed(43, 1)


# --- the pieces in-process ----------------------------------------------------------------------------------


def test_splitter_gives_the_same_content_and_calls_for_any_cut():
    reply = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
             '\n</tool_call>\n<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>')
    content, calls = split_reply(reply, {"get_weather"})
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert content == "Let me look."  # an unknown function's block is dropped: no markup in the content
    from tracelm.server.tools import ToolCallSplitter

    for cut in range(1, 12):
        s = ToolCallSplitter({"get_weather"})
        items = [x for i in range(0, len(reply), cut) for x in s.push(reply[i : i + cut])] + s.finish()
        assert "".join(x for k, x in items if k == "content") == content
        assert [(x.name, x.arguments) for k, x in items if k == "call"] == [(c.name, c.arguments) for c in calls]
    assert split_reply("Plain <tool text\n", {"get_weather"}) == ("Plain <tool text\n", [])
    bare = '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}'  # a call without markers
    for cut in (1, 3, 7, len(bare)):
        s = ToolCallSplitter({"get_weather"})
        items = [x for i in range(0, len(bare), cut) for x in s.push(bare[i : i + cut])] + s.finish()
        assert [k for k, _x in items] == ["call"] and json.loads(items[0][1].arguments)["city"] == "Rome"
    assert split_reply('{"name": "nope", "arguments": {}}', {"get_weather"})[1] == []
    assert split_reply('<tool_call>\n{"name": "get_weather", "arguments": {"ci', {"get_weather"})[1] == []


PING = {"type": "function", "function": {"name": "ping", "strict": True,
                                         "parameters": {"type": "object", "properties": {}}}}


def pieces(reply: str, cut: int, names: set[str], parallel: bool = True) -> tuple[str, list[tuple[str, dict]]]:
    """The reply through a ToolCallSplitter `cut` characters at a time: its content and (name, arguments) calls."""
    from tracelm.server.tools import ToolCallSplitter

    s = ToolCallSplitter(names, parallel)
    items = [x for i in range(0, len(reply), cut) for x in s.push(reply[i : i + cut])] + s.finish()
    return ("".join(x for k, x in items if k == "content"),
            [(x.name, json.loads(x.arguments)) for k, x in items if k == "call"])


def test_a_repeated_call_is_sent_once_and_markup_never_reaches_the_content():
    """Issue 30 item 6: Qwen2.5-Coder-0.5B under tool_choice required gave three copies of one call and then a
    block cut short by max_tokens, its <tool_call> markup in `content`."""
    block = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    again = block.replace('{"city": "Paris", "unit": "celsius"}', '{"unit": "celsius",  "city": "Paris"}')
    other = block.replace("Paris", "Rome")
    reply = f"{block}\n{again}\n{other}\n{block}\n<tool_call>\n{{\"name\": \"get_weather\", \"argu"
    paris, rome = ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_weather", {"city": "Rome",
                                                                                          "unit": "celsius"})
    for cut in (1, 5, 13, len(reply)):
        assert pieces(reply, cut, {"get_weather"}) == ("", [paris, rome])
        assert pieces(reply, cut, {"get_weather"}, parallel=False) == ("", [paris])
    assert split_reply(reply, {"get_weather"})[0] is None
    assert split_reply("Sure. " + block[:30], {"get_weather"}) == ("Sure.", [])  # a call cut short: dropped
    assert split_reply('{"name": "get_weather", "argu', {"get_weather"}) == ("", [])  # a bare one too
    from tracelm.server.tools import ExcessCalls

    watch = ExcessCalls({"get_weather"})
    assert not watch(block + "\n") and not watch(other[:40]) and not watch(other[40:]) and watch(again)
    single = ExcessCalls({"get_weather"}, parallel=False)
    assert not single(block) and single(other)


def test_a_fenced_json_call_is_a_call():
    """Issue 30 item 6: under `auto` small models write a call as a Markdown ```json block."""
    call = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
    oslo = ("get_weather", {"city": "Oslo", "unit": "celsius"})
    for reply, want in [
        (f"```json\n{call}\n```", ("", [oslo])),
        (f"I will check.\n\n```json\n{call}\n```\n", ("I will check.", [oslo])),
        (f"```\n[{call}, {call.replace('Oslo', 'Bergen')}]\n```", ("", [oslo, ("get_weather", {"city": "Bergen",
                                                                                              "unit": "celsius"})])),
        ("Code:\n```python\nprint(1)\n```\nDone.", ("Code:\n```python\nprint(1)\n```\nDone.", [])),
        ('```json\n{"name": "nope", "arguments": {}}\n```', ('```json\n{"name": "nope", "arguments": {}}\n```', [])),
        ("Use `x` or ``y``.", ("Use `x` or ``y``.", [])),
        (f"```json\n{call[:30]}", ("", [])),  # a fenced call cut short: dropped
        ("```\nunfinished code", ("```\nunfinished code", [])),
    ]:
        for cut in (1, 4, 9, len(reply)):
            assert pieces(reply, cut, {"get_weather"}) == want, (reply, cut)


def test_required_ends_at_a_repeated_call(server):
    """A tool without arguments, tool_choice required, parallel calls allowed, the end token biased away: the
    random model can only write the same call again and again. The reply is that one call (finish_reason
    tool_calls, no content), streamed or not; the trace's footer says the server ended the run, and it replays."""
    import subprocess
    import sys

    from tests.conftest import child_env

    body = {"tools": [PING], "tool_choice": "required", "max_tokens": 400, "temperature": 0.8, "seed": 2,
            "logit_bias": {"259": -100}}
    whole = ok(chat(server, **body))
    c = whole["choices"][0]
    assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None, c
    assert [t["function"]["name"] for t in c["message"]["tool_calls"]] == ["ping"]
    assert whole["usage"]["completion_tokens"] < 400
    chunks = sse(chat(server, stream=True, **body))
    deltas = [d for ch in chunks for d in ch["choices"][0]["delta"].get("tool_calls") or []]
    assert {d["index"] for d in deltas} == {0} and not any(ch["choices"][0]["delta"].get("content") for ch in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    trace = server.traces / f"{whole['id']}.jsonl"
    footer = json.loads(trace.read_text().splitlines()[-1])
    assert footer["status"] == "interrupted" and footer["finish_reason"] == "stop"
    replayed = subprocess.run([sys.executable, "-m", "tracelm.cli", "replay", str(trace), "--require", "intact"],
                              capture_output=True, text=True, timeout=120, env=child_env())
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr


def test_parse_request_of_tools_and_tool_turns():
    req = parse_request({"model": "m", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"X\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], "tools": [WEATHER], "n": 2}, "chat")
    assert req.n == 2 and req.tools.choice == ToolChoice("auto") and req.tools.parallel
    assert req.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "X"}
    assert req.messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    assert parse_request({"model": "m", "messages": ASK, "tools": [WEATHER], "tool_choice": "none"},
                         "chat").tools.active is False


def _allowed(matcher, tok, text: str) -> bool:
    """Whether the matcher takes `text` token by token (consuming it)."""
    for i in tok.encode(text, add_bos=False, add_eos=False):
        mask = matcher.mask()
        if not (int(mask[i >> 5]) >> (i & 31)) & 1:
            return False
        matcher.consume(i, "0" * 32)
    return True


def test_tool_grammar_on_a_byte_vocabulary(tools_gguf):
    from tracelm.io.grammar import Matcher
    from tracelm.io.loader import ModelFile
    from tracelm.state.records import Constraint

    tok = ModelFile(str(tools_gguf)).tokenizer
    fns = (Function("get_weather", WEATHER_SCHEMA, strict=True),)
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'
    req = ToolRequest((WEATHER,), fns, ToolChoice("required"))
    assert _allowed(Matcher(Constraint("lark", tool_grammar(req, tok)), tok), tok, good)
    kelvin = good.replace("celsius", "kelvin")
    assert not _allowed(Matcher(Constraint("lark", tool_grammar(req, tok)), tok), tok, kelvin)
    assert not _allowed(Matcher(Constraint("lark", tool_grammar(req, tok)), tok), tok, "Sure!")  # must call
    auto = Constraint("lark", tool_grammar(attrs_evolve(req, choice=ToolChoice("auto")), tok))
    assert _allowed(Matcher(auto, tok), tok, "Sure! " + good)
    bare = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
    assert _allowed(Matcher(auto, tok), tok, bare)
    assert not _allowed(Matcher(auto, tok), tok, bare.replace("celsius", "kelvin"))  # text cannot begin like one
    assert _allowed(Matcher(auto, tok), tok, '{"a": 1} is JSON')


def attrs_evolve(x, **kw):
    import attrs

    return attrs.evolve(x, **kw)


def qwen_tool_turns():
    return parse_request({"model": "m", "messages": [
        *ASK, {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21 C"}]}, "chat").messages


@pytest.mark.model
def test_qwen_markers_are_its_tokens_and_its_template_renders_tools(qwen_coder_path):
    from tracelm.io.chat_template import render_chat
    from tracelm.io.grammar import Matcher
    from tracelm.io.loader import ModelFile
    from tracelm.state.records import Constraint

    mf = ModelFile(str(qwen_coder_path))
    tok, template = mf.tokenizer, mf.tokenizer.chat_template
    req = ToolRequest((WEATHER,), (Function("get_weather", WEATHER_SCHEMA, strict=True),), ToolChoice("required"))
    grammar = tool_grammar(req, tok)
    assert f"<[{tok.token_id('<tool_call>')}]>" in grammar and f"<[{tok.token_id('</tool_call>')}]>" in grammar
    m = Matcher(Constraint("lark", grammar), tok)
    mask = m.mask()
    i = tok.token_id("<tool_call>")
    assert (int(mask[i >> 5]) >> (i & 31)) & 1 and int(mask.astype("uint32").view("uint32").sum() != 0)
    ours = render_chat(template, qwen_tool_turns(), tools=[WEATHER])
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    assert call in ours
    assert "<tool_response>\n21 C\n</tool_response>" in ours
    assert ours.index('"get_weather"') < ours.index("<|im_start|>user")  # the tools in the system turn


@pytest.mark.model
@pytest.mark.reference
def test_qwen_template_renders_tools_as_transformers_does(qwen_coder_path):
    import transformers
    from tokenizers import Tokenizer, models

    from tracelm.io.chat_template import render_chat
    from tracelm.io.loader import ModelFile

    template = ModelFile(str(qwen_coder_path)).tokenizer.chat_template
    messages = qwen_tool_turns()
    ours = render_chat(template, messages, tools=[WEATHER])

    stand_in = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=stand_in, chat_template=template)
    assert ours == hf.apply_chat_template(messages, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
