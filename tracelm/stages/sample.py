"""Sample: logits of one position -> the next token.

Order of application (as `SamplingParams` documents it):

1. repetition penalty (llama.cpp / CTRL rule) on the distinct ids among the last `repeat_last_n`
   entries of `recent`: a logit > 0 is divided by the penalty, a logit <= 0 is multiplied by it;
   then frequency and presence penalties (OpenAI's rule) over the same window, as llama.cpp applies
   them: logit -= frequency_penalty * count + presence_penalty * (count > 0);
2. temperature 0 -> greedy: the lowest id among the maximal penalised logits (np.argmax);
3. logits / temperature;
4. top-k (0 = off): the k largest logits; ties at the k-th value keep the lowest ids;
5. softmax over the kept tokens;
6. top-p (1.0 = off): the smallest set, in descending probability (ties: lower id first), whose
   cumulative probability reaches top_p; at least one token is kept;
7. min-p (0.0 = off): keep tokens with p >= min_p * p_max;
8. renormalise and draw.

The draw is one inverse-CDF lookup: u = rng.random() in [0, 1), and the chosen token is the first
kept token, walking the kept tokens in ascending id order, whose cumulative probability exceeds u.
Every call consumes exactly ONE `rng.random()` -- greedy calls included -- so after n tokens the
generator has advanced exactly n draws, whatever the parameters were; a run can be replayed from
(seed, token index) alone.

`Choice.prob` is the probability of the chosen token under the final renormalised distribution.
For greedy (temperature 0) that distribution would be a point mass, which says nothing, so greedy
reports instead the softmax probability of the chosen token over the penalised logits at
temperature 1 with no filters: the model's own confidence in its top token.

How it is computed (same result as the literal order above, less work):
- the temperature is applied after top-k (dividing by T > 0 keeps the order), so a top-k call
  touches the whole vocabulary only in the penalty and one selection (tracelm.kernels.top_k: one pass
  that compares and never computes, so the same ids on every CPU);
- exponentials are float32, the kernels' exp (tracelm.kernels.exp: the same bits on every CPU; numpy's
  float32 exp is another function on a CPU without AVX2, and numpy's float64 exp is ~10x slower); sums,
  normalisation and the cumulative sums are float64; greedy's softmax over the whole vocabulary is one
  pass of the kernels' exp and a float64 sum in a fixed order (tracelm.kernels.exp_sum: the same bits on
  every CPU and thread count, nothing written);
- min-p runs before top-p: its kept set is a top prefix of the probability order and its test is
  unchanged by top-p's renormalisation (p_i / p_max is), so top-p then only looks at the survivors,
  and sorts only its own prefix of them (tracelm.kernels.top_p: a histogram of the values finds where
  the prefix ends; the same set as a full sort);
- a temperature so small that logits / T overflow in float32 (or is 0 there) takes the limit T -> 0:
  the largest logits alike, the rest nothing.

`recent` is only read (and checked: 1-D integer ids inside the vocabulary) when the penalty is on.
"""

from __future__ import annotations

import math

import numpy as np

import tracelm.kernels as kernels
from tracelm.state.records import Choice, SamplingParams


def sample(
    logits: np.ndarray, params: SamplingParams, rng: np.random.Generator, recent: np.ndarray
) -> Choice:
    """Choose the next token from `logits` [vocab] (see the module docstring for the exact rules)."""
    first = _check(logits)
    u = rng.random()  # exactly one draw per call, used or not
    raw = np.asarray(logits)
    logits = _frequency_presence(_penalise(raw, params, recent), params, recent)
    if params.temperature == 0.0:
        token = first if logits is raw else int(np.argmax(logits))  # no penalty: _check's argmax is greedy's
        z = kernels.exp_sum(np.ascontiguousarray(logits, np.float32), logits[token])  # sum e^(l - l_max), one pass
        return Choice(token=token, prob=float(1.0 / z))
    ids, probs = _filtered(logits, params)
    cdf = np.cumsum(probs)
    i = min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), ids.size - 1)
    return Choice(token=int(ids[i]), prob=float(probs[i] / cdf[-1]))


