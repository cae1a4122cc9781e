"""Tokenizer file formats: each function reads one kind of vocabulary and builds a `Tokenizer`.

Kinds:
- GGUF `gpt2` (byte-level BPE with merges, split first by the rules `tokenizer.ggml.pre` names),
- GGUF `llama` (SentencePiece-style BPE over scores: space as U+2581, byte fallback `<0xHH>`, unknown token),
- llama2.c `tokenizer.bin` (the same algorithm, its own file layout),
- Hugging Face `tokenizer.json` (+ `tokenizer_config.json`), run by the `tokenizers` package,
- SentencePiece `.model`, run by the `sentencepiece` package.

The BPE kinds are encoded by `tokenizers` (Rust): the GGUF vocabulary is turned into a `tokenizers` BPE model
(for scored vocabularies, merges ranked by the score of the token they make, which is the order in which
SentencePiece's BPE and llama.cpp merge). Every kind gives each token its raw bytes, from which the
`Tokenizer` decodes.
"""

from __future__ import annotations

import json
import re
import struct
from array import array
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from tokenizers import AddedToken, Regex, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from tracelm.io import checks
from tracelm.io.tokenizer import (
    BYTE,
    CONTROL,
    NORMAL,
    SPECIAL_ID_KEYS,
    UNKNOWN,
    UNUSED,
    USER_DEFINED,
    HFEncoder,
    SentencePieceEncoder,
    Tokenizer,
    source_prefix,
)
from tracelm.state.errors import ModelFormatError, TracelmError

SPACE = "\u2581"  # SentencePiece's visible space
# a tokenizer.json's highest id at most this many times its tokens, plus this gap (ids are dense in real ones; the
# tables made from it are as long as the highest id)
MAX_ID_SPREAD, MAX_ID_GAP = 4, 1 << 16


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
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
# DeepSeek LLM's letter class (its tokenizer.json's, as llama.cpp spells it): code point ranges, in hex
_DEEPSEEK_LETTER_RANGES = """
41-5A 61-7A B5 C0-D6 D8-F6 F8-1BA 1BC-1BF 1C4-293 295-2AF 370-373 376-377 37B-37D 37F 386 388-38A 38C
38E-3A1 3A3-3F5 3F7-481 48A-52F 531-556 10A0-10C5 13A0-13F5 13F8-13FD 1C90-1CBA 1CBD-1CBF 1D00-1D2B 1D6B-1D77
1D79-1D9A 1E00-1F15 1F18-1F1D 1F20-1F45 1F48-1F4D 1F50-1F57 1F59 1F5B 1F5D 1F5F-1F7D 1F80-1FB4 1FB6-1FBC 1FBE
1FC2-1FC4 1FC6-1FCC 1FD0-1FD3 1FD6-1FDB 1FE0-1FEC 1FF2-1FF4 1FF6-1FFC 2102 2107 210A-2113 2115 2119-211D 2124
2126 2128 212A-212D 212F-2134 2139 213C-213F 2145-2149 214E 2183-2184 2C00-2C7B 2C7E-2CE4 2CEB-2CEE 2CF2-2CF3
A640-A66D A680-A69B A722-A76F A771-A787 A78B-A78E AB70-ABBF FB00-FB06 FB13-FB17 FF21-FF3A FF41-FF5A
10400-1044F 104B0-104D3 104D8-104FB 10C80-10CB2 10CC0-10CF2 118A0-118DF 1E900-1E943
"""
_DEEPSEEK_LETTERS = "".join(
    "-".join(f"\\x{{{cp}}}" for cp in r.split("-")) for r in _DEEPSEEK_LETTER_RANGES.split()
)

_GPT2_RULES = PreTokenizer((_GPT2,))
_STARCODER_RULES = PreTokenizer((r"\p{N}", _GPT2))  # every digit alone, then GPT-2's regex
_LLAMA3_RULES = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)

PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "gpt-2": _GPT2_RULES,
    "gpt2": _GPT2_RULES,
    "phi-2": _GPT2_RULES,
    "mpt": _GPT2_RULES,
    "gpt-neox": _GPT2_RULES,
    "olmo": _GPT2_RULES,
    # llama.cpp's rules for files that name the generic pre-tokenizer
    "default": PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")),
    "smollm": _STARCODER_RULES,
    "starcoder": _STARCODER_RULES,
    "refact": _STARCODER_RULES,
    "codeshell": _STARCODER_RULES,
    "command-r": _STARCODER_RULES,
    "llama-bpe": _LLAMA3_RULES,
    "llama3": _LLAMA3_RULES,
    "llama-v3": _LLAMA3_RULES,
    "dbrx": PreTokenizer((_LLAMA3,)),
    "smaug-bpe": PreTokenizer((_LLAMA3,)),
    "qwen2": PreTokenizer((_QWEN2,)),
    "stablelm2": PreTokenizer((_QWEN2,)),
    "deepseek-r1-qwen": PreTokenizer((_QWEN2,)),
    "falcon": PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")),
    "deepseek-llm": PreTokenizer(
        (
            r"[\r\n]",
            rf"\s?[{_DEEPSEEK_LETTERS}]+",
            r"\s?[!-/:-~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3000}-\x{3002}]+",
            r"\s+$",
            _CJK,
            r"\p{N}+",
        )
    ),
    "deepseek-coder": PreTokenizer((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")),
}

def _byte_alphabet() -> dict[int, str]:
    """GPT-2's stand-in character per byte: printable latin-1 stands for itself, the rest U+0100 on."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    others = iter(range(0x100, 0x200))
    return {b: chr(b) if b in printable else chr(next(others)) for b in range(256)}


_CHAR_TO_BYTE = {ord(c): b for b, c in _byte_alphabet().items()}
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_bytes(piece: str, token_type: int) -> bytes:
    if token_type in (NORMAL, UNUSED) and all(ord(c) in _CHAR_TO_BYTE for c in piece):
        return piece.translate(_CHAR_TO_BYTE).encode("latin-1")
    if token_type == BYTE and (m := _BYTE_TOKEN.fullmatch(piece)):
        return bytes([int(m.group(1), 16)])
    return piece.encode("utf-8")  # control / user-defined tokens are stored as plain text


def _spm_bytes(piece: str, token_type: int) -> bytes:
    if token_type == BYTE and (m := _BYTE_TOKEN.fullmatch(piece)):
        return bytes([int(m.group(1), 16)])
    if token_type in (CONTROL, UNKNOWN):
        return piece.encode("utf-8")
    return piece.replace(SPACE, " ").encode("utf-8")


def _as_list(values: Any) -> list:
    return values.tolist() if isinstance(values, np.ndarray) else list(values)


class _Pairs(Sequence):
    """The merges handed to `models.BPE`, made pair by pair as it reads them (it takes the length, then iterates
    once): as a list, Gemma's 0.5M pairs of new strings took ~110 MB, just when the Rust build needs ~120 MB."""

    def __init__(self, n: int, pair: Callable[[int], tuple[str, str]]):
        self._n, self._pair = n, pair

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> tuple[str, str]:  # type: ignore[override]
        if not 0 <= i < self._n:
            raise IndexError(i)
        return self._pair(i)

    def __iter__(self):
        return map(self._pair, range(self._n))


def _bpe_merges_from_scores(tokens: Sequence[str], vocab: Mapping[str, int], order: Sequence[int],
                            types: Sequence[int]) -> _Pairs:
    """Merges for a scored (SentencePiece-style) vocabulary: every split of a mergeable token into two
    tokens, ranked by the token's place in `order` (its score, highest first; ties: the lower id first).
    `vocab` maps each text to its first id; a merge is kept as the ids of its two halves."""
    get = vocab.get
    left, right = array("i"), array("i")
    for i in order:
        t = tokens[i]
        if types[i] not in (NORMAL, USER_DEFINED, UNUSED) or len(t) < 2 or vocab[t] != i:
            continue
        for k in range(1, len(t)):
            a = get(t[:k])
            if a is not None and (b := get(t[k:])) is not None:
                left.append(a)
                right.append(b)
    return _Pairs(len(left), lambda m: (tokens[left[m]], tokens[right[m]]))


def _spm_hf_tokenizer(
    tokens: Sequence[str],
    scores: Sequence[float],
    types: Sequence[int],
    add_space_prefix: bool,
    unk_id: int | None,
    rank_by_id: bool = False,
) -> HFTokenizer:
    # User-defined runs of spaces (Gemma's) are stored with plain spaces: as transformers does, they are
    # ordinary pieces in U+2581 form, made by merges, not matched whole in the raw text.
    respell = [k == USER_DEFINED and " " in t for t, k in zip(tokens, types, strict=True)]
    tokens = [t.replace(" ", SPACE) if r else t for t, r in zip(tokens, respell, strict=True)]
    types = [NORMAL if r else k for k, r in zip(types, respell, strict=True)]
    del respell
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    # highest score first, ties by id (a stable sort of the negated scores)
    order = range(len(tokens)) if rank_by_id else np.argsort(-np.asarray(scores, np.float64), kind="stable").tolist()
    merges = _bpe_merges_from_scores(tokens, vocab, order, types)
    del order
    unk = tokens[unk_id] if unk_id is not None else None
    has_bytes = any(k == BYTE for k in types)
    bpe = HFTokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=has_bytes))
    del vocab, merges
    steps = [normalizers.Prepend(SPACE)] if add_space_prefix else []
    bpe.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    _add_special(bpe, tokens, types)
    return bpe


