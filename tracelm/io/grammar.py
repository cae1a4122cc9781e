"""Grammars for constrained decoding: a `Constraint` compiled by llguidance against the model's own vocabulary.

llguidance (the grammar engine llama.cpp and vLLM use) is given every token's bytes as tracelm's `Tokenizer`
holds them (byte-level BPE and SentencePiece alike: `token_bytes`), with control, unknown and unused tokens
(and user-defined ones spelled like `<...>`) marked special by a leading 0xFF byte, so no grammar can spell
them as text; the end-of-generation ids are its EOS tokens, allowed once the grammar accepts. Its token
trie is built once per tokenizer (~0.15 s for SmolLM2's 49k tokens, ~0.5 s for Qwen2.5's 152k).

A `Matcher` follows one generation: `mask()` is the packed bitmask of the tokens allowed next (the input of
the constrain stage), `consume(token)` advances it. `state` is a running sha256-128 over what it has been
through -- the constraint's digest, then per token the digest of the mask it was drawn under and the token
id -- so two runs whose states agree went through the same masks and tokens (the trace's token events carry
it). A GBNF grammar (llama.cpp's) is converted to Lark on the way in (`lark_of_gbnf`). Grammar problems (invalid
JSON or schema, a bad regex, Lark or GBNF grammar) are TracelmErrors naming them; any
other exception the library raises (a version whose API differs, an internal failure) is a `GrammarLibraryError`
with the library's own message and version, so a request that meets one is refused, not crashed on.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import re
from collections.abc import Iterator
from typing import Any

import numpy as np

from tracelm.io.tokenizer import CONTROL, UNKNOWN, UNUSED, USER_DEFINED, Tokenizer
from tracelm.state.errors import GrammarLibraryError, TracelmError
from tracelm.state.records import Constraint

# JSON whitespace between tokens as llama.cpp's JSON-schema grammars allow it: one space, or a newline and up to
# 20 spaces or tabs of indent (llguidance's own default is any run of whitespace, on which a sampled small model
# can drift into endless blank lines). A schema's top-level "x-guidance" key overrides it.
JSON_OPTIONS = {"whitespace_pattern": r"(?: |\n[ \t]{0,20})"}


def _llguidance() -> Any:
    import llguidance

    return llguidance


@contextlib.contextmanager
def library(where: str) -> Iterator[None]:
    """Around every call into llguidance: what it raises, other than tracelm's own errors, becomes a
    GrammarLibraryError naming `where`, the library's version and its message (first line)."""
    try:
        yield
    except TracelmError:
        raise
    except Exception as e:  # noqa: BLE001 -- the library's exceptions are not part of its API
        from importlib.metadata import PackageNotFoundError, version

        try:
            ver = version("llguidance")
        except PackageNotFoundError:
            ver = "?"
        raise GrammarLibraryError(f"{where}: the grammar library (llguidance {ver}) raised "
                                  f"{type(e).__name__}: {_first_line(str(e))}") from None


def vocabulary(tok: Tokenizer) -> list[bytes]:
    """Every token's bytes as llguidance takes them: tokens no text may spell get a leading 0xFF byte."""
    return [b"\xff" + tok.token_bytes(i) if unspellable(tok, i) else tok.token_bytes(i) for i in range(tok.n_vocab)]


def unspellable(tok: Tokenizer, i: int) -> bool:
    """Whether token i is one no text may spell (control, unknown, unused, a user-defined <...> marker): a grammar
    names it by id (`<[i]>`)."""
    b, kind = tok.token_bytes(i), tok.token_type(i)
    return kind in (CONTROL, UNKNOWN, UNUSED) or (kind == USER_DEFINED and b[:1] == b"<" and b[-1:] == b">")


def end_ids(tok: Tokenizer) -> list[int]:
    """The ids that end a constrained generation (EOS first): allowed when the grammar accepts."""
    ends = sorted(tok.eog_ids - {tok.eos_id}) if tok.eos_id is not None else sorted(tok.eog_ids)
    ids = ([tok.eos_id] if tok.eos_id is not None else []) + ends
    if not ids:
        raise TracelmError(f"{tok.source}: the vocabulary has no end-of-generation token: a grammar cannot end")
    return ids


class _Vocab:
    """What llguidance.TokenizerWrapper reads from a tokenizer."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.tokens = vocabulary(tok)
        self.eos_token_id = end_ids(tok)[0]
        self.bos_token_id = tok.bos_id
        self.special_token_ids = [i for i, b in enumerate(self.tokens) if b[:1] == b"\xff"]

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # llguidance then hands over text instead of bytes
            raise TypeError("text, not bytes")
        return self.tok.encode(text, add_bos=False, add_eos=False)


@functools.lru_cache(maxsize=4)
def ll_tokenizer(tok: Tokenizer) -> Any:
    """llguidance's tokenizer (its token trie) for `tok`, built once per tokenizer."""
    llg = _llguidance()
    with library(f"{tok.source}: the vocabulary's token trie"):
        return llg.LLTokenizer(llg.TokenizerWrapper(_Vocab(tok)), eos_token=end_ids(tok))


