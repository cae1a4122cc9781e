"""Constrain: logits of one position -> the logits sampling may choose from.

Two things happen, in this order, before `sample` (and its penalties):

1. logit bias (OpenAI's `logit_bias`): each (token id, bias) pair adds bias to that token's logit;
2. the allowed-token mask of a grammar (a `Constraint`, computed by the grammar engine from the tokens so
   far): every token the mask forbids gets -inf, so no penalty, temperature or filter can bring it back,
   and sample's draw never lands on it (a -inf logit has probability exactly 0).

The mask comes as the grammar engine writes it: a packed bitmask, 32 tokens per int32 word, bit j of word
i for token 32 i + j (little-endian bit order), at least ceil(vocab / 32) words. Tokens past the vocabulary
are ignored. A mask that allows nothing is an error (the grammar has no way on).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

import tracelm.kernels as kernels


def allowed_tokens(mask: np.ndarray, vocab: int) -> np.ndarray:
    """The packed bitmask [words] as booleans [vocab]: True where the token is allowed."""
    return np.unpackbits(_words(mask, vocab).view(np.uint8), bitorder="little")[:vocab].view(bool)


def _words(mask: np.ndarray, vocab: int) -> np.ndarray:
    """The mask as contiguous int32 words, checked to cover `vocab` tokens."""
    words = np.ascontiguousarray(mask, dtype=np.int32)
    if words.ndim != 1 or words.size * 32 < vocab:
        raise ValueError(f"a token mask for {vocab} tokens needs {(vocab + 31) // 32} int32 words, got shape "
                         f"{list(words.shape)}")
    return words


def constrain(logits: np.ndarray, mask: np.ndarray | None = None,
              bias: Sequence[tuple[int, float]] = ()) -> np.ndarray:
    """`logits` [vocab] plus the bias of each (id, bias) pair, then -inf wherever `mask` (packed, see the module
    docstring; None = every token) forbids. A new array; `logits` is only read."""
    logits = np.asarray(logits)
    vocab = logits.shape[-1]
    out = logits.astype(logits.dtype, copy=True)
    if bias:  # a few pairs, every step of a sequence: checked in Python, added in one numpy call
        ids = [i for i, _b in bias]
        outside = [i for i in ids if not 0 <= i < vocab]
        if outside:
            raise ValueError(f"logit_bias names token id {outside[0]}, outside the vocabulary [0, {vocab})")
        out[ids] += np.array([b for _i, b in bias], out.dtype)
    if mask is not None and not _masked(out, mask):
        raise ValueError("the token mask allows no token: the grammar cannot go on")
    return out


def _masked(out: np.ndarray, mask: np.ndarray) -> int:
    """-inf in `out` wherever the packed `mask` forbids (in place); how many tokens it allows."""
    if out.ndim == 1 and out.dtype in (np.float32, np.float64):  # the kernels: one pass over the bits
        return kernels.mask_logits(out, _words(mask, out.size).view(np.uint8))
    allowed = allowed_tokens(mask, out.shape[-1])
    np.copyto(out, -np.inf, where=~allowed)
    return int(allowed.sum())