def _spm_encoder(bpe: HFTokenizer, tokens: Sequence[str], types: Sequence[int], add_space_prefix: bool):
    safe = not any("\n" in t[:-1] for t, k in zip(tokens, types, strict=True) if k != BYTE)
    return HFEncoder(bpe, split_safe=safe, tail=normalizers.Replace(" ", SPACE) if add_space_prefix else None)


def _add_special(bpe: HFTokenizer, tokens: Sequence[str], types: Sequence[int]) -> None:
    # User-defined tokens are always matched whole; control (and unknown) tokens only when asked.
    bpe.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types, strict=True)
         if k == USER_DEFINED]
    )
    bpe.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types, strict=True)
         if k in (CONTROL, UNKNOWN)]
    )


def from_gguf_metadata(meta: Mapping[str, Any], source: str = "") -> Tokenizer:
    """From GGUF `tokenizer.ggml.*` metadata: `gpt2` (byte-level BPE) or `llama` (SentencePiece BPE), every field
    checked by type (and count) first."""
    where = source_prefix(source)
    model = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    field = lambda key: f"{where}tokenizer.ggml.{key}"  # noqa: E731
    model = None if model is None else checks.string(model, field("model"))
    tokens = [] if tokens is None else checks.strings(tokens, field("tokens"))
    if model in (None, "none", "no") or not tokens:
        raise TracelmError(f"{where}the GGUF has no vocabulary (tokenizer.ggml.model {model!r}, "
                           f"{len(tokens)} tokens)")
    types = meta.get("tokenizer.ggml.token_type")  # (numbers read from a GGUFFile are a numpy array)
    if types is not None:
        types = checks.integers(types, field("token_type"), len(tokens)).tolist()
    else:
        types = [NORMAL] * len(tokens)
    ids = {k: _optional(meta, k, lambda v, w: checks.integer(v, w, lo=0, hi=len(tokens) - 1), where)
           for k in (*SPECIAL_ID_KEYS, "unknown_token_id")}  # ids of the vocabulary's tokens
    flag = lambda key, default: _optional(meta, key, checks.boolean, where, default)  # noqa: E731
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        checks.string(template, f"{where}tokenizer.chat_template")
    template = template if isinstance(template, str) and template.strip() else None
    add_eos = flag("add_eos_token", False)
    if model == "gpt2":
        return _byte_level(meta, tokens, types, ids, add_eos, template, source)
    if model == "llama":
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise ModelFormatError(f"{where}tokenizer.ggml.scores has {0 if scores is None else len(scores)} "
                                   f"values for {len(tokens)} tokens")
        scores = checks.numbers(scores, field("scores"), len(tokens))
        return from_scored_vocab(
            tokens, scores, types, ids,
            add_bos=flag("add_bos_token", True),
            add_eos=add_eos,
            add_space_prefix=flag("add_space_prefix", True),
            # Gemma's scores rank its user-defined tokens (runs of spaces, HTML tags) at -1000 while its
            # merges made them early: rank by position (which orders its normal tokens as their scores do),
            # as transformers' GGUF loader does for Gemma.
            rank_by_id=str(meta.get("general.architecture", "")) in ("gemma", "gemma2", "gemma3"),
            kind="gguf-llama", source=source, chat_template=template,
        )  # fmt: skip
    raise TracelmError(f"{where}tokenizer.ggml.model {model!r} is not supported (supported: 'gpt2', 'llama')")


