"""llama-server's own completion routes, POST /completion and POST /infill, so scripts and editor plugins written for
llama.cpp's server work unchanged (`curl .../completion -d '{"prompt": "...", "n_predict": 128}'`); its OpenAI
routes without the /v1 prefix (/completions, /chat/completions) and /v1/health are in app.py.

A request is translated into the OpenAI completion body the other routes take and checked by the same code
(params.py), then runs on the engine as theirs do (`Server.answer`); only the answer's shape is llama-server's: one
JSON object (`content`, `stop`, `stop_type` "eos" / "word" / "limit", `stopping_word`, `tokens_predicted`,
`tokens_evaluated`, `generation_settings`, `timings` in milliseconds), or with `stream: true` Server-Sent Events of
`{"content": piece, "stop": false}` ending in the whole object with `stop: true` (no `[DONE]`).

The prompt is a string or an array of token ids (no template: this is a raw completion). `n_predict` -1 / -2 (the
default: "as many as the context allows") is the server's max_tokens, as Ollama's num_predict is. `seed` -1 (a random
seed) draws one, as no seed does. `top_k` <= 0 turns top-k off. `n_probs` N gives each token's log-probability and
its N most likely alternatives (`completion_probabilities`, llama-server's newer `logprob` form); `return_tokens` the
ids. `json_schema` constrains the output as `response_format` does; a GBNF `grammar` is a 400 (tracelm's grammars
are Lark: `guided_grammar` on /v1/completions). Samplers tracelm does not have (mirostat, typical-p, XTC, DRY,
dynamic temperature) are accepted at their neutral values only. Options about slots, caches, time budgets and
layout (`cache_prompt`, `id_slot`, `t_max_predict_ms`, `n_indent`, ...) and `samplers` (tracelm's chain has one
fixed order) are accepted and ignored: the server's own settings stand, and a trace records what was applied.
`response_fields` picks the answer's fields; `n_predict` 0 (an editor's cache warm-up) runs nothing and says so.
Any other field is a 400 naming it.

/infill is fill-in-the-middle for code models (fim.py): `input_prefix`, `input_suffix`, `input_extra` (other files,
`[{"filename", "text"}]`) and `prompt` (text after the middle token) make the prompt in the model's FIM tokens; the
rest of the body is /completion's, and so is the answer.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tracelm.server.errors import ApiError, bad, kind_of
from tracelm.server.fim import fill_request
from tracelm.server.params import parse_json, parse_request

# fields passed through as the OpenAI argument of the same name
_SAME = ("temperature", "top_p", "min_p", "stop", "repeat_penalty", "presence_penalty", "frequency_penalty")
# about slots, caches, time budgets and layout (what editor plugins send with every request), and `samplers`
# (tracelm's chain has one fixed order): accepted, and the server's own behaviour stands
_IGNORED = frozenset({"cache_prompt", "id_slot", "n_keep", "n_cache_reuse", "timings_per_token", "return_progress",
                      "mirostat_tau", "mirostat_eta", "xtc_threshold", "dynatemp_exponent", "dry_base",
                      "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers", "penalize_nl", "min_keep",
                      "sse_ping_interval", "t_max_prompt_ms", "t_max_predict_ms", "n_indent", "samplers"})
# samplers tracelm does not have, at the value that turns them off
_NEUTRAL = {"mirostat": (0,), "typical_p": (1, 1.0), "tfs_z": (1, 1.0), "dynatemp_range": (0, 0.0),
            "xtc_probability": (0, 0.0), "dry_multiplier": (0, 0.0), "post_sampling_probs": (False,), "n_cmpl": (1,)}
_INFILL = frozenset({"input_prefix", "input_suffix", "input_extra", "prompt"})  # /infill's own fields
_RENAMED = {"max_tokens": "n_predict", "logprobs": "n_probs", "response_format": "json_schema"}  # OpenAI's -> ours
_KNOWN = frozenset({"prompt", "n_predict", "seed", "top_k", "repeat_last_n", "stream", "n_probs", "return_tokens",
                    "json_schema", "grammar", "ignore_eos", "logit_bias", "response_fields", "model", *_SAME, *_IGNORED,
                    *_NEUTRAL})


def _integer(body: dict[str, Any], key: str) -> int | None:
    x = body.get(key)
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, int):
        raise bad(f"'{key}' must be an integer, got {kind_of(x)}", key)
    return x


def _flag(body: dict[str, Any], key: str) -> bool:
    x = body.get(key)
    if x is not None and not isinstance(x, bool):
        raise bad(f"'{key}' must be a boolean, got {kind_of(x)}", key)
    return bool(x)


def _logit_bias(x: Any) -> dict[str, float]:
    """llama-server's logit_bias ([[id, bias], ...] or {id: bias}; a bias of false bans the token) as OpenAI's."""
    pairs = list(x.items()) if isinstance(x, dict) else x
    if not isinstance(pairs, list):
        raise bad(f"'logit_bias' must be an array of [token id, bias] pairs or an object, got {kind_of(x)}",
                  "logit_bias")
    out: dict[str, float] = {}
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, list | tuple) and len(pair) == 2):
            raise bad(f"'logit_bias[{i}]' must be a [token id, bias] pair", "logit_bias")
        token, bias = pair
        if isinstance(token, str) and token.isdigit():
            token = int(token)
        if isinstance(token, bool) or not isinstance(token, int):
            raise bad(f"'logit_bias[{i}]': a token is named by its id here (text keys are not supported), got "
                      f"{json.dumps(token)[:40]}", "logit_bias")
        out[str(token)] = -100.0 if bias is False else bias
    return out


def openai_body(body: dict[str, Any], eog: frozenset[int], model_id: str) -> dict[str, Any]:
    """A /completion body as the OpenAI completion arguments (see the module docstring; no `model`: the served one);
    a 400 naming the field for one this server cannot honour."""
    for key in body:
        if key not in _KNOWN:
            raise bad(f"Unrecognized request field: {key}", key)
    for key, neutral in _NEUTRAL.items():
        if key in body and (isinstance(body[key], bool) != isinstance(neutral[0], bool) or body[key] not in neutral):
            raise bad(f"'{key}' = {json.dumps(body[key])[:40]} is not supported by this server", key)
    if body.get("grammar"):
        raise bad("'grammar': GBNF grammars are not supported; use 'json_schema', or a Lark grammar as "
                  "'guided_grammar' on /v1/completions", "grammar")
    out: dict[str, Any] = {"model": body.get("model") or model_id, "prompt": body.get("prompt"),
                           **{k: body[k] for k in _SAME if body.get(k) is not None}}
    out["stream"] = _flag(body, "stream")
    n_predict = _integer(body, "n_predict")
    if n_predict is not None and n_predict not in (-1, -2):  # -1 / -2: the server's max_tokens
        out["max_tokens"] = n_predict
    seed = _integer(body, "seed")
    if seed is not None and seed != -1:  # -1: a random seed, as none
        out["seed"] = seed
    top_k = _integer(body, "top_k")
    if top_k is not None:
        out["top_k"] = max(top_k, 0)  # <= 0: off
    last_n = _integer(body, "repeat_last_n")
    if last_n is not None:
        out["repeat_last_n"] = 1 << 30 if last_n == -1 else last_n  # -1: the whole context
    n_probs = _integer(body, "n_probs")
    if n_probs or _flag(body, "return_tokens"):  # the ids come with the log-probabilities
        out["logprobs"] = n_probs or 0
    schema = body.get("json_schema")
    if schema is not None:
        if not isinstance(schema, dict):
            raise bad(f"'json_schema' must be a JSON schema (an object), got {kind_of(schema)}", "json_schema")
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "json_schema", "schema": schema}}
    bias = _logit_bias(body["logit_bias"]) if body.get("logit_bias") else {}
    if _flag(body, "ignore_eos"):
        bias |= {str(t): -100.0 for t in sorted(eog)}
    if bias:
        out["logit_bias"] = bias
    return out


class LlamaShape:
    """Mixed into app.Shape (its `_events`, `tok`, `job`, ...): a job's events as llama-server's objects."""

    n_probs = 0
    return_tokens = False
    fields: tuple[str, ...] | None = None  # response_fields

    def ndjson(self, _request: Request) -> bool:
        return False

    def _probs(self, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        def item(token: int, logprob: float) -> dict[str, Any]:
            b = self.tok.token_bytes(token)
            return {"id": token, "token": b.decode("utf-8", "replace"), "bytes": list(b), "logprob": logprob}

        return [{**item(e["id"], e["logprob"]), "top_logprobs": [item(t, lp) for t, lp in e["top"]]}
                for e in entries]

    def _final(self, text: str, entries: list[dict[str, Any]], done: dict[str, Any]) -> dict[str, Any]:
        cfg, s = self.server.cfg, self.job.sampling
        word = done.get("stop_word", "")
        stop_type = "limit" if done["finish_reason"] == "length" else "word" if word else "eos"
        n_prompt, n_gen = done["prompt_tokens"], done["completion_tokens"]
        prompt_ms, predicted_ms = 1e3 * done["prefill_seconds"], 1e3 * done["decode_seconds"]
        out = {"content": text, "tokens": [e["id"] for e in entries] if self.return_tokens else [], "id_slot": 0,
               "stop": True, "model": self.server.model_id, "tokens_predicted": n_gen, "tokens_evaluated": n_prompt,
               "tokens_cached": done["cached_tokens"], "prompt": self.job.prompt_text, "stop_type": stop_type,
               "stopping_word": word, "truncated": False,
               "generation_settings": {"n_ctx": cfg.context, "model": self.server.model_id,
                                       "n_predict": self.job.max_tokens, "seed": s.seed, "temperature": s.temperature,
                                       "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p,
                                       "repeat_penalty": s.repeat_penalty, "repeat_last_n": s.repeat_last_n,
                                       "presence_penalty": s.presence_penalty,
                                       "frequency_penalty": s.frequency_penalty, "stop": list(self.req.stop),
                                       "n_probs": self.n_probs, "stream": self.req.stream},
               "timings": {"prompt_n": n_prompt - done["cached_tokens"], "prompt_ms": prompt_ms,
                           "prompt_per_second": (n_prompt - done["cached_tokens"]) / max(prompt_ms / 1e3, 1e-9),
                           "predicted_n": n_gen, "predicted_ms": predicted_ms,
                           "predicted_per_second": n_gen / max(predicted_ms / 1e3, 1e-9)}}
        if self.n_probs:
            out["completion_probabilities"] = self._probs(entries)
        return select(out, self.fields)

    async def collect(self) -> dict[str, Any]:
        return self._final(*await self._one_choice())

    async def stream(self, _ndjson: bool) -> AsyncIterator[bytes]:
        def frame(obj: dict[str, Any]) -> bytes:
            return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"

        finished, entries = False, []
        try:
            async for event in self._events():
                if event[0] == "piece":
                    entries.extend(event[2])
                    chunk = {"content": event[1], "stop": False, "id_slot": 0,
                             "tokens": [e["id"] for e in event[2]] if self.return_tokens else []}
                    if self.n_probs:
                        chunk["completion_probabilities"] = self._probs(event[2])
                    yield frame(chunk)
                elif event[0] == "error":
                    yield frame({"error": {"code": event[1].status, "message": event[1].message,
                                           "type": "invalid_request_error"}})
                    break
                elif event[0] == "done":
                    yield frame(self._final("", entries, event[1]))
            finished = True
        finally:
            if not finished:  # the client went away: stop generating
                self.job.gone.set()


def llama_server_routes(server: Any, openai_shape: type) -> list[Route]:
    """POST /completion and POST /infill on `server`, their answers shaped by a subclass of `openai_shape`
    (app.Shape)."""

    async def completion(request: Request) -> Response:
        return await completion_of(parse_json(await server._body(request)), request)

    async def infill(request: Request) -> Response:
        body = parse_json(await server._body(request))
        prefix, suffix, prompt = (_text(body, k) for k in ("input_prefix", "input_suffix", "prompt"))
        extra = _extra(body.get("input_extra"))
        rest = {k: v for k, v in body.items() if k not in _INFILL}
        n_predict = _integer(rest, "n_predict")
        stop = rest.get("stop") or []
        ids, rest["stop"] = await run_in_threadpool(
            fill_request, server.model, server.cfg.context, n_predict if n_predict and n_predict > 0 else
            server.cfg.max_tokens, prefix, suffix, [stop] if isinstance(stop, str) else stop, prompt, extra)
        return await completion_of({**rest, "prompt": ids}, request)

    async def completion_of(body: dict[str, Any], request: Request) -> Response:
        out = openai_body(body, server.model.tokenizer.eog_ids, server.model_id)
        fields = _response_fields(body.get("response_fields"))
        if out.get("max_tokens") == 0:  # nothing to generate (an editor's cache warm-up): nothing is run
            return JSONResponse(select(_nothing(server.model_id), fields))
        n_probs = _integer(body, "n_probs") or 0
        shape = type("LlamaCompletionShape", (LlamaShape, openai_shape),
                     {"n_probs": n_probs, "return_tokens": bool(body.get("return_tokens")), "fields": fields})
        try:
            return await server.answer(request, parse_request(out, "completion"), shape)
        except ApiError as e:  # name the field as the request did
            if e.param in _RENAMED:
                e.message = e.message.replace(f"'{e.param}'", f"'{_RENAMED[e.param]}'")
                e.message = e.message.replace(f" {e.param}", f" {_RENAMED[e.param]}")
                e.param = _RENAMED[e.param]
            raise

    return [Route("/completion", completion, methods=["POST"]), Route("/infill", infill, methods=["POST"])]


def _response_fields(x: Any) -> tuple[str, ...] | None:
    if x is None:
        return None
    if not isinstance(x, list) or not all(isinstance(f, str) for f in x):
        raise bad(f"'response_fields' must be an array of strings, got {kind_of(x)}", "response_fields")
    return tuple(x)


def select(out: dict[str, Any], fields: tuple[str, ...] | None) -> dict[str, Any]:
    """llama-server's response_fields: only these fields, a nested one ("timings/prompt_n") under its last name;
    one that is not there is left out. None: every field."""
    if fields is None:
        return out
    picked = {}
    for path in fields:
        node: Any = out
        for key in path.split("/"):
            node = node.get(key, _MISSING) if isinstance(node, dict) else _MISSING
        if node is not _MISSING:
            picked[path.rsplit("/", 1)[-1]] = node
    return picked


_MISSING = object()


def _nothing(model_id: str) -> dict[str, Any]:
    """The answer to n_predict 0: no token generated and, since tracelm keeps no cache across requests, none
    evaluated either."""
    return {"content": "", "tokens": [], "id_slot": 0, "stop": True, "model": model_id, "tokens_predicted": 0,
            "tokens_evaluated": 0, "tokens_cached": 0, "stop_type": "limit", "stopping_word": "", "truncated": False,
            "timings": {"prompt_n": 0, "prompt_ms": 0.0, "predicted_n": 0, "predicted_ms": 0.0}}


def _text(body: dict[str, Any], key: str) -> str:
    x = body.get(key, "")
    if not isinstance(x, str):
        raise bad(f"'{key}' must be a string, got {kind_of(x)}", key)
    return x


def _extra(x: Any) -> list[tuple[str, str]]:
    """/infill's input_extra: [{"filename", "text"}, ...] as (filename, text) pairs."""
    if x is None:
        return []
    if not isinstance(x, list) or not all(isinstance(c, dict) and isinstance(c.get("text", ""), str) and
                                          isinstance(c.get("filename", "tmp"), str) for c in x):
        raise bad("'input_extra' must be an array of {\"filename\": string, \"text\": string}", "input_extra")
    return [(c.get("filename", "tmp"), c.get("text", "")) for c in x]

