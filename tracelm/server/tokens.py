"""The token endpoints: POST /tokenize and /detokenize in llama-server's shapes, POST /v1/embeddings in OpenAI's.

- /tokenize `{"content": TEXT, "add_special": false, "parse_special": true, "with_pieces": false}` ->
  `{"tokens": [ids]}`, or with pieces `{"tokens": [{"id", "piece"}]}`, a piece as text when its bytes are UTF-8,
  else as the list of its bytes. `add_special` adds BOS/EOS as the vocabulary's flags say; `parse_special` reads
  control tokens spelled in the text as those tokens (else as plain text).
- /detokenize `{"tokens": [ids]}` -> `{"content": TEXT}`.
- /v1/embeddings `{"input": TEXT | [TEXT] | [ids] | [[ids]], "model", "encoding_format": "float" | "base64",
  "dimensions", "user"}` -> `{"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model",
  "usage": {"prompt_tokens", "total_tokens"}}`: each input's final hidden states (after the output norm) pooled by
  `server.pooling` (mean, or the last position's) and scaled to unit length; base64 is the little-endian f32 bytes.
  The texts run on the engine's worker thread as a Task, one per step boundary, each within the context.
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any

import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tracelm.server.errors import ApiError, bad, kind_of
from tracelm.server.params import parse_json
from tracelm.server.queue import Task
from tracelm.session import embedding
from tracelm.state.errors import TracelmError

MAX_INPUTS = 2048  # texts per embeddings request (OpenAI's bound)
_TOKENIZE = {"content", "add_special", "parse_special", "with_pieces", "model"}
_DETOKENIZE = {"tokens", "model"}
_EMBEDDINGS = {"input", "model", "encoding_format", "dimensions", "user"}


def check_keys(body: dict[str, Any], known: set[str]) -> None:
    for key in body:
        if key not in known:
            raise bad(f"Unrecognized request argument supplied: {key} (this endpoint takes "
                      f"{', '.join(sorted(known))})", key, "unrecognized_argument")


def flag(body: dict[str, Any], key: str, default: bool) -> bool:
    x = body.get(key)
    if x is None:
        return default
    if not isinstance(x, bool):
        raise bad(f"'{key}' must be a boolean, got {kind_of(x)}", key)
    return x


def token_ids(x: Any, n_vocab: int, where: str) -> list[int]:
    """A list of token ids in the vocabulary, or a 400 naming the first that is not."""
    if not isinstance(x, list):
        raise bad(f"'{where}' must be an array of token ids, got {kind_of(x)}", where)
    for i, t in enumerate(x):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < n_vocab:
            raise bad(f"'{where}[{i}]' must be a token id in the vocabulary (0..{n_vocab - 1}), got "
                      f"{str(t)[:40]}", f"{where}[{i}]")
    return list(x)


def check_dimensions(dims: Any, n_embd: int) -> None:
    """`dimensions`, when given, must be the model's own embedding size (embeddings are not shortened)."""
    if dims is not None and (isinstance(dims, bool) or dims != n_embd):
        raise bad(f"'dimensions' must be this model's embedding size, {n_embd} (it does not shorten its "
                  f"embeddings), got {str(dims)[:40]}", "dimensions")


def piece(tok: Any, token: int) -> str | list[int]:
    """A token's text when its bytes are UTF-8, else the list of its bytes (llama-server's `with_pieces`)."""
    b = tok.token_bytes(token)
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return list(b)