def _optional(meta: Mapping[str, Any], key: str, check: Callable[[Any, str], Any], where: str,
              default: Any = None) -> Any:
    """`tokenizer.ggml.<key>` checked, or `default` when absent."""
    value = meta.get(f"tokenizer.ggml.{key}")
    return default if value is None else check(value, f"{where}tokenizer.ggml.{key}")


def _byte_level(meta, tokens, types, ids, add_eos, template, source) -> Tokenizer:
    where = source_prefix(source)
    pre = checks.string(meta.get("tokenizer.ggml.pre", "default"), f"{where}tokenizer.ggml.pre")
    spec = PRE_TOKENIZERS.get(pre)
    if spec is None:
        known = ", ".join(PRE_TOKENIZERS)
        raise TracelmError(f"{where}unknown tokenizer.ggml.pre {pre!r} (known: {known})")
    merges = meta.get("tokenizer.ggml.merges")
    if merges is None:
        raise TracelmError(f"{where}the GGUF has no tokenizer.ggml.merges")
    merges = checks.strings(merges, f"{where}tokenizer.ggml.merges")
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a repeated text keeps its first id, as llama.cpp does
    pairs = _Pairs(len(merges), lambda m: tuple(merges[m].split(" ", 1)))
    try:
        bpe = HFTokenizer(models.BPE(vocab, pairs, ignore_merges=spec.ignore_merges))
    except Exception as e:  # tokenizers raises plain Exception for a merge whose parts are not tokens
        raise TracelmError(f"{where}cannot build the BPE vocabulary: {e}") from None
    del vocab
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in spec.splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    _add_special(bpe, tokens, types)
    add_bos = _optional(meta, "add_bos_token", checks.boolean, where)
    return Tokenizer(
        pieces=tokens, types=types,
        token_bytes=map(_byte_level_bytes, tokens, types),
        encoder=HFEncoder(bpe, split_safe=not any("\n" in t for t, k in zip(tokens, types, strict=True)
                                                  if k in (CONTROL, UNKNOWN, USER_DEFINED))),
        special_ids=ids, add_bos=spec.add_bos if add_bos is None else add_bos, add_eos=add_eos,
        kind=f"gguf-gpt2/{pre}", source=source, chat_template=template,
    )  # fmt: skip


def from_scored_vocab(
    tokens: list[str],
    scores: Sequence[float] | np.ndarray,
    types: list[int],
    special_ids: Mapping[str, int | None],
    *,
    add_bos: bool = True,
    add_eos: bool = False,
    add_space_prefix: bool = True,
    rank_by_id: bool = False,
    kind: str = "spm-bpe",
    source: str = "",
    chat_template: str | None = None,
) -> Tokenizer:
    """SentencePiece-style BPE: pieces with U+2581 for space, merged by score (or by position where the
    scores do not give the merge order), bytes as `<0xHH>`."""
    bpe = _spm_hf_tokenizer(tokens, scores, types, add_space_prefix, special_ids.get("unknown_token_id"),
                            rank_by_id)
    return Tokenizer(
        pieces=tokens, types=types,
        token_bytes=map(_spm_bytes, tokens, types),
        encoder=_spm_encoder(bpe, tokens, types, add_space_prefix), special_ids=special_ids,
        add_bos=add_bos, add_eos=add_eos,
        strip_first_space=add_space_prefix, kind=kind, source=source, chat_template=chat_template,
    )  # fmt: skip