def distribution(
    logits: np.ndarray, params: SamplingParams, recent: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The distribution `sample` draws from: kept token ids (ascending) and their probabilities (sum 1).

    Temperature 0 gives the point mass on the greedy token. For tracing and tests; `sample` does not
    call it (it needs no normalised copy), but both share every step.
    """
    _check(logits)
    logits = _frequency_presence(_penalise(np.asarray(logits), params, recent), params, recent)
    if params.temperature == 0.0:
        return np.array([np.argmax(logits)]), np.ones(1)
    ids, probs = _filtered(logits, params)
    return ids, probs / probs.sum()


def _check(logits: np.ndarray) -> int:
    """Refuse logits sampling cannot use; return np.argmax(logits) (the lowest id of the largest value)."""
    logits = np.asarray(logits)
    if logits.ndim != 1 or logits.size == 0:
        raise ValueError(f"logits must be a non-empty 1-D array [vocab], got shape {list(logits.shape)}")
    if not np.issubdtype(logits.dtype, np.floating):
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    first = int(np.argmax(logits))  # argmax stops at the first NaN, so logits[first] is max(): one pass, three checks
    top = logits[first]
    if np.isnan(top):
        raise ValueError("logits contain NaN")
    if top == np.inf:
        raise ValueError("logits contain +inf")
    if top == -np.inf:
        raise ValueError("logits are all -inf: no token can be chosen")
    return first


def _filtered(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """Temperature, top-k, softmax, top-p, min-p: kept ids (ascending), probabilities not renormalised."""
    ids = _top_k(logits, params.top_k)  # ascending ids, or None for the whole vocabulary
    kept = logits if ids is None else logits[ids]
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        x = kept.astype(np.float32) / np.float32(params.temperature)
    m = x.max()
    if not np.isfinite(m):  # T so small that x / T overflows (or T is 0 in float32, and 0 / 0 NaN): the
        # T -> 0 limit, the largest logits alike
        e = (kept == kept.max()).astype(np.float32)
    else:  # unnormalised probabilities, the largest exactly 1: the kernels' exp, the same bits on every CPU (numpy's
        # float32 exp is another function below AVX2, so a draw would depend on the machine)
        e = kernels.exp(np.ascontiguousarray(x - m))
    total = e.sum(dtype=np.float64)

    # min-p keeps a top prefix of the probability order (p >= threshold, ties included), and its test
    # p >= min_p * p_max is unchanged by the renormalisation after top-p, so it can run first and
    # shrink what top-p has to sort. The cumulative sums of that prefix are those of the full order.
    keep = np.flatnonzero((e >= params.min_p) & (e > 0.0))  # indices into e, ascending
    if params.top_p < 1.0:  # the shortest prefix by descending p = e / total (ties: lower id) reaching top_p
        keep = keep[kernels.top_p(e[keep], total, params.top_p)]
    return (keep if ids is None else ids[keep]), e[keep].astype(np.float64) / total


def _window(recent: np.ndarray, params: SamplingParams, vocab: int) -> np.ndarray | None:
    """The last `repeat_last_n` ids of `recent` (checked: 1-D integer ids inside the vocabulary), or None."""
    recent = np.asarray(recent)
    if params.repeat_last_n == 0 or recent.size == 0:
        return None
    if recent.ndim != 1 or not np.issubdtype(recent.dtype, np.integer):
        raise ValueError(f"recent must be a 1-D integer array of token ids, got {recent.dtype} "
                         f"shape {list(recent.shape)}")
    window = recent[-params.repeat_last_n :]
    if window.min() < 0 or window.max() >= vocab:
        raise ValueError(f"recent holds token ids outside the vocabulary [0, {vocab})")
    return window


def _penalise(logits: np.ndarray, params: SamplingParams, recent: np.ndarray) -> np.ndarray:
    """Apply the repetition penalty to the distinct ids of the recent window (a copy if anything changes)."""
    if params.repeat_penalty == 1.0:
        return logits
    window = _window(recent, params, logits.size)
    if window is None:
        return logits
    window = np.unique(window)
    out = logits.copy()
    v = out[window]
    out[window] = np.where(v > 0, v / params.repeat_penalty, v * params.repeat_penalty)
    return out


def _frequency_presence(logits: np.ndarray, params: SamplingParams, recent: np.ndarray) -> np.ndarray:
    """OpenAI's frequency and presence penalties over the counts of ids in the last `repeat_last_n` entries
    of `recent`: logit -= frequency_penalty * count + presence_penalty * (count > 0) (a copy if anything changes)."""
    if params.frequency_penalty == 0.0 and params.presence_penalty == 0.0:
        return logits
    window = _window(recent, params, logits.size)
    if window is None:
        return logits
    ids, counts = np.unique(window, return_counts=True)
    out = logits.copy()
    out[ids] -= (params.frequency_penalty * counts + params.presence_penalty).astype(out.dtype)
    return out


def top_logprobs(logits: np.ndarray, token: int, k: int) -> tuple[float, np.ndarray, np.ndarray]:
    """Log-probabilities under the model's own distribution (softmax of `logits` [vocab], temperature 1,
    no penalties or filters): that of `token`, and the k most probable ids (descending; ties: lower id
    first) with theirs. For reporting (OpenAI `logprobs`); sampling does not use it. The log-sum-exp is
    greedy's: the kernels' exp of the float32 differences from the largest logit, summed in float64 in one
    fixed order (kernels.exp_sum), so the same bits on every CPU (within ~1e-7 of float64 throughout)."""
    first = _check(logits)
    x = np.ascontiguousarray(logits, np.float32)
    m = float(x[first])
    lse = m + math.log(kernels.exp_sum(x, m))
    ids = _top_k(x, k) if 0 < k < x.size else np.arange(x.size if k else 0)
    ids = ids[np.argsort(-x[ids], kind="stable")]
    return float(x[token]) - lse, ids, x[ids].astype(np.float64) - lse


def _top_k(logits: np.ndarray, k: int) -> np.ndarray | None:
    """Ids (ascending) of the k largest logits, lowest ids winning ties at the k-th value; None = all."""
    if k == 0 or k >= logits.size:
        return None
    exact = logits.dtype in (np.float32, np.float64)  # (float16 and the like: float64 holds them exactly)
    return kernels.top_k(np.ascontiguousarray(logits, None if exact else np.float64), k)
