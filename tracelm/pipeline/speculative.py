"""Drafts for speculative decoding: prompt lookup (no second model) or a smaller draft model.

The draft for the next positions is what followed the most recent earlier occurrence of the context's
last n tokens (n = ngram down to 1). The runner feeds [sampled token] + draft in one batched pass, so the
weights are read once for up to 1 + k positions, then keeps the positions whose guessed token the sampler
actually chose.

Why this is lossless, also at temperature > 0: every token is still drawn by the one sampler from the
logits of its true context, with the same single RNG draw per token as plain decoding; a draft only decides
which logits were computed ahead. A guessed position is kept iff the drawn token equals the guess. For a
deterministic draft (probability 1 on the guessed token x) this is exactly the standard accept/reject rule:
accept x with probability p(x), else draw from p without x renormalised -- and plain decoding with the same
seed gives the same tokens, so a speculative run's trace replays token for token.

A draft model (same vocabulary, usually much smaller) guesses greedily instead: its tokens are again a
deterministic draft, accepted by the same rule, so the output is still exactly that of plain decoding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def lookup_draft(history: Sequence[int], k: int, ngram: int = 8) -> list[int]:
    """The tokens that followed the latest earlier match of the last n tokens of `history` (n from `ngram`
    down to 1), as many as the match earns: 2^n, at most k. A long match is a copy in progress and worth a
    long draft; a one-token match is a guess, and a batched pass costs more the more rows it has."""
    h = np.asarray(history, dtype=np.int64)
    if k <= 0 or len(h) < 2:
        return []
    for n in range(min(ngram, len(h) - 1), 0, -1):
        windows = sliding_window_view(h[:-1], n)  # windows[i] = h[i:i+n], all ending before the last token
        hits = np.flatnonzero((windows == h[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return h[start : start + min(k, 2**n)].tolist()
    return []


def model_draft(draft: Any, history: Sequence[int], k: int) -> list[int]:
    """Up to k tokens a draft model's Runner chooses greedily after `history`. Its Cache keeps whatever
    prefix it shares with the history (the accepted tokens), so each call computes only what is new."""
    if k <= 0 or len(history) + k > draft.cache.n_ctx:
        return []
    logits = draft.prefill(history)
    guesses: list[int] = []
    while True:
        guesses.append(int(np.argmax(logits.values[-1])))
        if len(guesses) == k:
            return guesses
        logits = draft.step(guesses[-1])
