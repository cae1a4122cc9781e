"""Byte-level BPE tokenizer for GGUF `gpt2` vocabularies, built on the `tokenizers` package.

The GGUF stores the vocabulary (in GPT-2's printable byte alphabet), the merges, a type per token and
`tokenizer.ggml.pre`, the name of the text-splitting rules the merges were learned with. Encoding is
`tokenizers`' BPE; decoding joins each token's raw bytes, so a stream of tokens can be decoded
piece by piece without ever cutting a UTF-8 character in half.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from tokenizers import AddedToken, Regex, models, pre_tokenizers
from tokenizers import Tokenizer as BPETokenizer

from tracelm import TracelmError

# tokenizer.ggml.token_type values
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


class PreTokenizer(NamedTuple):
    """How one `tokenizer.ggml.pre` splits text before BPE (as llama.cpp's llama-vocab.cpp does)."""

    splits: tuple[str, ...]  # regexes applied in turn; every match and every gap becomes its own piece
    ignore_merges: bool = False  # a piece that is itself a vocabulary token is taken whole
    add_bos: bool = False  # used when the file has no tokenizer.ggml.add_bos_token


_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = _CONTRACTIONS + (
    r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "gpt-2": PreTokenizer((_GPT2,)),
    # llama.cpp's fallback for files that name no known pre-tokenizer
    "default": PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")),
    "smollm": PreTokenizer((r"\p{N}", _GPT2)),  # every digit alone, then GPT-2's regex
    "llama-bpe": PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True),
    "llama3": PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True),
    "llama-v3": PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True),
    "qwen2": PreTokenizer((_QWEN2,)),
}

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


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's stand-in character per byte: printable latin-1 stands for itself, the rest U+0100 on."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    others = iter(range(0x100, 0x200))
    return {b: chr(b) if b in printable else chr(next(others)) for b in range(256)}


_CHAR_TO_BYTE = {ord(c): b for b, c in _byte_alphabet().items()}
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _raw_bytes(piece: str, token_type: int) -> bytes:
    if token_type in (NORMAL, UNUSED) and all(ord(c) in _CHAR_TO_BYTE for c in piece):
        return piece.translate(_CHAR_TO_BYTE).encode("latin-1")
    if token_type == BYTE and (m := _BYTE_TOKEN.fullmatch(piece)):
        return bytes([int(m.group(1), 16)])
    return piece.encode("utf-8")  # control / user-defined tokens are stored as plain text


class Tokenizer:
    """Text <-> token ids for one GGUF byte-level BPE vocabulary."""

    def __init__(
        self,
        tokens: list[str],
        merges: list[str],
        token_types: list[int],
        pre: str,
        special_ids: Mapping[str, int | None],
        add_bos: bool | None,
        source: str = "",
    ):
        where = f"{source}: " if source else ""
        spec = PRE_TOKENIZERS.get(pre)
        if spec is None:
            known = ", ".join(PRE_TOKENIZERS)
            raise TracelmError(f"{where}unknown tokenizer.ggml.pre {pre!r} (known: {known})")
        if len(token_types) != len(tokens):
            raise TracelmError(f"{where}{len(token_types)} token types for {len(tokens)} tokens")
        self.n_vocab = len(tokens)
        for name, i in special_ids.items():
            if i is not None and not 0 <= i < self.n_vocab:
                raise TracelmError(f"{where}{name} {i} is outside the vocabulary (size {self.n_vocab})")
        self._pieces = tokens
        self._types = token_types
        typed = list(zip(tokens, token_types, strict=True))
        self._bytes = [_raw_bytes(t, k) for t, k in typed]
        self.bos_id = special_ids.get("bos_token_id")
        self.eos_id = special_ids.get("eos_token_id")
        self.add_bos = spec.add_bos if add_bos is None else bool(add_bos)
        ends = {special_ids.get(k) for k in SPECIAL_ID_KEYS[1:]} - {None}  # eos, eot, eom
        ends |= {i for i, (t, k) in enumerate(typed) if k == CONTROL and t in EOG_TEXTS}
        self.eog_ids: frozenset[int] = frozenset(ends)

        vocab: dict[str, int] = {}
        for i, t in enumerate(tokens):
            vocab.setdefault(t, i)  # a repeated text keeps its first id, as llama.cpp does
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        try:
            self._plain = BPETokenizer(models.BPE(vocab, pairs, ignore_merges=spec.ignore_merges))
        except Exception as e:  # tokenizers raises plain Exception for a merge whose parts are not tokens
            raise TracelmError(f"{where}cannot build the BPE vocabulary: {e}") from None
        self._plain.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in spec.splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        # User-defined tokens are always matched whole; control (and unknown) tokens only when asked.
        self._plain.add_tokens(
            [AddedToken(t, special=False, normalized=False) for t, k in typed if k == USER_DEFINED]
        )
        self._plain.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t, k in typed if k in (CONTROL, UNKNOWN)]
        )
        self._special = BPETokenizer.from_str(self._plain.to_str())
        self._plain.encode_special_tokens = True  # special tokens' text is encoded as plain text

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], source: str = "") -> Tokenizer:
        where = f"{source}: " if source else ""
        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise TracelmError(f"{where}tokenizer.ggml.model is {model!r}, not byte-level BPE ('gpt2')")
        tokens = meta.get("tokenizer.ggml.tokens")
        merges = meta.get("tokenizer.ggml.merges")
        if not tokens or merges is None:
            raise TracelmError(f"{where}the GGUF has no tokenizer.ggml.tokens or tokenizer.ggml.merges")
        types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
        ids = {k: meta.get(f"tokenizer.ggml.{k}") for k in SPECIAL_ID_KEYS}
        return cls(
            list(tokens),
            list(merges),
            list(types),
            meta.get("tokenizer.ggml.pre", "default"),
            ids,
            meta.get("tokenizer.ggml.add_bos_token"),
            source,
        )

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = False) -> list[int]:
        bpe = self._special if parse_special else self._plain
        ids = bpe.encode(text, add_special_tokens=False).ids
        if self.add_bos if add_bos is None else add_bos:
            if self.bos_id is None:
                raise TracelmError("this vocabulary has no BOS token to add")
            ids.insert(0, self.bos_id)
        return ids

    def _check(self, token_id: int) -> int:
        if not 0 <= token_id < self.n_vocab:
            raise TracelmError(f"token id {token_id} is outside the vocabulary (0..{self.n_vocab - 1})")
        return token_id

    def token_bytes(self, token_id: int) -> bytes:
        return self._bytes[self._check(token_id)]

    def piece(self, token_id: int) -> str:
        return self._pieces[self._check(token_id)]

    def is_control(self, token_id: int) -> bool:
        return self._types[self._check(token_id)] == CONTROL

    def _shown_bytes(self, token_id: int, skip_special: bool) -> bytes:
        return b"" if skip_special and self.is_control(token_id) else self.token_bytes(token_id)

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return b"".join(self._shown_bytes(i, skip_special) for i in ids).decode("utf-8", errors="replace")

    def stream_decoder(self, skip_special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special)


class StreamDecoder:
    """Decodes one token at a time, holding back the bytes of a character not yet complete."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self._tokenizer._shown_bytes(token_id, self._skip_special))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