@functools.lru_cache(maxsize=64)
def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar of a constraint (TracelmError naming the problem for a source it cannot read)."""
    with library(f"constraint {constraint.kind}"):
        return _grammar_text(constraint)


def _grammar_text(constraint: Constraint) -> str:
    llg, kind, src = _llguidance(), constraint.kind, constraint.source
    where = f"constraint {kind}"
    if kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if not src.strip():
        raise TracelmError(f"{where}: the source is empty (a {'schema' if kind == 'json_schema' else kind} is needed)")
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(src)
    if kind == "lark":
        return llg.LLMatcher.grammar_from_lark(src)
    try:
        schema = json.loads(src)
    except json.JSONDecodeError as e:
        raise TracelmError(f"{where}: the schema is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") \
            from None
    if not isinstance(schema, dict | bool):
        raise TracelmError(f"{where}: a JSON schema is an object (or true/false), got {type(schema).__name__}")
    options = JSON_OPTIONS if constraint.strict else {**JSON_OPTIONS, "lenient": True}
    try:
        return llg.LLMatcher.grammar_from_json_schema(json.dumps(closed(schema) if constraint.strict else schema),
                                                      defaults=options)
    except ValueError as e:
        raise TracelmError(f"{where}: {e}") from None


def lark_of_gbnf(text: str, where: str) -> str:
    """A GBNF grammar (llama.cpp's format: `root ::= ...`) as the Lark grammar llguidance reads, by llguidance's own
    converter (its `root` rule becomes `start`). The constraint then holds the Lark text: a trace records the
    grammar that was applied, in the one dialect its replay compiles. A grammar the converter cannot read is a
    TracelmError naming `where` and the converter's reason."""
    if not text.strip():
        raise TracelmError(f"{where}: the GBNF grammar is empty")
    try:
        from llguidance.gbnf_to_lark import gbnf_to_lark
    except ImportError as e:
        raise GrammarLibraryError(f"{where}: the grammar library has no GBNF converter ({e})") from None
    try:
        return gbnf_to_lark(text)
    except Exception as e:  # noqa: BLE001 -- the converter's errors (GbnfToLarkError, Exception) are about the text
        raise TracelmError(f"{where}: not a GBNF grammar: {_first_line(str(e))}") from None


_DATA_KEYS = frozenset({"enum", "const", "default", "examples"})  # their values are JSON data, not schemas


def closed(schema: Any) -> Any:
    """A strict schema (OpenAI's strict mode): every object schema with `properties` and no `additionalProperties`
    gets `additionalProperties: false`, so the output holds only the properties the schema names."""
    if isinstance(schema, list):
        return [closed(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _DATA_KEYS else closed(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def constraint_digest(constraint: Constraint) -> str:
    """sha256-128 of the constraint as canonical JSON (kind, source, strict): which constraint a trace ran under."""
    text = json.dumps({"kind": constraint.kind, "source": constraint.source, "strict": constraint.strict},
                      sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def _first_line(message: str) -> str:
    """llguidance's error text on one line, without its debugging context (parser state, source echo, carets)."""
    lines = []
    for ln in message.strip().splitlines():
        ln = ln.strip()
        if ln.startswith("<state>"):
            break
        if ln and not re.fullmatch(r"[\^~ ]+|\d+ \|.*", ln):
            lines.append(ln)
    return " ".join(lines)[:400] or "invalid grammar"


def check_constraint(constraint: Constraint, tok: Tokenizer) -> None:
    """A TracelmError naming the problem unless the constraint compiles against `tok`."""
    Matcher(constraint, tok)


class Matcher:
    """One generation's place in a constraint's grammar (see the module docstring)."""

    def __init__(self, constraint: Constraint, tok: Tokenizer):
        llg = _llguidance()
        self.constraint, self.n_vocab = constraint, tok.n_vocab
        self.digest = constraint_digest(constraint)
        self.state = self.digest
        self.where = where = f"constraint {constraint.kind}"
        text = grammar_text(constraint)
        with library(where):
            self._m = llg.LLMatcher(ll_tokenizer(tok), text, log_level=0)
            if self._m.is_error():
                raise TracelmError(f"{where}: {_first_line(self._m.get_error())}")
        self._words = (tok.n_vocab + 31) // 32

    def mask(self) -> np.ndarray:
        """The tokens allowed next: a packed int32 bitmask (stages/constrain.py)."""
        with library(self.where):
            mask = np.frombuffer(self._m.compute_bitmask(), np.int32)
            if self._m.is_error():
                raise TracelmError(f"{self.where}: {_first_line(self._m.get_error())}")
        return mask[: self._words]

    def consume(self, token: int, mask_hash: str) -> None:
        """Advance past `token`, drawn under the mask of digest `mask_hash` (`mask_digest`); the state hash takes
        both."""
        with library(self.where):
            if not self._m.consume_token(token):
                raise TracelmError(f"{self.where}: token {token} refused: {_first_line(self._m.get_error())}")
        h = hashlib.sha256(bytes.fromhex(self.state))
        h.update(bytes.fromhex(mask_hash))
        h.update(int(token).to_bytes(4, "little"))
        self.state = h.hexdigest()[:32]

    @property
    def stopped(self) -> bool:
        """The grammar is complete: no token but end-of-generation may follow."""
        with library(self.where):
            return self._m.is_stopped()


def mask_digest(mask: np.ndarray) -> str:
    """sha256-128 of a packed mask's bytes."""
    return hashlib.sha256(np.ascontiguousarray(mask, np.int32).tobytes()).hexdigest()[:32]
