"""The HTTP side: an OpenAI-compatible API on Starlette, served by uvicorn.

Routes: GET /health, GET /v1/models, GET /v1/models/{id}, POST /v1/completions (`suffix`: fill in the middle,
fim.py), POST /v1/chat/completions (both also without /v1; llama-server's own POST /completion and /infill are in
llama_server.py); and for scripts: GET /metrics (Prometheus, metrics.py), POST /tokenize, /detokenize and
/v1/embeddings (tokens.py); and
Ollama's /api/chat, /api/generate, /api/embed, /api/tags, /api/show, /api/version (ollama.py).
A generation request naming any model is served by the one loaded model (as llama-server and Ollama do), and the
reply's `model` is the served model's id; with `server.strict_model` (`tracelm serve --strict-model`) another name
is a 404. `n` choices are sampled from one prefill; tools are rendered, constrained and parsed (server/tools.py).
Answers are one JSON body (`stream: false`), Server-Sent Events ending in `data: [DONE]` (`stream: true`),
or JSON lines when the client accepts `application/x-ndjson` and asks to stream.

Every error is the OpenAI error body `{"error": {"message", "type", "param", "code"}}` with a 4xx status
for a client's mistake; an unexpected failure is a 500 saying only that, with the traceback in the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tracelm.audit.policy import Policy, load_policy
from tracelm.server.access import Access, body_lost, read_body
from tracelm.server.errors import ApiError, bad
from tracelm.server.fim import fill_request
from tracelm.server.llama_server import llama_server_routes
from tracelm.server.metrics import Metrics, MetricsMiddleware, metrics_routes
from tracelm.server.ollama import ollama_error, ollama_routes
from tracelm.server.pages import page_routes
from tracelm.server.params import GenerationRequest, parse_json, parse_request, prompt_batch
from tracelm.server.queue import Engine, Job, QueueFull, Task
from tracelm.server.tokens import token_routes
from tracelm.server.tools import (
    ExcessCalls,
    ToolCallSplitter,
    function_grammar,
    split_reply,
    template_tool_format,
    tool_grammar,
)
from tracelm.session import (
    Session,
    chat_prompt,
    encode_chat,
    parse_nonce,
    prompt_logprobs,
    shift_chat,
    signature_fields,
    template_budget,
    unspellable,
)
from tracelm.state.errors import GrammarLibraryError, TracelmError
from tracelm.state.records import Constraint
from tracelm.state.run_config import RunConfig
from tracelm.version import __version__

log = logging.getLogger("tracelm.server")
FINGERPRINT = f"tracelm-{__version__}"


def model_id_of(cfg: RunConfig) -> str:
    """The id /v1/models shows: server.alias, else the registry name, or the GGUF file's stem for a path."""
    if cfg.server.alias:
        return cfg.server.alias
    name = cfg.model
    if "/" in name or name.endswith(".gguf"):
        return Path(name).stem
    return name


