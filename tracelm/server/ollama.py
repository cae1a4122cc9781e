"""Ollama's API over the served model, so Ollama clients (the `ollama` Python package, tools written for Ollama) work
unchanged: POST /api/chat, POST /api/generate, POST /api/embed (and the older /api/embeddings), GET /api/tags,
POST /api/show, GET /api/version.

A request is translated into the OpenAI body the other routes take (options -> sampling arguments, `format` ->
`response_format`) and checked by the same code (params.py), then runs on the engine as theirs do
(`Server.answer`); only the answer's shape is Ollama's: JSON lines by default (`stream` absent or true), one JSON
object with `stream: false`; every line `{"model", "created_at", ...}`, the last one `done: true` with
`done_reason`, the token counts and the durations in nanoseconds. Errors are Ollama's `{"error": "message"}` with
the status the OpenAI routes would give (401 without the key when one is set, 400 naming the field, 429 ...).

/api/generate renders its prompt (and `system`) with the model's chat template, as Ollama does, unless `raw` is
true: then the prompt is the text given. A request with no prompt (no messages) only "loads" the model: `done_reason:
"load"`, as Ollama answers. Options for the hardware or the loader (num_ctx, num_gpu, num_thread, use_mmap, ...)
are accepted and ignored (the server's settings stand); options tracelm cannot honour (mirostat, tfs_z,
typical_p at other than their neutral values), images, tools, thinking, `template`, `suffix`, `context` and
logprobs are 400s that name them. /api/embed embeds each `input` as /v1/embeddings does (tokens.py: unit-length
vectors, `server.pooling`), cutting an input to the context unless `truncate` is false.
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tracelm.server.errors import ApiError, bad, kind_of
from tracelm.server.params import parse_json, parse_request
from tracelm.server.tokens import TokenRoutes, check_dimensions
from tracelm.version import __version__

OLLAMA_VERSION = "0.12.0"  # the Ollama API version these routes follow (GET /api/version)
# options -> the OpenAI argument they set
_OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
            "stop": "stop", "repeat_penalty": "repeat_penalty", "repeat_last_n": "repeat_last_n",
            "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}
# options about the hardware or the loader: the server's own settings stand
_IGNORED = frozenset({"numa", "num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all",
                      "vocab_only", "use_mmap", "use_mlock", "embedding_only", "num_thread", "num_keep"})
# options accepted at their neutral value only (what tracelm's sampler does anyway)
_NEUTRAL = {"mirostat": (0,), "tfs_z": (1, 1.0), "typical_p": (1, 1.0), "penalize_newline": (True, False)}
_CHAT = frozenset({"model", "messages", "tools", "format", "options", "stream", "keep_alive", "think", "logprobs",
                   "top_logprobs"})
_EMBED = frozenset({"model", "input", "truncate", "options", "keep_alive", "dimensions"})
_EMBEDDINGS = frozenset({"model", "prompt", "options", "keep_alive"})
_GENERATE = frozenset({"model", "prompt", "suffix", "system", "template", "context", "stream", "raw", "format",
                       "images", "options", "keep_alive", "think", "logprobs", "top_logprobs"})


def now() -> str:
    """Ollama's created_at: UTC, RFC 3339 with nanosecond digits."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%f000Z")


def ns(seconds: float) -> int:
    return int(seconds * 1e9)


def options(x: Any) -> dict[str, Any]:
    """Ollama's `options` as OpenAI arguments; a 400 naming `options.KEY` for one tracelm cannot honour."""
    if x is None:
        return {}
    if not isinstance(x, dict):
        raise bad(f"'options' must be an object, got {kind_of(x)}", "options")
    out: dict[str, Any] = {}
    for key, value in x.items():
        where = f"options.{key}"
        if value is None or key in _IGNORED:
            continue
        if key in _OPTIONS:
            out[_OPTIONS[key]] = value
        elif key == "num_predict":
            if isinstance(value, bool) or not isinstance(value, int) or not (value > 0 or value in (-1, -2)):
                raise bad(f"'{where}' must be a positive integer, or -1 / -2 (as many as the context allows), got "
                          f"{json.dumps(value)[:40]}", where)
            if value > 0:
                out["max_tokens"] = value
        elif key in _NEUTRAL:
            if isinstance(value, bool) != isinstance(_NEUTRAL[key][0], bool) or value not in _NEUTRAL[key]:
                raise bad(f"'{where}' = {json.dumps(value)[:40]} is not supported by this server", where)
        else:
            raise bad(f"'{where}' is not an option this server knows", where)
    if out.get("repeat_last_n") == -1:  # Ollama: the whole context
        out["repeat_last_n"] = 1 << 30
    return out