class TokenRoutes:
    """The handlers, on one Server (its tokenizer, engine, limits and API key)."""

    def __init__(self, server: Any):
        self.server = server
        self.tok = server.session.tokenizer

    def routes(self) -> list[Route]:
        return [Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"]),
                Route("/v1/embeddings", self.embeddings, methods=["POST"])]

    async def _json(self, request: Request, known: set[str]) -> dict[str, Any]:
        body = parse_json(await self.server._body(request))
        check_keys(body, known)
        return body

    async def tokenize(self, request: Request) -> Response:
        body = await self._json(request, _TOKENIZE)
        content = body.get("content")
        if not isinstance(content, str):
            raise bad(f"'content' is required: the text to tokenize (a string), got {kind_of(content)}", "content")
        add_special = flag(body, "add_special", False)
        parse_special, with_pieces = flag(body, "parse_special", True), flag(body, "with_pieces", False)
        special = None if add_special else False  # None: as the vocabulary's add_bos / add_eos flags say
        try:
            ids = await run_in_threadpool(self.tok.encode, content, add_bos=special, add_eos=special,
                                          parse_special=parse_special)
        except TracelmError as e:
            raise bad(f"content: {e}", "content") from None
        if with_pieces:
            return JSONResponse({"tokens": [{"id": i, "piece": piece(self.tok, i)} for i in ids]})
        return JSONResponse({"tokens": ids})

    async def detokenize(self, request: Request) -> Response:
        body = await self._json(request, _DETOKENIZE)
        if body.get("tokens") is None:
            raise bad("'tokens' is required: an array of token ids", "tokens")
        ids = token_ids(body["tokens"], self.tok.n_vocab, "tokens")
        return JSONResponse({"content": await run_in_threadpool(self.tok.decode, ids)})

    def _inputs(self, x: Any, truncate: bool = False) -> list[list[int]]:
        """OpenAI's input -- a text, an array of texts, an array of token ids, or an array of those -- as the token
        ids of each input, each within the context, or cut to it when `truncate` (runs in a thread of the pool)."""
        if isinstance(x, str):
            x = [x]
        elif isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x):
            x = [x]
        if not isinstance(x, list) or not x:
            raise bad(f"'input' must be a string, an array of strings, an array of token ids or an array of those, "
                      f"not empty; got {kind_of(x)}", "input")
        if len(x) > MAX_INPUTS:
            raise bad(f"'input' takes at most {MAX_INPUTS} inputs, got {len(x)}", "input")
        n_ctx, out = self.server.cfg.context, []
        for i, item in enumerate(x):
            where = f"input[{i}]"
            if isinstance(item, str):
                try:
                    ids = self.tok.encode(item)
                except TracelmError as e:
                    raise bad(f"{where}: {e}", where) from None
            elif isinstance(item, list):
                ids = token_ids(item, self.tok.n_vocab, where)
            else:
                raise bad(f"'{where}' must be a string or an array of token ids, got {kind_of(item)}", where)
            if not ids:
                raise bad(f"'{where}' is empty: nothing to embed", where)
            if len(ids) > n_ctx and truncate:
                ids = ids[:n_ctx]
            if len(ids) > n_ctx:
                raise bad(f"'{where}' is {len(ids)} tokens; this model's context is {n_ctx} tokens", where,
                          "context_length_exceeded")
            out.append(ids)
        return out

    async def vectors(self, raw: Any, truncate: bool = False) -> tuple[list[np.ndarray], list[list[int]]]:
        """The embeddings of OpenAI-style `input` (see `_inputs`) and each input's token ids, computed on the engine
        as a Task (a 429 when its queue is full)."""
        server = self.server
        inputs = await run_in_threadpool(self._inputs, raw, truncate)
        pooling = server.cfg.server.pooling
        task = Task(inputs, lambda runner, ids: embedding(runner, ids, pooling),
                    deadline=time.monotonic() + server.cfg.server.request_timeout)
        server.submit(task)
        try:
            return await asyncio.wrap_future(task.future), inputs
        except TracelmError as e:
            raise ApiError(400, str(e)) from None

    async def embeddings(self, request: Request) -> Response:
        server = self.server
        body = await self._json(request, _EMBEDDINGS)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise bad("'model' is required: a model id from GET /v1/models", "model")
        if server.strict_model and model not in server.model_names:
            raise server._no_model(model)
        encoding = body.get("encoding_format") or "float"
        if encoding not in ("float", "base64"):
            raise bad(f"'encoding_format' must be \"float\" or \"base64\", got {str(encoding)[:40]}",
                      "encoding_format")
        check_dimensions(body.get("dimensions"), server.model.cfg.n_embd)
        if body.get("user") is not None and not isinstance(body["user"], str):
            raise bad(f"'user' must be a string, got {kind_of(body['user'])}", "user")
        vectors, inputs = await self.vectors(body.get("input"))
        data = [{"object": "embedding", "index": i, "embedding": encode_vector(v, encoding)}
                for i, v in enumerate(vectors)]
        n = sum(len(ids) for ids in inputs)
        return JSONResponse({"object": "list", "data": data, "model": server.model_id,
                             "usage": {"prompt_tokens": n, "total_tokens": n}})


def encode_vector(v: np.ndarray, encoding: str) -> list[float] | str:
    """An embedding as OpenAI sends it: a list of floats, or base64 of its little-endian f32 bytes."""
    if encoding == "base64":
        return base64.b64encode(np.asarray(v, "<f4").tobytes()).decode("ascii")
    return np.asarray(v, np.float32).tolist()


def token_routes(server: Any) -> list[Route]:
    return TokenRoutes(server).routes()