def from_llama2c(path: str | Path) -> Tokenizer:
    """llama2.c's `tokenizer.bin`: max token length (i32), then per token: score (f32), length (i32), bytes.
    Token 0 is <unk>, 1 and 2 are BOS and EOS, `<0xHH>` are byte tokens; spaces are plain spaces."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise TracelmError(f"{path}: cannot read: {e.strerror}") from None
    if len(data) < 4:
        raise TracelmError(f"{path.name}: not a llama2.c tokenizer (only {len(data)} bytes)")
    pos, tokens, scores = 4, [], []
    while pos < len(data):
        if pos + 8 > len(data):
            raise TracelmError(f"{path.name}: truncated or corrupt llama2.c tokenizer at byte {pos}")
        score, n = struct.unpack_from("<fi", data, pos)
        pos += 8
        if n < 0 or pos + n > len(data):
            raise TracelmError(f"{path.name}: truncated or corrupt llama2.c tokenizer (token {len(tokens)} "
                               f"of length {n} at byte {pos - 4})")
        tokens.append(data[pos : pos + n].decode("utf-8", errors="replace"))
        scores.append(score)
        pos += n
    if len(tokens) < 3:
        raise TracelmError(f"{path.name}: a llama2.c tokenizer needs at least 3 tokens, has {len(tokens)}")
    pieces, types = [], []
    for i, t in enumerate(tokens):
        if i == 0:
            pieces.append(t), types.append(UNKNOWN)
        elif i in (1, 2):
            pieces.append(t.strip()), types.append(CONTROL)
        elif _BYTE_TOKEN.fullmatch(t):
            pieces.append(t), types.append(BYTE)
        else:
            pieces.append(t.replace(" ", SPACE)), types.append(NORMAL)
    ids = {"unknown_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    return from_scored_vocab(pieces, scores, types, ids, kind="llama2c", source=path.name)


def from_sentencepiece(path: str | Path) -> Tokenizer:
    """A SentencePiece `.model` file, encoded by the `sentencepiece` library itself."""
    import sentencepiece

    path = Path(path)
    try:
        sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
    except (OSError, RuntimeError) as e:
        raise TracelmError(f"{path.name}: not a readable SentencePiece model: {e}") from None
    n = sp.vocab_size()
    pieces = [sp.id_to_piece(i) for i in range(n)]
    types = []
    for i in range(n):
        if sp.is_unknown(i):
            types.append(UNKNOWN)
        elif sp.is_control(i):
            types.append(CONTROL)
        elif sp.is_byte(i):
            types.append(BYTE)
        elif sp.is_unused(i):
            types.append(UNUSED)
        else:
            types.append(NORMAL)
    ids = {
        "bos_token_id": sp.bos_id() if sp.bos_id() >= 0 else None,
        "eos_token_id": sp.eos_id() if sp.eos_id() >= 0 else None,
        "unknown_token_id": sp.unk_id() if sp.unk_id() >= 0 else None,
    }
    specials = {p: i for i, (p, k) in enumerate(zip(pieces, types, strict=True)) if k in (CONTROL, UNKNOWN) and p}
    strip = sp.encode("a", out_type=str)[:1] in ([SPACE + "a"], [SPACE])  # the model adds a dummy prefix
    return Tokenizer(
        pieces=pieces, types=types, token_bytes=[_spm_bytes(p, k) for p, k in zip(pieces, types, strict=True)],
        encoder=SentencePieceEncoder(sp, specials), special_ids=ids, add_bos=True,
        strip_first_space=strip, kind="sentencepiece", source=path.name,
    )  # fmt: skip


def from_hf_json(path: str | Path) -> Tokenizer:
    """A Hugging Face `tokenizer.json`, with `tokenizer_config.json` beside it when there is one."""
    path = Path(path)
    try:
        hf = HFTokenizer.from_file(str(path))
    except Exception as e:  # tokenizers rejects it (or cannot read it)
        if not path.is_file():
            raise TracelmError(f"{path}: no such file") from None
        raise TracelmError(f"{path.name}: not a valid tokenizer.json: {str(e).splitlines()[0]}") from None
    config: dict[str, Any] = {}
    cfg_path = path.with_name("tokenizer_config.json")
    if cfg_path.is_file():
        try:
            config = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise TracelmError(f"{cfg_path.name}: not valid JSON: {e}") from None
    vocab = hf.get_vocab(with_added_tokens=True)
    n = max(vocab.values(), default=-1) + 1
    if n > MAX_ID_SPREAD * len(vocab) + MAX_ID_GAP:  # the tables below are n long: ids are nearly dense in a real one
        top = max(vocab, key=vocab.__getitem__)
        raise ModelFormatError(f"{path.name}: token {top[:40]!r} has id {n - 1}, far past the {len(vocab)} tokens "
                               f"the file holds (ids up to {MAX_ID_SPREAD * len(vocab) + MAX_ID_GAP - 1} are read)")
    pieces = [""] * n
    for piece, i in vocab.items():
        pieces[i] = piece
    types = [NORMAL] * n
    unk = getattr(hf.model, "unk_token", None)
    if unk in vocab:
        types[vocab[unk]] = UNKNOWN
    if getattr(hf.model, "byte_fallback", False):
        for i, p in enumerate(pieces):
            if _BYTE_TOKEN.fullmatch(p):
                types[i] = BYTE
    for i, added in hf.get_added_tokens_decoder().items():
        types[i] = CONTROL if added.special else USER_DEFINED
    decoder = repr(hf.decoder)  # e.g. ByteLevel(...), Sequence(decoders=[Replace(...), ByteFallback(), ...])
    if decoder.startswith("ByteLevel"):
        token_bytes = [_byte_level_bytes(p, k) for p, k in zip(pieces, types, strict=True)]
        strip = False
    elif SPACE in decoder:  # SentencePiece style: U+2581 is a space, <0xHH> a byte
        token_bytes = [_spm_bytes(p, k) for p, k in zip(pieces, types, strict=True)]
        strip = "Strip(" in decoder or "prepend_scheme=always" in decoder or "prepend_scheme=first" in decoder
    else:
        raise TracelmError(f"{path.name}: decoder {decoder.split('(')[0]!r} is not supported "
                           "(byte-level or SentencePiece-style only)")

    def token_id(key: str) -> int | None:
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        return hf.token_to_id(value) if isinstance(value, str) else None

    ids = {"bos_token_id": token_id("bos_token"), "eos_token_id": token_id("eos_token"),
           "unknown_token_id": token_id("unk_token")}
    add_bos = config.get("add_bos_token")
    if add_bos is None:  # the post-processor decides: does it put BOS in front?
        with_special = hf.encode("a", add_special_tokens=True).ids
        add_bos = ids["bos_token_id"] is not None and with_special[:1] == [ids["bos_token_id"]]
    template = hf_chat_template(path.parent, config)
    return Tokenizer(
        pieces=pieces, types=types, token_bytes=token_bytes, encoder=HFEncoder(hf), special_ids=ids,
        add_bos=add_bos, add_eos=bool(config.get("add_eos_token", False)), strip_first_space=strip,
        kind="tokenizer.json", source=path.name,
        chat_template=template,
    )  # fmt: skip


def hf_chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    """A Hugging Face folder's chat template, as transformers picks it: `chat_template.jinja` when the folder has
    one, else `tokenizer_config.json`'s `chat_template` (its "default" one when it names several); None without."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        try:
            template = jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TracelmError(f"{jinja}: cannot read the chat template: {e}") from None
    else:
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if template is not None and not isinstance(template, str):
            raise TracelmError(f"{folder / 'tokenizer_config.json'}: chat_template must be a string (or a list of "
                               f"named templates), got {type(template).__name__}")
    return template if isinstance(template, str) and template.strip() else None


