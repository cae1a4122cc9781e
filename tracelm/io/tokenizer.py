"""Tokenizers: text <-> token ids, one interface for every vocabulary tracelm reads.

A `Tokenizer` is built from a file by tracelm.io.tokenizer_formats (GGUF `gpt2` and `llama` vocabularies,
llama2.c `tokenizer.bin`, Hugging Face `tokenizer.json`, SentencePiece `.model`); this module holds what
every kind shares: the token types, the encoders that run text -> ids, and decoding.

Decoding never goes through a library: every token has its raw bytes, and text is their UTF-8 decoding, so
a stream of tokens decodes piece by piece exactly as the whole.

Special tokens: control (and unknown) tokens are matched in text only with `parse_special=True`; user-defined
tokens are always matched whole (as llama.cpp and transformers do).
"""

from __future__ import annotations

import codecs
import ctypes
import re
import threading
from array import array
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import normalizers

from tracelm.state.errors import TracelmError

# tokenizer.ggml.token_type values
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPECIAL_ID_KEYS = ("bos_token_id", "eos_token_id", "eot_token_id", "eom_token_id")

# Texts of control tokens that end a turn in common chat formats (besides the eos/eot/eom ids).
EOG_TEXTS = frozenset(
    {
        "<|endoftext|>",
        "<|im_end|>",
        "<|eot_id|>",
        "<|eom_id|>",
        "<|end_of_text|>",
        "<|end|>",
        "<end_of_turn>",
        "<EOT>",
        "<|return|>",
    }
)

_SURROGATE = re.compile("[\ud800-\udfff]")


