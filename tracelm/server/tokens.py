"""The token endpoints: POST /tokenize and /detokenize in llama-server's shapes.

- /tokenize `{"content": TEXT, "add_special": false, "parse_special": true, "with_pieces": false}` ->
  `{"tokens": [ids]}`, or with pieces `{"tokens": [{"id", "piece"}]}`, a piece as text when its bytes are UTF-8,
  else as the list of its bytes. `add_special` adds BOS/EOS as the vocabulary's flags say; `parse_special` reads
  control tokens spelled in the text as those tokens (else as plain text).
- /detokenize `{"tokens": [ids]}` -> `{"content": TEXT}`.
"""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tracelm.server.errors import bad, kind_of
from tracelm.server.params import parse_json
from tracelm.state.errors import TracelmError

_TOKENIZE = {"content", "add_special", "parse_special", "with_pieces", "model"}
_DETOKENIZE = {"tokens", "model"}


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


def piece(tok: Any, token: int) -> str | list[int]:
    """A token's text when its bytes are UTF-8, else the list of its bytes (llama-server's `with_pieces`)."""
    b = tok.token_bytes(token)
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return list(b)


class TokenRoutes:
    """The handlers, on one Server (its tokenizer, limits and API key)."""

    def __init__(self, server: Any):
        self.server = server
        self.tok = server.session.tokenizer

    def routes(self) -> list[Route]:
        return [Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"])]

    async def _json(self, request: Request, known: set[str]) -> dict[str, Any]:
        self.server._check_key(request)
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


def token_routes(server: Any) -> list[Route]:
    return TokenRoutes(server).routes()