def _tokenizer_config(folder: Path) -> dict[str, Any]:
    p = folder / "tokenizer_config.json"
    if not p.is_file():
        return {}
    try:
        return checks.json_object(p.read_text(encoding="utf-8"), str(p))
    except (OSError, UnicodeDecodeError) as e:
        raise TracelmError(f"{p}: cannot read: {getattr(e, 'strerror', None) or e}") from None


_HF_CONTRACTIONS = "(?i:'s|'t|'re|'ve|'m|'ll|'d)"  # how tokenizer.json spells _CONTRACTIONS


def _hf_splits(step: Any, where: str) -> list[str]:
    """The regexes a tokenizer.json pre_tokenizer splits by, in order, as PreTokenizer.splits spells them."""
    if not isinstance(step, dict):
        return []
    kind = step.get("type")
    if kind == "Sequence":
        return [r for s in step.get("pretokenizers") or [] for r in _hf_splits(s, where)]
    if kind == "Split":
        pattern = step.get("pattern") or {}
        regex = pattern.get("Regex", pattern.get("String"))
        return [str(regex).replace(_HF_CONTRACTIONS, _CONTRACTIONS)]
    if kind == "Digits":
        return [r"\p{N}"] if step.get("individual_digits") else [r"\p{N}+"]
    if kind == "ByteLevel":
        return [_GPT2] if step.get("use_regex", True) else []
    raise TracelmError(f"{where}: pre_tokenizer {kind!r} has no GGUF name (byte-level BPE: Split, Digits, ByteLevel)")


