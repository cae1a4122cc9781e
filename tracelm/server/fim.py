"""Fill-in-the-middle: the prompt a code model completes between a prefix and a suffix (llama-server's POST /infill,
and `suffix` on /v1/completions as OpenAI's insert mode takes it).

The model's FIM tokens come from its GGUF metadata (`tokenizer.ggml.fim_pre_token_id`, `_suf_`, `_mid_`, and the
optional `_pad_`, `_rep_`, `_sep_`) or, where the file does not name them, from the vocabulary's spellings of the
families that have them (Qwen2.5-Coder and CodeGemma's `<|fim_prefix|>`, StarCoder's `<fim_prefix>`, Code Llama's
`<PRE>`, DeepSeek-Coder's `<｜fim▁begin｜>` ...). The prompt is prefix-suffix-middle:

    [rep] "myproject\\n"  ([sep] filename "\\n" text) per extra file  [sep] "filename\\n"   (where the tokens exist)
    [pre] prefix  [suf] suffix  [mid] prompt

Too long for the context, the prefix keeps its end and the suffix its start (the suffix at most a quarter of the
room), and extra files go first. The fill ends at an end-of-generation token or at the pad, repository or file
separator token, as llama.cpp's end-of-generation set has them (their text is a stop string).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from tracelm.server.errors import bad

# (prefix, suffix, middle) as each family spells them
_SPELLINGS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"), ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
              ("<fim-prefix>", "<fim-suffix>", "<fim-middle>"), ("▁<PRE>", "▁<SUF>", "▁<MID>"),
              ("<PRE>", "<SUF>", "<MID>"), ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"))
_PAD, _REP, _SEP = ("<|fim_pad|>", "<fim_pad>"), ("<|repo_name|>", "<reponame>"), ("<|file_sep|>", "<file_sep>")


@attrs.frozen
class FimTokens:
    pre: int
    suf: int
    mid: int
    pad: int | None = None
    rep: int | None = None  # the repository's name follows
    sep: int | None = None  # a file's name and text follow


def fim_tokens(tok: Any, metadata: dict[str, Any]) -> FimTokens | None:
    """The model's FIM tokens, or None when it has none."""
    def meta(key: str) -> int | None:
        v = metadata.get(f"tokenizer.ggml.fim_{key}_token_id")
        return int(v) if isinstance(v, int) and 0 <= v < tok.n_vocab else None

    def named(spellings: Sequence[str]) -> int | None:
        return next((i for i in map(tok.token_id, spellings) if i is not None), None)

    pre, suf, mid = meta("pre"), meta("suf"), meta("mid")
    if None in (pre, suf, mid):
        found = next((ids for ids in ([tok.token_id(s) for s in spell] for spell in _SPELLINGS) if None not in ids),
                     None)
        if found is None:
            return None
        pre, suf, mid = found
    return FimTokens(pre, suf, mid, meta("pad") or named(_PAD), meta("rep") or named(_REP), meta("sep") or named(_SEP))


def fim_stops(tok: Any, fim: FimTokens) -> tuple[str, ...]:
    """The texts of the tokens that end a fill besides end-of-generation (pad, repository, file separator)."""
    return tuple(tok.token_bytes(t).decode("utf-8", "replace") for t in (fim.pad, fim.rep, fim.sep) if t is not None)


def infill_ids(tok: Any, fim: FimTokens, prefix: str, suffix: str, room: int, prompt: str = "",
               extra: Sequence[tuple[str, str]] = ()) -> list[int]:
    """The FIM prompt's token ids (module docstring) in at most `room` tokens: the prefix cut from its start and the
    suffix from its end (the suffix at most a quarter), extra (filename, text) files only as they fit, first ones
    first. A room too small for the FIM tokens and the prompt is a ValueError."""
    def enc(text: str) -> list[int]:
        return tok.encode(text, add_bos=False, add_eos=False) if text else []

    bos = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []
    tail = [fim.mid, *enc(prompt)]
    fixed = len(bos) + 2 + len(tail)
    if fixed >= room:
        raise ValueError(f"the context leaves {room} tokens for the prompt; the fill-in-the-middle tokens and the "
                         f"prompt alone take {fixed}")
    left = room - fixed
    suffix_ids = enc(suffix)[: left // 4]
    prefix_ids = enc(prefix)
    prefix_ids = prefix_ids[max(0, len(prefix_ids) - (left - len(suffix_ids))):]
    left -= len(prefix_ids) + len(suffix_ids)
    head: list[int] = []
    if extra and fim.sep is not None:
        files = [[fim.sep, *enc(f"{name}\n"), *enc(text)] for name, text in extra]
        current = [fim.sep, *enc("filename\n")]
        repo = [fim.rep, *enc("myproject\n")] if fim.rep is not None else []
        budget = left - len(current) - len(repo)
        kept = []
        for f in files:
            if len(f) > budget:
                break
            kept.append(f)
            budget -= len(f)
        if kept:
            head = [*repo, *(t for f in kept for t in f), *current]
    return [*bos, *head, fim.pre, *prefix_ids, fim.suf, *suffix_ids, *tail]


def fill_request(model: Any, cfg: Any, max_tokens: Any, prefix: str, suffix: str, stop: Any, prompt: str = "",
                 extra: Sequence[tuple[str, str]] = (), param: str = "input_prefix") -> tuple[list[int], list[str]]:
    """A fill request's prompt ids, in the room the context (cfg.context) leaves its reply (max_tokens as the request
    gave it: a positive integer, else the server's cfg.max_tokens), and its stop strings (the request's `stop`, a
    string or a list, and fim_stops); a 400 naming `param` where the model has no FIM tokens or the context no
    room. The request's own fields are checked where the request is parsed (params.py)."""
    tok = model.tokenizer
    fim = fim_tokens(tok, model.metadata)
    if fim is None:
        raise bad("this model has no fill-in-the-middle tokens (a code model such as Qwen2.5-Coder has them)", param)
    reply = max_tokens if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens > 0 else \
        cfg.max_tokens
    try:
        ids = infill_ids(tok, fim, prefix, suffix, cfg.context - reply, prompt, extra)
    except ValueError as e:
        raise bad(str(e), param, "context_length_exceeded") from None
    if stop is not None and not isinstance(stop, str | list):
        raise bad("'stop' must be a string or an array of strings", "stop")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    return ids, [*stops, *fim_stops(tok, fim)]