def _release_free_heap() -> None:
    """Give the C heap's free pages back to the system. Building a large BPE frees ~50-100 MB of Rust temporaries
    that glibc would otherwise keep resident (~30 MB of them for Gemma's 262k tokens). No-op without glibc."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError, TypeError):
        pass


def _packed(items: Iterable[bytes]) -> tuple[bytes, array]:
    """Byte strings end to end, and where each starts (one more offset than items: item i is [s[i], s[i + 1]))."""
    data, starts = bytearray(), array("I", [0])
    for b in items:
        data += b
        starts.append(len(data))
    return bytes(data), starts


def source_prefix(source: str) -> str:
    return f"{source}: " if source else ""


def _check_text(text: str) -> None:
    if not isinstance(text, str):
        raise TracelmError(f"text to encode must be a str, not {type(text).__name__}")
    if m := _SURROGATE.search(text):
        raise TracelmError(f"text has a lone surrogate U+{ord(m.group()):04X} at character {m.start()}; "
                           "it is not Unicode text")


# ---------------------------------------------------------------- encoders (text -> ids)


_CHUNK = 1 << 16  # texts longer than this are cut into pieces encoded in parallel, where that is exact
_CHUNK_CUT = re.compile(r"(?<=\S)\n(?=\S)")


class HFEncoder:
    """A `tokenizers` tokenizer over one vocabulary, matching control tokens in text or not.

    A long text is cut after newlines that stand between two non-space characters and the pieces are encoded
    in parallel (`encode_batch`), but only where no token can span such a cut: `split_safe` says the
    vocabulary has no mergeable or added token with a newline inside (always true of the byte-level
    pre-tokenizers, which end every piece at such a newline). `tail` is the normalizer without the
    SentencePiece space prefix: it stands in for the tokenizer's own while the pieces after the first are
    encoded (rather than a second copy of the whole tokenizer)."""

    def __init__(self, bpe: HFTokenizer, split_safe: bool = False, tail: normalizers.Normalizer | None = None):
        self.bpe = bpe
        self.split_safe = split_safe
        self._tail = tail
        self._lock = threading.Lock()  # encode_special_tokens and the normalizer are settings of the shared tokenizer

    def _run(self, texts: list[str], parse_special: bool, tail: bool = False) -> list[list[int]]:
        bpe = self.bpe
        with self._lock:
            bpe.encode_special_tokens = not parse_special  # off: control tokens' text is plain text
            if tail:
                head, bpe.normalizer = bpe.normalizer, self._tail
            try:
                if len(texts) == 1:
                    return [bpe.encode(texts[0], add_special_tokens=False).ids]
                return [e.ids for e in bpe.encode_batch(texts, add_special_tokens=False)]
            finally:
                if tail:
                    bpe.normalizer = head

    def __call__(self, text: str, parse_special: bool) -> list[int]:
        # (with parse_special, a SentencePiece prefix follows every control token: the tail normalizer, which
        # has no prefix, would miss it; so such texts are encoded whole)
        if len(text) <= _CHUNK or not self.split_safe or (parse_special and self._tail is not None):
            return self._run([text], parse_special)[0]
        cuts = [0]
        for m in _CHUNK_CUT.finditer(text):
            if m.end() - cuts[-1] >= _CHUNK:
                cuts.append(m.end())
        cuts.append(len(text))
        pieces = [text[a:b] for a, b in zip(cuts, cuts[1:], strict=False) if b > a]
        if len(pieces) == 1:
            return self._run(pieces, parse_special)[0]
        ids = self._run(pieces[:1], parse_special)[0]
        rest = self._run(pieces[1:], parse_special, tail=self._tail is not None)
        for r in rest:
            ids += r
        return ids

    def batch(self, texts: list[str], parse_special: bool) -> list[list[int]]:
        return self._run(texts, parse_special) if texts else []


class SentencePieceEncoder:
    """The `sentencepiece` library; with parse_special, control-token texts are cut out first."""

    def __init__(self, processor: Any, specials: Mapping[str, int]):
        self.sp = processor
        self.specials = dict(specials)
        texts = sorted(self.specials, key=len, reverse=True)
        self.pattern = re.compile("|".join(map(re.escape, texts))) if texts else None

    def __call__(self, text: str, parse_special: bool) -> list[int]:
        if not parse_special or self.pattern is None:
            return self.sp.encode(text) if text else []
        ids: list[int] = []
        pos = 0
        for m in self.pattern.finditer(text):
            if m.start() > pos:
                ids += self.sp.encode(text[pos : m.start()])
            ids.append(self.specials[m.group()])
            pos = m.end()
        if pos < len(text):
            ids += self.sp.encode(text[pos:])
        return ids


# ---------------------------------------------------------------- the one interface


class Tokenizer:
    """Text <-> token ids for one vocabulary, whatever file it came from."""

    def __init__(
        self,
        *,
        pieces: Sequence[str],
        types: Sequence[int],
        token_bytes: Iterable[bytes],
        encoder: Callable[[str, bool], list[int]],
        special_ids: Mapping[str, int | None],
        add_bos: bool,
        add_eos: bool = False,
        strip_first_space: bool = False,
        kind: str = "",
        source: str = "",
        chat_template: str | None = None,
    ):
        where = source_prefix(source)
        if len(types) != len(pieces):
            raise TracelmError(f"{where}{len(types)} token types for {len(pieces)} tokens")
        self.n_vocab = len(pieces)
        for name, i in special_ids.items():
            if i is not None and not 0 <= i < self.n_vocab:
                raise TracelmError(f"{where}{name} {i} is outside the vocabulary (size {self.n_vocab})")
        self._types = list(types)
        # every token's bytes end to end, and where each starts: two objects rather than n_vocab bytes objects; the
        # same for the pieces' text as UTF-8 (surrogatepass: every str round-trips), ~20 MB less than 262k str
        self._bytes, self._starts = _packed(token_bytes)
        self._text, self._text_starts = _packed(p.encode("utf-8", "surrogatepass") for p in pieces)
        self._ids: dict[str, int | None] = {}  # token_id's answers so far
        _release_free_heap()
        self._encoder = encoder
        self.kind = kind
        self.source = source
        self.chat_template = chat_template
        self.strip_first_space = strip_first_space
        self.bos_id = special_ids.get("bos_token_id")
        self.eos_id = special_ids.get("eos_token_id")
        self.unk_id = special_ids.get("unknown_token_id")
        self.add_bos = bool(add_bos)
        self.add_eos = bool(add_eos)
        ends = {special_ids.get(k) for k in SPECIAL_ID_KEYS[1:]} - {None}  # eos, eot, eom
        ends |= {i for i, (t, k) in enumerate(zip(pieces, types, strict=True)) if k == CONTROL and t in EOG_TEXTS}
        self.eog_ids: frozenset[int] = frozenset(i for i in ends if i is not None)

    def __repr__(self) -> str:
        return f"Tokenizer({self.kind}, {self.n_vocab} tokens, {self.source!r})"

    # ------------------------------------------------------------ encode

    def encode(
        self,
        text: str,
        add_bos: bool | None = None,
        parse_special: bool = False,
        add_eos: bool | None = None,
    ) -> list[int]:
        """Token ids of `text`; BOS/EOS as the vocabulary's flags say unless given."""
        _check_text(text)
        ids = self._encoder(text, parse_special)
        if self.add_bos if add_bos is None else add_bos:
            if self.bos_id is None:
                raise TracelmError("this vocabulary has no BOS token to add")
            ids.insert(0, self.bos_id)
        if self.add_eos if add_eos is None else add_eos:
            if self.eos_id is None:
                raise TracelmError("this vocabulary has no EOS token to add")
            ids.append(self.eos_id)
        return ids

    def encode_batch(self, texts: Sequence[str], add_bos: bool | None = None, parse_special: bool = False,
                     add_eos: bool | None = None) -> list[list[int]]:
        """`encode` of each text; in parallel where the encoder can."""
        texts = list(texts)
        for t in texts:
            _check_text(t)
        if not hasattr(self._encoder, "batch"):
            return [self.encode(t, add_bos, parse_special, add_eos) for t in texts]
        out = self._encoder.batch(texts, parse_special)
        bos = self.add_bos if add_bos is None else add_bos
        eos = self.add_eos if add_eos is None else add_eos
        if bos or eos:
            head = [self.encode("", add_bos=bos, add_eos=False)] if bos else [[]]
            tail = self.encode("", add_bos=False, add_eos=eos) if eos else []
            out = [head[0] + ids + tail for ids in out]
        return out

    # ------------------------------------------------------------ tokens

    def _check(self, token_id: int) -> int:
        if not isinstance(token_id, int) or not 0 <= token_id < self.n_vocab:
            raise TracelmError(f"token id {token_id} is outside the vocabulary (0..{self.n_vocab - 1})")
        return token_id

    def token_bytes(self, token_id: int) -> bytes:
        i = self._check(token_id)
        return self._bytes[self._starts[i] : self._starts[i + 1]]

    def piece(self, token_id: int) -> str:
        i = self._check(token_id)
        return self._text[self._text_starts[i] : self._text_starts[i + 1]].decode("utf-8", "surrogatepass")

    def token_type(self, token_id: int) -> int:
        return self._types[self._check(token_id)]

    def is_control(self, token_id: int) -> bool:
        return self._types[self._check(token_id)] == CONTROL

    def control_tokens(self) -> dict[str, int]:
        """Text -> id of the tokens that parse_special matches (control and unknown tokens)."""
        if not hasattr(self, "_controls"):
            found: dict[str, int] = {}
            for i, k in enumerate(self._types):
                if k in (CONTROL, UNKNOWN) and (p := self.piece(i)):
                    found.setdefault(p, i)
            self._controls = found
        return self._controls

    def token_id(self, piece: str) -> int | None:
        """The id of a token by its text (first one, if repeated), or None: looked up in the pieces' UTF-8, where an
        occurrence spans one piece exactly (no index of every piece: 262K strings would be ~30 MB)."""
        if piece not in self._ids:
            self._ids[piece] = self._find(piece.encode("utf-8", "surrogatepass"))
        return self._ids[piece]

    def _find(self, needle: bytes) -> int | None:
        starts, n = self._text_starts, self.n_vocab
        if not needle:
            return next((i for i in range(n) if starts[i] == starts[i + 1]), None)
        at = self._text.find(needle)
        while at >= 0:  # occurrences in order of position, so the first piece that is one has the lowest id
            i = bisect_left(starts, at)
            if i < n and starts[i] == at and starts[i + 1] == at + len(needle):
                return i
            at = self._text.find(needle, at + 1)
        return None

    # ------------------------------------------------------------ decode

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        stream = self.stream_decoder(skip_special)
        return "".join([stream.push(i) for i in ids]) + stream.flush()

    def stream_decoder(self, skip_special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special)


class StreamDecoder:
    """Decodes one token at a time, holding back the bytes of a character not yet complete. The text it
    gives, joined, is exactly `Tokenizer.decode` of the same ids."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._strip = tokenizer.strip_first_space  # the space the SentencePiece prefix added

    def push(self, token_id: int) -> str:
        tok = self._tokenizer
        data = tok.token_bytes(token_id)
        if tok.is_control(token_id):
            if self._skip_special:
                return ""
        elif self._strip:
            self._strip = False
            if data[:1] == b" ":
                data = data[1:]
        return self._utf8.decode(data)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