def _pre_name(spec: dict[str, Any], where: str) -> str:
    """The `tokenizer.ggml.pre` whose rules (PRE_TOKENIZERS) split text as this tokenizer.json does."""
    splits = tuple(_hf_splits(spec.get("pre_tokenizer"), where))
    ignore = bool((spec.get("model") or {}).get("ignore_merges", False))
    for name, rule in PRE_TOKENIZERS.items():
        if rule.splits == splits and rule.ignore_merges == ignore:
            return name
    raise TracelmError(f"{where}: its pre-tokenizer (splits {list(splits)}) matches none that GGUF names "
                       f"(known: {', '.join(PRE_TOKENIZERS)}); a GGUF cannot carry this vocabulary")


def gguf_vocab_metadata(folder: str | Path, n_vocab: int = 0) -> dict[str, Any]:
    """The `tokenizer.*` GGUF metadata of a Hugging Face folder's tokenizer, read back by `from_gguf_metadata` to
    the same tokenizer: a byte-level BPE tokenizer.json as GGUF `gpt2` (tokens, types, merges, the pre-tokenizer's
    name), a SentencePiece tokenizer.model as GGUF `llama` (pieces, scores, types, space prefix); with the special
    ids, flags and chat template (tokenizer_config.json, chat_template.jinja), padded with unused `[PADi]` tokens to
    `n_vocab` (the model's embedding rows, which llama.cpp expects the vocabulary to match)."""
    folder = Path(folder)
    path, spm = folder / "tokenizer.json", folder / "tokenizer.model"
    spec: dict[str, Any] = {}
    if path.is_file():
        try:
            spec = checks.json_object(path.read_text(encoding="utf-8"), str(path))
        except OSError as e:
            raise TracelmError(f"{path}: cannot read: {e.strerror}") from None
    model = spec.get("model") if isinstance(spec.get("model"), dict) else {}
    if spec and model.get("type") == "BPE" and (spec.get("decoder") or {}).get("type") == "ByteLevel":
        meta = _byte_level_metadata(path, spec, model)
    elif spm.is_file():
        meta = _sentencepiece_metadata(spm, spec)
    elif spec:
        raise TracelmError(f"{path}: only byte-level BPE tokenizer.json vocabularies (or a SentencePiece "
                           f"tokenizer.model) are written to GGUF (this one: model {model.get('type')!r}, decoder "
                           f"{(spec.get('decoder') or {}).get('type')!r}, no tokenizer.model beside it)")
    else:
        raise TracelmError(f"{folder}: no tokenizer.json or tokenizer.model to write into the GGUF")
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    tokens += [f"[PAD{i}]" for i in range(len(tokens), n_vocab)]
    types += [UNUSED] * (len(tokens) - len(types))
    if "tokenizer.ggml.scores" in meta:
        meta["tokenizer.ggml.scores"] += [-1000.0] * (len(tokens) - len(meta["tokenizer.ggml.scores"]))
    return meta