def response_format(x: Any) -> dict[str, Any] | None:
    """Ollama's `format`: "json", a JSON schema, or nothing -> OpenAI's response_format."""
    if x is None or x == "":
        return None
    if x == "json":
        return {"type": "json_object"}
    if isinstance(x, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": x, "strict": True}}
    raise bad(f"'format' must be \"json\" or a JSON schema (an object), got {json.dumps(x)[:40]}", "format")


def refuse(body: dict[str, Any], known: frozenset[str]) -> None:
    """Unknown fields, and fields tracelm does not serve here, are 400s naming them."""
    for key in body:
        if key not in known:
            raise bad(f"Unrecognized request field: {key}", key)
    if body.get("think"):
        raise bad(f"'think': \"{body.get('model')}\" does not support thinking", "think")
    for key in ("tools", "images", "context", "suffix", "template"):
        if body.get(key):
            raise bad(f"'{key}' is not supported on the Ollama routes of this server", key)
    if body.get("logprobs") or body.get("top_logprobs"):
        raise bad("'logprobs' is not supported on the Ollama routes; use /v1/chat/completions", "logprobs")


def message(m: Any, i: int) -> dict[str, Any]:
    """An Ollama chat message as an OpenAI one (an assistant's tool_calls with their arguments as JSON text, a tool
    message's `tool_name` as its name)."""
    if not isinstance(m, dict):
        raise bad(f"messages[{i}] must be an object, got {kind_of(m)}", f"messages[{i}]")
    extra = {k for k in m if m[k] not in (None, [], "")} - {"role", "content", "tool_calls", "tool_name", "thinking"}
    if extra:
        raise bad(f"messages[{i}]: unsupported field {sorted(extra)[0]!r}", f"messages[{i}]")
    out = {"role": m.get("role"), "content": m.get("content") or ""}
    if m.get("tool_calls"):
        calls = m["tool_calls"]
        if not isinstance(calls, list):
            raise bad(f"messages[{i}].tool_calls must be an array", f"messages[{i}].tool_calls")
        out["tool_calls"] = [
            {"id": f"call_{i}_{j}", "type": "function",
             "function": {"name": (c.get("function") or {}).get("name"),
                          "arguments": json.dumps((c.get("function") or {}).get("arguments", {}))}}
            if isinstance(c, dict) else c for j, c in enumerate(calls)]
    if m.get("role") == "tool":
        out["tool_call_id"] = f"call_{i}"
        if m.get("tool_name"):
            out["name"] = m["tool_name"]
    return out


def openai_body(body: dict[str, Any], stream: bool) -> dict[str, Any]:
    """The OpenAI arguments every Ollama generation request shares: model, stream, options, format."""
    out = {"model": body.get("model"), "stream": stream, **options(body.get("options"))}
    fmt = response_format(body.get("format"))
    if fmt is not None:
        out["response_format"] = fmt
    return out


def streams(body: dict[str, Any]) -> bool:
    """Ollama streams unless told `stream: false`."""
    x = body.get("stream")
    if x is not None and not isinstance(x, bool):
        raise bad(f"'stream' must be a boolean, got {kind_of(x)}", "stream")
    return x is not False


class OllamaShape:
    """Mixed into app.Shape (its `_events`, `_message`, ...): a job's events as Ollama's lines."""

    key = "message"  # "message" (chat) or "response" (generate); set per route
    started = 0.0

    def ndjson(self, _request: Request) -> bool:
        return True

    def _line(self, text: str, **fields: Any) -> dict[str, Any]:
        body = {"role": "assistant", "content": text} if self.key == "message" else text
        return {"model": self.req.model, "created_at": now(), self.key: body, **fields}

    def _final(self, text: str, done: dict[str, Any]) -> dict[str, Any]:
        return self._line(text, done=True, done_reason=done["finish_reason"],
                          total_duration=ns(time.monotonic() - self.job.arrived), load_duration=0,
                          prompt_eval_count=done["prompt_tokens"], prompt_eval_duration=ns(done["prefill_seconds"]),
                          eval_count=done["completion_tokens"], eval_duration=ns(done["decode_seconds"]))

    async def collect(self) -> dict[str, Any]:
        text, _entries, done = await self._one_choice()
        return self._final(text, done)

    async def stream(self, _ndjson: bool) -> AsyncIterator[bytes]:
        def frame(obj: dict[str, Any]) -> bytes:
            return (json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n").encode()

        finished = False
        try:
            async for event in self._events():
                if event[0] == "piece":
                    yield frame(self._line(event[1], done=False))
                elif event[0] == "error":
                    yield frame({"error": event[1].message})
                    break
                elif event[0] == "done":
                    yield frame(self._final("", event[1]))
            finished = True
        finally:
            if not finished:  # the client went away: stop generating
                self.job.gone.set()


def ollama_error(e: ApiError) -> Response:
    if e.status == 499:
        return Response(status_code=499)
    return JSONResponse({"error": e.message}, status_code=e.status, headers=e.headers)


class OllamaRoutes:
    def __init__(self, server: Any, openai_shape: type):
        self.server = server
        self.tokens = TokenRoutes(server)  # the embeddings' inputs and their Task on the engine
        self.shapes = {key: type(f"Ollama{key.title()}Shape", (OllamaShape, openai_shape), {"key": key})
                       for key in ("message", "response")}

    def routes(self) -> list[Route]:
        def answered(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
            async def run(request: Request) -> Response:
                try:
                    return await handler(request)
                except ApiError as e:
                    return ollama_error(e)
            return run

        return [Route("/api/chat", answered(self.chat), methods=["POST"]),
                Route("/api/generate", answered(self.generate), methods=["POST"]),
                Route("/api/embed", answered(self.embed), methods=["POST"]),
                Route("/api/embeddings", answered(self.embeddings), methods=["POST"]),
                Route("/api/tags", answered(self.tags), methods=["GET"]),
                Route("/api/show", answered(self.show), methods=["POST"]),
                Route("/api/version", answered(self.version), methods=["GET"])]

    async def _body(self, request: Request) -> dict[str, Any]:
        body = parse_json(await self.server._body(request))
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise bad("'model' is required: a model name from GET /api/tags", "model")
        name = model.removesuffix(":latest")
        if self.server.strict_model and name not in self.server.model_names:
            raise ApiError(404, f"model '{model[:200]}' not found; this server serves '{self.server.model_id}'")
        return body

    def _loaded(self, body: dict[str, Any], key: str) -> Response:
        """Ollama's answer to a request with nothing to generate: the model is loaded."""
        line = {"model": body["model"], "created_at": now(),
                key: {"role": "assistant", "content": ""} if key == "message" else "", "done": True,
                "done_reason": "load"}
        return JSONResponse(line)

    async def chat(self, request: Request) -> Response:
        body = await self._body(request)
        refuse(body, _CHAT)
        stream, messages = streams(body), body.get("messages")
        if messages is not None and not isinstance(messages, list):
            raise bad(f"'messages' must be an array, got {kind_of(messages)}", "messages")
        if not messages:
            return self._loaded(body, "message")
        out = {**openai_body(body, stream), "messages": [message(m, i) for i, m in enumerate(messages)]}
        return await self.server.answer(request, parse_request(out, "chat"), self.shapes["message"])

    async def generate(self, request: Request) -> Response:
        body = await self._body(request)
        refuse(body, _GENERATE)
        stream, prompt, system = streams(body), body.get("prompt"), body.get("system")
        for key in ("prompt", "system"):
            if body.get(key) is not None and not isinstance(body[key], str):
                raise bad(f"'{key}' must be a string, got {kind_of(body[key])}", key)
        raw = body.get("raw")
        if raw is not None and not isinstance(raw, bool):
            raise bad(f"'raw' must be a boolean, got {kind_of(raw)}", "raw")
        if not prompt:
            return self._loaded(body, "response")
        out = openai_body(body, stream)
        if raw:
            if system:
                raise bad("'system' is not used with 'raw': true (the prompt is sent as it is)", "system")
            req = parse_request({**out, "prompt": prompt}, "completion")
        else:  # the model's template around the prompt, as Ollama renders it
            turns = [{"role": "system", "content": system}] if system else []
            req = parse_request({**out, "messages": [*turns, {"role": "user", "content": prompt}]}, "chat")
        return await self.server.answer(request, req, self.shapes["response"])

    async def embed(self, request: Request) -> Response:
        body = await self._body(request)
        refuse(body, _EMBED)
        options(body.get("options"))  # checked; none of them changes an embedding
        truncate = body.get("truncate")
        if truncate is not None and not isinstance(truncate, bool):
            raise bad(f"'truncate' must be a boolean, got {kind_of(truncate)}", "truncate")
        check_dimensions(body.get("dimensions"), self.server.model.cfg.n_embd)
        t0 = time.monotonic()
        vectors, inputs = await self.tokens.vectors(body.get("input"), truncate is not False)
        return JSONResponse({"model": body["model"], "embeddings": [v.tolist() for v in vectors],
                             "total_duration": ns(time.monotonic() - t0), "load_duration": 0,
                             "prompt_eval_count": sum(len(ids) for ids in inputs)})

    async def embeddings(self, request: Request) -> Response:
        """The older embeddings route: one `prompt`, one `embedding`."""
        body = await self._body(request)
        refuse(body, _EMBEDDINGS)
        options(body.get("options"))
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise bad(f"'prompt' is required: the text to embed (a string), got {kind_of(prompt)}", "prompt")
        vectors, _ = await self.tokens.vectors(prompt)
        return JSONResponse({"embedding": vectors[0].tolist()})

    async def _card(self) -> dict[str, Any]:
        """The model as /api/tags and /api/show describe it."""
        s = self.server
        model, path = s.model, s.session.path
        meta = model.metadata
        stat = path.stat()
        size = stat.st_size if path.is_file() else sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        digest = await run_in_threadpool(lambda: s.session.model_sha256)
        details = {"parent_model": "", "format": "gguf" if path.suffix == ".gguf" else path.suffix.lstrip(".")
                   or "safetensors", "family": model.cfg.arch, "families": [model.cfg.arch],
                   "parameter_size": str(meta.get("general.size_label", "")), "quantization_level": quantization(meta)}
        modified = datetime.datetime.fromtimestamp(stat.st_mtime, datetime.UTC).isoformat()
        return {"name": f"{s.model_id}:latest", "model": f"{s.model_id}:latest", "modified_at": modified,
                "size": size, "digest": digest, "details": details}

    async def tags(self, _request: Request) -> Response:
        return JSONResponse({"models": [await self._card()]})

    async def show(self, request: Request) -> Response:
        await self._body(request)
        card, s = await self._card(), self.server
        cfg, sampling = s.model.cfg, s.cfg.sampling
        parameters = "\n".join(f"{k} {v}" for k, v in (("temperature", sampling.temperature),
                                                        ("top_k", sampling.top_k), ("top_p", sampling.top_p),
                                                        ("num_ctx", s.cfg.context)))
        info = {"general.architecture": cfg.arch, f"{cfg.arch}.context_length": cfg.n_ctx_train,
                f"{cfg.arch}.embedding_length": cfg.n_embd, f"{cfg.arch}.block_count": cfg.n_layer,
                f"{cfg.arch}.attention.head_count": cfg.n_head, f"{cfg.arch}.attention.head_count_kv": cfg.n_head_kv}
        return JSONResponse({"modelfile": f"FROM {s.session.path}\n", "parameters": parameters,
                             "template": s.model.chat_template or "", "details": card["details"],
                             "model_info": info, "capabilities": ["completion", "embedding"],
                             "modified_at": card["modified_at"]})

    async def version(self, _request: Request) -> Response:
        return JSONResponse({"version": OLLAMA_VERSION, "tracelm": __version__})


def quantization(meta: dict[str, Any]) -> str:
    """The GGUF file type's name (Q4_K_M, Q8_0, F16, ...), "" when the file does not say."""
    import gguf

    try:
        return gguf.LlamaFileType(int(meta["general.file_type"])).name.removeprefix("MOSTLY_")
    except (KeyError, ValueError, TypeError):
        return ""


def ollama_routes(server: Any, openai_shape: type) -> list[Route]:
    """Ollama's routes on `server`, its answers shaped by a subclass of `openai_shape` (app.Shape)."""
    return OllamaRoutes(server, openai_shape).routes()