class Server:
    def __init__(self, session: Session, api_key: str | None = None):
        self.model = session.model
        self.cfg = cfg = session.cfg
        self.model_id = model_id_of(cfg)
        self.model_names = {self.model_id, cfg.model}
        self.strict_model = cfg.server.strict_model  # another model name is a 404 (else the loaded model serves it)
        self.api_key = api_key or None
        self.session = session
        self.engine = Engine(session)
        self.metrics = Metrics(self.engine)  # this server's own Prometheus registry (GET /metrics)
        self.created = int(time.time())
        self.policy = load_policy(cfg.trace.policy) if cfg.trace.policy else Policy()  # the viewer's verdicts
        if cfg.attest.provider != "off":
            session.attestation()  # the evidence every trace header carries, made now: a TEE that cannot attest fails

    def app(self) -> Starlette:
        @contextlib.asynccontextmanager
        async def lifespan(_app: Starlette) -> AsyncIterator[None]:
            self.engine.start()
            try:
                yield
            finally:
                await run_in_threadpool(self.engine.stop)

        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/health", self.health, methods=["GET"]),  # llama-server's alias
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.model_info, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/completions", self.completions, methods=["POST"]),  # llama-server's, without /v1
            Route("/chat/completions", self.chat_completions, methods=["POST"]),
            *llama_server_routes(self, Shape),  # llama-server's own POST /completion (llama_server.py)
            Route("/v1/attestation", self.attestation, methods=["GET"]),
            *page_routes(self),  # the chat page at / and the trace viewer at /trace (pages.py)
            *metrics_routes(self),  # GET /metrics (metrics.py)
            *token_routes(self),  # /tokenize, /detokenize, /v1/embeddings (tokens.py)
        ]
        ollama = ollama_routes(self, Shape)  # Ollama's /api/chat, /api/generate, /api/tags, ... (ollama.py)
        routes += ollama
        handlers = {ApiError: _api_error, HTTPException: _http_error, ClientDisconnect: body_lost,
                    Exception: _internal_error}
        opts = self.cfg.server
        access = Middleware(Access, api_key=self.api_key, allowed_hosts=(*opts.allowed_hosts, opts.host),
                            error_shapes={r.path: ollama_error for r in ollama})  # Ollama's clients read theirs
        metrics = Middleware(MetricsMiddleware, metrics=self.metrics, routes=routes)  # type: ignore[arg-type]
        return Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan,  # type: ignore[arg-type]
                         middleware=[metrics, access])  # the metrics count the requests access refuses too

    # -- plain endpoints ---------------------------------------------------------------------------------

    async def health(self, _request: Request) -> Response:
        e = self.engine
        return JSONResponse({
            "status": "ok",
            "model": self.model_id,
            "running": e.running,
            "queued": e.queued,
            "max_batch": e.max_batch,
            "sessions": len(e.sessions),
            "session_capacity": e.sessions.capacity,
            "memory": e.memory(),
            "counters": attrs.asdict(e.counters),
        })

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "tracelm",
                "context_length": self.cfg.context}

    async def models(self, _request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model_info(self, request: Request) -> Response:
        if request.path_params["model_id"] not in self.model_names:
            raise self._no_model(request.path_params["model_id"])
        return JSONResponse(self._model_card())

    async def attestation(self, request: Request) -> Response:
        """Fresh evidence binding the server's ephemeral trace key to this TEE, over the caller's nonce
        (`?nonce=HEX`, up to 64 bytes): a client checks it (`tracelm attest verify`) before sending anything."""
        if self.cfg.attest.provider == "off":
            raise ApiError(404, "this server attests nothing (start it with --attest tpm|tsm)", code="not_attested")
        try:
            nonce = parse_nonce(request.query_params.get("nonce", ""), "nonce")
        except TracelmError as e:
            raise bad(str(e), "nonce") from None
        if not nonce:
            raise bad("give a fresh nonce: GET /v1/attestation?nonce=HEX (1 to 64 bytes)", "nonce")
        try:
            document = await run_in_threadpool(self.session.attestation, nonce)
        except TracelmError as e:
            log.error("attestation failed: %s", e)
            raise ApiError(503, f"the TEE gave no evidence: {e}", code="attestation_failed") from None
        return JSONResponse({**document, **signature_fields(self.session.signer)},
                            headers={"Cache-Control": "no-store"})

    def _no_model(self, name: str) -> ApiError:
        return ApiError(404, f"The model '{name[:200]}' does not exist; this server serves '{self.model_id}'",
                        param="model", code="model_not_found")

    async def _body(self, request: Request) -> bytes:
        limit = self.cfg.server.max_body_bytes
        body = await read_body(request, limit)
        if body is None:  # answered at once; the connection then closes gracefully (server/guard.py)
            raise ApiError(413, f"the request body is larger than the limit of {limit} bytes "
                                "(server.max_body_bytes)", code="request_too_large")
        return body

    # -- generation --------------------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        body = parse_json(await self._body(request))
        if body.get("suffix"):  # OpenAI's insert mode: the model fills in between prompt and suffix (fim.py)
            prompt, suffix = body.get("prompt"), body["suffix"]
            if not isinstance(prompt, str) or not isinstance(suffix, str):
                raise bad("'suffix' (a string) takes a 'prompt' that is a string", "suffix")
            ids, stops = await run_in_threadpool(fill_request, self.model, self.cfg, body.get("max_tokens"), prompt,
                                                 suffix, body.get("stop"), "", (), "suffix")
            body = {**body, "prompt": ids, "suffix": "", "stop": stops}
        batch = prompt_batch(body)
        if batch is not None:
            return await self._prompts(request, body, batch)
        return await self.answer(request, parse_request(body, "completion"), Shape)

    async def _prompts(self, request: Request, body: dict[str, Any], batch: list[Any]) -> Response:
        """A completions request of several prompts: each checked and answered as its own request, max_batch
        sequences at a time, their choices in prompt order (prompt i's choice j at index i * n + j) and their usage
        summed. Not streamed."""
        if body.get("stream"):
            raise bad("several prompts in one request are not streamed by this server: send them one by one, or "
                      "without 'stream'", "stream")
        reqs = [parse_request({**body, "prompt": p}, "completion") for p in batch]
        n, outs = reqs[0].n, []
        wave = max(1, min(self.engine.max_batch // n, self.cfg.server.queue_size + 1))  # (no 429 from itself)
        for a in range(0, len(reqs), wave):
            outs += await asyncio.gather(*(self.answer(request, r, Shape, raw=True) for r in reqs[a:a + wave]))
        choices = [{**c, "index": i * n + c["index"]} for i, out in enumerate(outs) for c in out["choices"]]
        usage = {k: sum(out["usage"][k] for out in outs) for k in ("prompt_tokens", "completion_tokens",
                                                                    "total_tokens", "prefill_passes")}
        usage["prompt_tokens_details"] = {"cached_tokens": sum(out["usage"]["prompt_tokens_details"]["cached_tokens"]
                                                               for out in outs)}
        head = {k: v for k, v in outs[0].items() if k not in ("choices", "usage")}
        return JSONResponse({**head, "choices": choices, "usage": usage}, headers={"x-request-id": head["id"]})

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    def _chat_ids(self, req: GenerationRequest, messages: list[dict[str, Any]]) -> list[int]:
        """The conversation's prompt ids, the request's tools rendered by the template unless tool_choice is none."""
        tools = req.tools if req.tools is not None and req.tools.active else None
        budget = template_budget(self.cfg)
        if tools is None:
            return chat_prompt(self.model, messages, budget)
        why = template_tool_format(self.model.chat_template)
        if why is not None:
            raise bad(f"'tools': {why}", "tools")
        # the template writes tools and calls outside the messages' contents: none may spell a control token
        written = json.dumps([tools.tools, [m.get("tool_calls") for m in messages]], ensure_ascii=False)
        for text in self.model.tokenizer.control_tokens():
            if text in written:
                raise bad(f"'tools' or a message's tool_calls spell the control token {text!r}", "tools")
        return encode_chat(self.model.tokenizer, self.model.chat_template, messages, add_generation_prompt=True,
                           budget=budget, tools=list(tools.tools))

    def _encode(self, req: GenerationRequest) -> tuple[list[int], str]:
        """Prompt token ids and text (worker-free: runs in a thread of the pool)."""
        tok = self.model.tokenizer
        if req.kind == "chat":
            messages = list(req.messages or [])
            if self.cfg.system and not any(m["role"] == "system" for m in messages):
                messages.insert(0, {"role": "system", "content": self.cfg.system})
            try:
                ids = self._chat_ids(req, messages)
                asked = self.cfg.max_tokens if req.max_tokens is None else req.max_tokens
                ids = shift_chat(self.model, self.cfg, messages, ids, asked)  # context_policy: shift
            except TracelmError as e:
                raise bad(f"messages: {e}", "messages") from None
            return ids, tok.decode(ids)
        if isinstance(req.prompt, list):
            for i in req.prompt:
                if not 0 <= i < tok.n_vocab:
                    raise bad(f"token id {i} in 'prompt' is outside the vocabulary (0..{tok.n_vocab - 1})", "prompt")
            return list(req.prompt), tok.decode(req.prompt)
        return tok.encode(req.prompt or ""), req.prompt or ""

    def _check_sampling(self, req: GenerationRequest, sampling: Any) -> None:
        """A 400 naming the argument unless the request's constraint compiles and its logit_bias ids exist (runs in
        a thread of the pool: a grammar's first use builds the vocabulary's token trie)."""
        with refused("logit_bias"):
            self.session.check_sampling(attrs.evolve(sampling, constraint=None))
        if req.constraint_param == "tools":  # each function's schema alone first, so an error names it
            for i, fn in enumerate(req.tools.functions):
                with refused(f"tools[{i}].function.parameters"):
                    self.session.check_sampling(attrs.evolve(sampling, constraint=Constraint("lark",
                                                                                             function_grammar(fn))))
        with refused(req.constraint_param):
            self.session.check_sampling(sampling)

    async def _echo_logprobs(self, ids: list[int], k: int | None) -> dict[str, Any] | None:
        """OpenAI's logprobs of the prompt's tokens for `echo` (None without `logprobs`), computed on the engine as
        a Task (a 429 when its queue is full): each token's piece, its log-probability given the ones before it (the
        first's null), the k likeliest there and its offset in the prompt's text (a control token's piece, such
        as BOS, is not in the text: its offset is where the text stands)."""
        if k is None:
            return None
        task = Task([ids], lambda runner, x: prompt_logprobs(runner, x, k),
                    deadline=time.monotonic() + self.cfg.server.request_timeout)
        self.submit(task)
        try:
            scored = (await asyncio.wrap_future(task.future))[0]
        except TracelmError as e:
            raise ApiError(400, str(e)) from None
        tok = self.model.tokenizer
        entries = [{"id": ids[0], "logprob": None, "top": None}] + [
            {"id": t, "logprob": lp, "top": list(zip(top.tolist(), lps.tolist(), strict=True))}
            for t, (lp, top, lps) in zip(ids[1:], scored, strict=True)]
        return text_logprobs(tok, entries, 0, lambda t: not unspellable(tok, t))

    def _max_tokens(self, req: GenerationRequest, n_prompt: int) -> int:
        n_ctx = self.cfg.context
        param = "messages" if req.kind == "chat" else "prompt"
        if n_prompt == 0:
            raise bad("the prompt is empty: nothing to condition on", param)
        room = n_ctx - n_prompt
        if room <= 0:
            raise bad(f"This model's maximum context length is {n_ctx} tokens; the prompt alone is {n_prompt} tokens",
                      param, "context_length_exceeded")
        if req.max_tokens is None:
            return min(self.cfg.max_tokens, room) or 1
        if req.max_tokens == 0:  # (echo: the prompt scored alone)
            return 0
        if req.max_tokens > room:
            raise bad(f"This model's maximum context length is {n_ctx} tokens. However, you requested "
                      f"{n_prompt + req.max_tokens} tokens ({n_prompt} in the prompt, {req.max_tokens} in the "
                      f"completion). Reduce the prompt or max_tokens.", "max_tokens", "context_length_exceeded")
        return req.max_tokens

    def submit(self, item: Any) -> None:
        """Queue a Job (or an embeddings Task) on the engine; a full queue is a 429 with its Retry-After."""
        try:
            self.engine.submit(item)
        except QueueFull as e:
            raise ApiError(429, "The server is busy: its request queue is full; retry after a while",
                           kind="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(e.retry_after)}) from None

    async def _generate(self, request: Request, kind: str) -> Response:
        return await self.answer(request, parse_request(parse_json(await self._body(request)), kind), Shape)

    async def answer(self, request: Request, req: GenerationRequest, shape_of: type[Shape], raw: bool = False) -> Any:
        """Run a checked request on the engine and answer it in the shapes of `shape_of` (Shape: OpenAI's; the
        Ollama routes give theirs, ollama.py): one JSON body, or a stream framed as the shape says. `raw` (a request
        not streamed): the body itself, not a Response (one prompt of several, `_prompts`)."""
        kind = req.kind
        if self.strict_model and req.model not in self.model_names:
            raise self._no_model(req.model)
        if req.n > self.engine.max_batch:
            raise bad(f"'n' must be at most {self.engine.max_batch} on this server (server.max_batch: a request's "
                      f"choices decode together), got {req.n}", "n")
        ids, prompt_text = await run_in_threadpool(self._encode, req)
        max_tokens = self._max_tokens(req, len(ids))
        seed = req.seed if req.seed is not None else secrets.randbits(63)
        if req.tools is not None and req.tools.active:  # the reply under the tools' grammar
            req = attrs.evolve(req, sampling={**req.sampling, "constraint": Constraint(
                "lark", tool_grammar(req.tools, self.model.tokenizer))}, constraint_param="tools")
        try:
            sampling = attrs.evolve(self.cfg.sampling, **req.sampling, seed=seed)
        except (TypeError, ValueError) as e:
            raise bad(f"sampling parameters: {e}") from None
        await run_in_threadpool(self._check_sampling, req, sampling)
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        echo = (prompt_text, await self._echo_logprobs(ids, req.logprobs)) if req.echo else None
        if echo is not None and max_tokens == 0:  # the prompt scored, nothing generated
            out = echoed(Shape(self, req, rid, None), echo, len(ids))
            return out if raw else JSONResponse(out, headers={"x-request-id": rid})
        tools = req.tools if kind == "chat" and req.tools is not None and req.tools.active else None
        job = Job(request_id=rid, prompt_ids=ids, prompt_text=prompt_text, max_tokens=max_tokens, sampling=sampling,
                  stop=req.stop, deadline=time.monotonic() + self.cfg.server.request_timeout,
                  predict_limit=req.predict_limit,
                  loop=asyncio.get_running_loop(), session_id=req.session_id, logprobs=req.logprobs, n=req.n,
                  cpu_limit=self.cfg.server.request_cpu_seconds,
                  watch=None if tools is None else functools.partial(ExcessCalls, {f.name for f in tools.functions},
                                                                     tools.parallel))
        self.submit(job)
        watcher = asyncio.create_task(_watch_disconnect(request, job))
        streaming = False
        try:
            first = await job.events.get()  # "start" once the worker takes the job, or why it did not
            if first[0] == "error":
                raise first[1]
            if first[0] == "gone":
                return Response(status_code=499)
            shape = shape_of(self, req, rid, job)
            shape.echo = echo
            if not req.stream:
                out = await shape.collect()
                return out if raw else JSONResponse(out, headers={"x-request-id": rid})
            streaming = True
        finally:
            watcher.cancel()  # from here on the streaming response watches for the client going away
            if not streaming:
                job.gone.set()  # nobody reads any more (a no-op once the job is done)
        ndjson = shape.ndjson(request)
        return StreamingResponse(shape.stream(ndjson), media_type="application/x-ndjson" if ndjson else
                                 "text/event-stream", headers={"x-request-id": rid, "Cache-Control": "no-cache",
                                                               "X-Accel-Buffering": "no"})


@contextlib.contextmanager
def refused(param: str) -> Iterator[None]:
    """A TracelmError inside becomes a 400 naming `param`; one the grammar library raised is also logged, in one
    line (a library that fails on a request is worth an operator's eye, not a traceback)."""
    try:
        yield
    except TracelmError as e:
        if isinstance(e, GrammarLibraryError):
            log.warning("refused a request's %s: %s", param, e)
        raise bad(f"{param}: {e}", param) from None


def token_text(tok: Any, token: int) -> str:
    return tok.token_bytes(token).decode("utf-8", "replace")


def text_logprobs(tok: Any, entries: list[dict[str, Any]], start: int,
                  takes_room: Callable[[int], bool] = lambda _t: True) -> dict[str, Any]:
    """OpenAI's completions logprobs of tokens whose text begins at offset `start`: each entry {"id", "logprob",
    "top": [(id, logprob)], or None for a prompt's first token, which nothing precedes} as its text, its logprob,
    its alternatives keyed by their text, and its offset; a token `takes_room` says is not in the text (echo: a
    control token such as BOS) moves the offsets on by nothing."""
    tokens, offsets, pos = [], [], start
    for e in entries:
        text = token_text(tok, e["id"])
        tokens.append(text)
        offsets.append(pos)
        pos += len(text) if takes_room(e["id"]) else 0
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [None if e["top"] is None else {token_text(tok, t): lp for t, lp in e["top"]}
                             for e in entries],
            "text_offset": offsets}


def echoed(shape: Shape, echo: tuple[str, dict[str, Any] | None], n_prompt: int) -> dict[str, Any]:
    """A completion of max_tokens 0 with `echo`: each choice the prompt, its tokens' logprobs when asked for."""
    prompt, scored = echo
    choices = [{"index": i, "text": prompt, "logprobs": scored, "finish_reason": "length"} for i in range(shape.req.n)]
    return {**shape._head("text_completion"), "choices": choices,
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": 0, "total_tokens": n_prompt}}


def _add_note(choice: dict[str, Any], done: dict[str, Any]) -> None:
    """A tracelm extension: why a choice was cut short by a server limit (`finish_note`), when one was."""
    if done.get("note"):
        choice["finish_note"] = done["note"]


def _wants_ndjson(request: Request) -> bool:
    accept = request.headers.get("accept", "")
    return "application/x-ndjson" in accept and "text/event-stream" not in accept


async def _watch_disconnect(request: Request, job: Job) -> None:
    """Until cancelled: if the client hangs up, tell the worker and wake the waiting coroutine."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.gone.set()
            job.events.put_nowait(("gone",))
            return


class Shape:
    """Turns a job's events into the OpenAI response shapes of one endpoint."""

    echo: tuple[str, dict[str, Any] | None] | None = None  # completions' echo: the prompt's text and logprobs

    def __init__(self, server: Server, req: GenerationRequest, rid: str, job: Job):
        self.server, self.req, self.rid, self.job = server, req, rid, job
        self.tok = server.model.tokenizer
        self.created = int(time.time())
        self.chat = req.kind == "chat"
        tools = req.tools if self.chat and req.tools is not None and req.tools.active else None
        self.tool_names = {f.name for f in tools.functions} if tools is not None else None  # None: no tool calls
        self.parallel = tools is None or tools.parallel

    def ndjson(self, request: Request) -> bool:
        """Whether a stream goes out as JSON lines (else as Server-Sent Events)."""
        return _wants_ndjson(request)

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.server.model_id,
                "system_fingerprint": FINGERPRINT}

    def usage(self, dones: list[dict[str, Any]]) -> dict[str, Any]:
        """OpenAI's usage of all the choices: the prompt counted once, the completions' tokens summed; and
        `prefill_passes`, a tracelm extension: how many times the prompt went through the model for this request
        (1 for any n: the other choices start from a copy of the first one's Cache)."""
        prompt, completion = dones[0]["prompt_tokens"], sum(d["completion_tokens"] for d in dones)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": dones[0]["cached_tokens"]},
                "prefill_passes": sum(d["prefilled"] for d in dones)}

    def _token_text(self, token: int) -> str:
        return token_text(self.tok, token)

    def _logprobs(self, entries: list[dict[str, Any]], text_len_before: int) -> dict[str, Any] | None:
        """OpenAI logprobs for the tokens behind one piece of text (None when not asked for)."""
        if self.req.logprobs is None:
            return None
        if self.chat:
            def item(token: int, logprob: float) -> dict[str, Any]:
                b = self.tok.token_bytes(token)
                return {"token": b.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(b)}

            return {"content": [{**item(e["id"], e["logprob"]), "top_logprobs": [item(t, lp) for t, lp in e["top"]]}
                                for e in entries], "refusal": None}
        return text_logprobs(self.tok, entries, text_len_before)

    async def _events(self) -> AsyncIterator[tuple[Any, ...]]:
        """The job's events until every choice is done (or an error, or the client gone)."""
        left = self.req.n
        while left:
            event = await self.job.events.get()
            yield event
            if event[0] in ("error", "gone"):
                return
            left -= event[0] == "done"

    def _message(self, text: str, done: dict[str, Any]) -> tuple[dict[str, Any], str]:
        """A chat choice's message and finish_reason: with tools, the reply's calls as tool_calls."""
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        finish = done["finish_reason"]
        if self.tool_names is not None:
            message["content"], calls = split_reply(text, self.tool_names, self.parallel)
            if calls:
                message["tool_calls"] = [c.openai() for c in calls]
                finish = "tool_calls" if finish == "stop" else finish
        return message, finish

    async def _one_choice(self) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
        """A one-choice job's text, its log-probability entries and its done record (an error raised, a client
        gone a 499): what the other APIs' shapes (ollama.py, llama_server.py) answer from."""
        texts, entries, done = [], [], {}
        async for event in self._events():
            if event[0] == "piece":
                texts.append(event[1])
                entries.extend(event[2])
            elif event[0] == "error":
                raise event[1]
            elif event[0] == "gone":
                raise ApiError(499, "client closed the request")
            elif event[0] == "done":
                done = event[1]
        return "".join(texts), entries, done

    async def collect(self) -> dict[str, Any]:
        n = self.req.n
        texts: list[list[str]] = [[] for _ in range(n)]
        entries: list[list[dict[str, Any]]] = [[] for _ in range(n)]
        dones: list[dict[str, Any]] = [{} for _ in range(n)]
        async for event in self._events():
            if event[0] == "piece":
                texts[event[3]].append(event[1])
                entries[event[3]].extend(event[2])
            elif event[0] == "error":
                raise event[1]
            elif event[0] == "gone":
                raise ApiError(499, "client closed the request")
            elif event[0] == "done":
                dones[event[2]] = event[1]
        choices = []
        for i in range(n):
            logprobs, body = self._logprobs(entries[i], 0), "".join(texts[i])
            if self.chat:
                message, finish = self._message(body, dones[i])
                choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish})
            elif self.echo is not None:  # the prompt first, its logprobs before the completion's
                prompt, scored = self.echo
                logprobs = self._logprobs(entries[i], len(prompt))
                if scored is not None and logprobs is not None:
                    logprobs = {k: scored[k] + logprobs[k] for k in scored}
                choices.append({"index": i, "text": prompt + body, "logprobs": logprobs,
                                "finish_reason": dones[i]["finish_reason"]})
            else:
                choices.append({"index": i, "text": body, "logprobs": logprobs,
                                "finish_reason": dones[i]["finish_reason"]})
            _add_note(choices[-1], dones[i])
        head = self._head("chat.completion" if self.chat else "text_completion")
        return {**head, "choices": choices, "usage": self.usage(dones)}

    def _chunk(self, index: int, delta: dict[str, Any] | str, finish: str | None = None,
               logprobs: Any = None) -> dict[str, Any]:
        """One streamed chunk of choice `index`: a chat delta, or a completion's text."""
        if self.chat:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            chunk = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": finish}
            chunk = {**self._head("text_completion"), "choices": [choice]}
        if self.req.include_usage:
            chunk["usage"] = None
        return chunk

    def _deltas(self, index: int, items: list[tuple[str, Any]]) -> list[dict[str, Any]]:
        """Chat deltas of a reply's content and calls (ToolCallSplitter's items): a call as OpenAI streams one, its
        id and name first, then its arguments."""
        out: list[dict[str, Any]] = []
        for kind, x in items:
            if kind == "content":
                out.append({"content": x})
                continue
            k = self.calls[index]
            self.calls[index] += 1
            out.append({"tool_calls": [{"index": k, "id": x.id, "type": "function",
                                        "function": {"name": x.name, "arguments": ""}}]})
            out.append({"tool_calls": [{"index": k, "function": {"arguments": x.arguments}}]})
        return out

    def _piece_chunks(self, index: int, text: str, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The chunks of one piece of choice `index`; its logprobs ride on the next chunk that goes out."""
        self.pending[index].extend(entries)
        if not self.chat:
            deltas: list[Any] = [text]
        elif self.splitters is None:
            deltas = [{"content": text}]
        else:
            deltas = self._deltas(index, self.splitters[index].push(text))
        chunks = []
        for delta in deltas:
            chunks.append(self._chunk(index, delta, None, self._logprobs(self.pending[index], self.offsets[index])))
            self.offsets[index] += sum(len(self._token_text(e["id"])) for e in self.pending[index])
            self.pending[index] = []
        return chunks

    def _done_chunks(self, index: int, done: dict[str, Any]) -> list[dict[str, Any]]:
        finish = done["finish_reason"]
        chunks = []
        if self.splitters is not None:
            for delta in self._deltas(index, self.splitters[index].finish()):
                chunks.append(self._chunk(index, delta, None, self._logprobs(self.pending[index], 0)))
                self.pending[index] = []
            if self.calls[index] and finish == "stop":
                finish = "tool_calls"
        chunks.append(self._chunk(index, {} if self.chat else "", finish, None))
        _add_note(chunks[-1]["choices"][0], done)
        return chunks

    async def stream(self, ndjson: bool) -> AsyncIterator[bytes]:
        def frame(obj: dict[str, Any]) -> bytes:
            data = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
            return (data + "\n").encode() if ndjson else f"data: {data}\n\n".encode()

        n = self.req.n
        self.pending: list[list[dict[str, Any]]] = [[] for _ in range(n)]  # logprobs not yet sent
        self.offsets, self.calls = [0] * n, [0] * n  # completions' text_offset; tool calls sent, per choice
        self.splitters = ([ToolCallSplitter(self.tool_names, self.parallel) for _ in range(n)]
                          if self.chat and self.tool_names is not None else None)
        dones: list[dict[str, Any]] = [{} for _ in range(n)]
        finished = False
        try:
            if self.chat:
                for i in range(n):
                    yield frame(self._chunk(i, {"role": "assistant", "content": ""}))
            async for event in self._events():
                if event[0] == "piece":
                    for chunk in self._piece_chunks(event[3], event[1], event[2]):
                        yield frame(chunk)
                elif event[0] == "error":
                    yield frame(event[1].body())
                    self.job.gone.set()  # the other choices stop too
                    finished = True
                    return
                elif event[0] == "done":
                    dones[event[2]] = event[1]
                    for chunk in self._done_chunks(event[2], event[1]):
                        yield frame(chunk)
            if self.req.include_usage and all(dones):
                yield frame({**self._chunk(0, {}), "choices": [], "usage": self.usage(dones)})
            finished = True
            if not ndjson:
                yield b"data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away (or the stream was cancelled): stop generating
                self.job.gone.set()


def _api_error(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    if exc.status == 499:
        return Response(status_code=499)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _http_error(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    body = {"error": {"message": str(exc.detail), "type": kind, "param": None, "code": None}}
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


def _internal_error(_request: Request, exc: Exception) -> Response:
    log.error("unhandled error", exc_info=exc)
    body = {"error": {"message": "internal server error; see the server log", "type": "server_error",
                      "param": None, "code": None}}
    return JSONResponse(body, status_code=500)