def _special_metadata(tok: Tokenizer) -> dict[str, Any]:
    """The special ids, BOS/EOS flags and chat template of a tokenizer as GGUF keys."""
    meta: dict[str, Any] = {"tokenizer.ggml.add_bos_token": tok.add_bos, "tokenizer.ggml.add_eos_token": tok.add_eos}
    for key, value in (("bos_token_id", tok.bos_id), ("eos_token_id", tok.eos_id), ("unknown_token_id", tok.unk_id)):
        if value is not None:
            meta[f"tokenizer.ggml.{key}"] = value
    if tok.chat_template:
        meta["tokenizer.chat_template"] = tok.chat_template
    return meta


def _byte_level_metadata(path: Path, spec: dict[str, Any], model: dict[str, Any]) -> dict[str, Any]:
    tok = from_hf_json(path)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    pieces = [tok.piece(i) for i in range(tok.n_vocab)]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": _pre_name(spec, str(path)),
            "tokenizer.ggml.tokens": [p or f"[PAD{i}]" for i, p in enumerate(pieces)],
            "tokenizer.ggml.token_type": [tok.token_type(i) if p else UNUSED for i, p in enumerate(pieces)],
            "tokenizer.ggml.merges": merges, **_special_metadata(tok)}


def _sentencepiece_metadata(path: Path, spec: dict[str, Any]) -> dict[str, Any]:
    """GGUF `llama` keys of a SentencePiece model (its scores as they are), the added tokens tokenizer.json lists
    past its pieces appended (control or user-defined, score -1000, as llama.cpp's converter does)."""
    import sentencepiece

    tok = from_sentencepiece(path)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
    tokens = [tok.piece(i) for i in range(tok.n_vocab)]
    types = [tok.token_type(i) for i in range(tok.n_vocab)]
    scores = [float(sp.get_score(i)) for i in range(tok.n_vocab)]
    added = {int(a["id"]): a for a in spec.get("added_tokens") or [] if isinstance(a, dict) and "id" in a}
    for i in range(tok.n_vocab, max(added, default=-1) + 1):
        a = added.get(i, {})
        tokens.append(str(a.get("content", f"[PAD{i}]")))
        types.append((CONTROL if a.get("special") else USER_DEFINED) if a else UNUSED)
        scores.append(-1000.0)
    config = _tokenizer_config(path.parent)
    ids = {p: i for i, p in enumerate(tokens)}
    special = {}
    for key in ("bos_token", "eos_token", "unk_token"):
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str) and value in ids:
            special[f"tokenizer.ggml.{key.replace('unk', 'unknown')}_id"] = ids[value]
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, **_special_metadata(tok), **special,
            "tokenizer.ggml.add_bos_token": bool(config.get("add_bos_token", True)),
            "tokenizer.ggml.add_eos_token": bool(config.get("add_eos_token", False)),
            "tokenizer.ggml.add_space_prefix": tok.strip_first_space}
    template = hf_chat_template(path.parent, config)
    if template:
        meta["tokenizer.chat_template"] = template
    return meta
