"""The sampling stage against a plain reference that applies the rules literally, one by one."""

from __future__ import annotations

import math
import re
import warnings

import numpy as np
import pytest

from tracelm.stages.sample import distribution, sample
from tracelm.state.records import SamplingParams

OFF = dict(top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0)


def params(**kw) -> SamplingParams:
    return SamplingParams(**{**OFF, "temperature": 1.0, **kw})


def reference(logits, p: SamplingParams, recent=()) -> dict[int, float]:
    """The final distribution {id: prob}, written as plainly as possible (Python loops, full sorts)."""
    logits = [float(v) for v in logits]
    if p.repeat_penalty != 1.0 and p.repeat_last_n > 0:
        for t in set(list(recent)[-p.repeat_last_n :]):
            logits[t] = logits[t] / p.repeat_penalty if logits[t] > 0 else logits[t] * p.repeat_penalty
    if p.temperature == 0:
        return {max(range(len(logits)), key=lambda i: (logits[i], -i)): 1.0}
    x = [v / p.temperature for v in logits]
    order = sorted(range(len(x)), key=lambda i: (-x[i], i))  # descending, ties: lower id first
    if p.top_k:
        order = order[: p.top_k]
    m = max(x[i] for i in order)
    z = sum(math.exp(x[i] - m) for i in order)
    prob = {i: math.exp(x[i] - m) / z for i in order}
    if p.top_p < 1.0:
        kept, cum = [], 0.0
        for i in order:
            kept.append(i)
            cum += prob[i]
            if cum >= p.top_p:
                break
        z = sum(prob[i] for i in kept)
        prob = {i: prob[i] / z for i in kept}
    if p.min_p > 0.0:
        pmax = max(prob.values())
        kept = [i for i in prob if prob[i] >= p.min_p * pmax]
        z = sum(prob[i] for i in kept)
        prob = {i: prob[i] / z for i in kept}
    return {i: q for i, q in prob.items() if q > 0.0}


class CountingRng:
    """Stands in for np.random.Generator: returns the given u values and counts the calls."""

    def __init__(self, *us: float):
        self.us, self.calls = list(us), 0

    def random(self) -> float:
        self.calls += 1
        return self.us.pop(0)


def logits_of(n: int, seed: int, scale: float = 2.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)


NONE = np.zeros(0, np.int64)


# --- greedy -------------------------------------------------------------------------------------


def test_greedy_is_argmax_with_softmax_prob():
    for seed in range(20):
        logits = logits_of(500, seed)
        c = sample(logits, params(temperature=0.0), np.random.default_rng(0), NONE)
        assert c.token == int(np.argmax(logits))
        soft = np.exp(logits.astype(np.float64) - logits.max())
        assert c.prob == pytest.approx(soft[c.token] / soft.sum(), rel=1e-6)


def test_greedy_ties_pick_lowest_id_and_ignore_filters():
    logits = np.array([0.0, 3.0, 1.0, 3.0, 3.0], np.float32)
    c = sample(logits, params(temperature=0.0, top_k=1, top_p=0.1, min_p=0.9), np.random.default_rng(0), NONE)
    assert c.token == 1
    assert c.prob == pytest.approx(math.exp(3) / (1 + 3 * math.exp(3) + math.e), rel=1e-6)


# --- the RNG stream -----------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(temperature=0.8, top_k=40), dict(top_k=1)])
def test_one_rng_draw_per_call(kw):
    rng = CountingRng(0.3)
    sample(logits_of(100, 1), params(**kw), rng, NONE)
    assert rng.calls == 1
    gen, twin = np.random.default_rng(7), np.random.default_rng(7)
    for _ in range(5):
        sample(logits_of(100, 1), params(**kw), gen, NONE)
        twin.random()
    assert gen.random() == twin.random()  # the stream advanced exactly one draw per token


def test_same_seed_same_tokens_different_seed_differs():
    logits = logits_of(1000, 3, scale=1.0)
    p = SamplingParams(temperature=1.0, top_k=100, top_p=0.95, min_p=0.01)

    def run(seed):
        rng = np.random.default_rng(seed)
        return [sample(logits, p, rng, NONE).token for _ in range(100)]

    a = run(42)
    assert a == run(42)
    assert a != run(43)
    assert len(set(a)) > 10  # the distribution is wide enough that the comparison means something


def test_inverse_cdf_walks_kept_ids_in_ascending_order():
    logits = np.log(np.array([0.1, 0.2, 0.3, 0.4], np.float32))  # cdf 0.1, 0.3, 0.6, 1.0
    for u, want in [(0.0, 0), (0.0999, 0), (0.1001, 1), (0.2999, 1), (0.3001, 2), (0.5999, 2), (0.6001, 3),
                    (0.999999, 3)]:
        c = sample(logits, params(), CountingRng(u), NONE)
        assert c.token == want, u
        assert c.prob == pytest.approx([0.1, 0.2, 0.3, 0.4][want], rel=1e-6)
    # exactly on a boundary: the first token whose cumulative probability EXCEEDS u
    assert sample(np.zeros(4, np.float32), params(), CountingRng(0.5), NONE).token == 2
    assert sample(np.zeros(4, np.float32), params(), CountingRng(0.25), NONE).token == 1


# --- temperature --------------------------------------------------------------------------------


def chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_temperature_matches_softmax_empirically():
    logits = np.array([1.0, 0.5, 0.0, -0.5, 2.0, 1.5, -1.0, 0.25], np.float32)
    t, n = 0.7, 20000
    rng = np.random.default_rng(1234)
    counts = np.bincount([sample(logits, params(temperature=t), rng, NONE).token for _ in range(n)],
                         minlength=logits.size)
    want = np.exp(logits / t) / np.exp(logits / t).sum()
    wrong = np.exp(logits) / np.exp(logits).sum()  # the temperature ignored
    # 7 degrees of freedom: P(chi2 > 24.3) = 0.001 under the right distribution
    assert chi2(counts, want) < 24.3
    assert chi2(counts, wrong) > 100  # the test can tell the two apart


@pytest.mark.parametrize("t", [1e-39, 1e-45, 1e-50, 1e-300])
@pytest.mark.parametrize("kw", [dict(), dict(top_k=40), dict(top_p=0.95), dict(min_p=0.05)])
def test_a_vanishing_temperature_is_its_limit(t, kw):
    """A temperature so small that logits / T overflow (T -> 0 in float32, or 0 itself) is its limit: the largest
    logits alike, the rest nothing -- not NaN, an error or a warning."""
    logits = logits_of(3000, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ids, probs = distribution(logits, params(temperature=t, **kw), NONE)
        assert ids.tolist() == [int(np.argmax(logits))] and probs.tolist() == [1.0]
        tied = logits.copy()
        tied[17] = tied.max()
        ids, probs = distribution(tied, params(temperature=t, **kw), NONE)
        assert ids.tolist() == sorted([17, int(np.argmax(logits))]) and probs.tolist() == [0.5, 0.5]
        assert sample(tied, params(temperature=t, **kw), CountingRng(0.6), NONE).token == ids[1]
        zero = logits - logits.max()  # the largest logit 0: 0 / T is NaN where T is 0 in float32
        assert distribution(zero, params(temperature=t, **kw), NONE)[0].tolist() == [int(np.argmax(logits))]


# --- filters: exact kept sets against the reference ----------------------------------------------


CASES = [
    dict(top_k=5),
    dict(top_k=1),
    dict(top_p=0.5),
    dict(top_p=0.9, temperature=0.5),
    dict(top_p=1e-9),
    dict(min_p=0.2),
    dict(min_p=0.05, temperature=2.0),
    dict(top_k=20, top_p=0.8, min_p=0.1),
    dict(top_k=40, top_p=0.95, min_p=0.05, temperature=0.8),
    dict(top_p=0.7, min_p=0.3),
    dict(top_k=10, repeat_penalty=1.3, repeat_last_n=8),
]


@pytest.mark.parametrize("kw", CASES)
@pytest.mark.parametrize("seed", range(5))
def test_kept_set_and_probs_match_reference(kw, seed):
    logits = logits_of(200, seed)
    recent = np.random.default_rng(seed).integers(0, 200, 30)
    p = params(**kw)
    ref = reference(logits, p, recent)
    ids, probs = distribution(logits, p, recent)
    assert list(ids) == sorted(ref)
    np.testing.assert_allclose(probs, [ref[i] for i in ids], rtol=1e-5)


def test_filters_actually_filter():
    """Guards the reference test above: each case keeps a strict, non-trivial subset."""
    logits = logits_of(200, 0)
    for kw in CASES:
        n = len(reference(logits, params(**kw)))
        assert 1 <= n < 200, kw
    assert len(reference(logits, params(top_p=0.9))) > 5
    assert len(reference(logits, params(min_p=0.05, temperature=2.0))) > 5


def test_top_k_never_yields_outside_the_k_best():
    logits = logits_of(1000, 9)
    best = set(np.argsort(-logits)[:5].tolist())
    rng = np.random.default_rng(5)
    seen = {sample(logits, params(top_k=5, temperature=5.0), rng, NONE).token for _ in range(2000)}
    assert seen == best  # never outside, and (at T=5) every one of the five shows up


def test_top_k_ties_keep_lowest_ids():
    logits = np.array([1.0, 2.0, 2.0, 2.0, 2.0, 0.0], np.float32)
    ids, probs = distribution(logits, params(top_k=3), NONE)
    assert list(ids) == [1, 2, 3]
    np.testing.assert_allclose(probs, [1 / 3] * 3)


def test_top_p_ties_keep_lowest_ids():
    logits = np.zeros(10, np.float32)
    ids, _ = distribution(logits, params(top_p=0.25), NONE)  # 0.1 each: three reach 0.25
    assert list(ids) == [0, 1, 2]
    logits = np.zeros(100, np.float32)  # a tie group large enough that an unstable sort would shuffle it
    logits[::2] = 1.0
    ids, _ = distribution(logits, params(top_p=0.3), NONE)
    assert list(ids) == list(range(0, 50, 2))[: len(ids)] and len(ids) > 10


def test_top_p_reaching_exactly_top_p_stops_there():
    ids, _ = distribution(np.zeros(4, np.float32), params(top_p=0.5), NONE)  # 0.25 + 0.25 == 0.5 exactly
    assert list(ids) == [0, 1]


def test_top_p_always_keeps_one():
    logits = np.array([0.0, 5.0, 1.0], np.float32)
    ids, probs = distribution(logits, params(top_p=1e-12), NONE)
    assert list(ids) == [1] and probs[0] == 1.0


@pytest.mark.parametrize("scale", [4.0, 0.3])  # peaked: the 1024-head shortcut; flat: the full sort
def test_top_p_large_vocab_matches_reference(scale):
    logits = logits_of(5000, 11, scale=scale)
    for kw in (dict(top_p=0.9), dict(top_p=0.9, min_p=0.01)):
        p = params(**kw)
        ref = reference(logits, p)
        ids, probs = distribution(logits, p, NONE)
        assert list(ids) == sorted(ref)
        np.testing.assert_allclose(probs, [ref[i] for i in ids], rtol=1e-5)
    n = len(reference(logits, params(top_p=0.9)))
    assert (n < 1024) == (scale == 4.0)  # each case takes the path it is named for


@pytest.mark.parametrize("kw", CASES + [dict(temperature=0.6)])
def test_chosen_prob_is_reference_renormalised_prob(kw):
    logits = logits_of(200, 21)
    recent = np.arange(0, 200, 7)
    p = params(**kw)
    ref = reference(logits, p, recent)
    rng = np.random.default_rng(99)
    for _ in range(200):
        c = sample(logits, p, rng, recent)
        assert c.token in ref
        assert c.prob == pytest.approx(ref[c.token], rel=1e-5)


def test_masked_tokens_are_never_chosen():
    logits = np.full(50, -np.inf, np.float32)
    logits[[3, 17, 40]] = [0.0, 0.5, 1.0]
    rng = np.random.default_rng(0)
    seen = {sample(logits, params(), rng, NONE).token for _ in range(500)}
    assert seen == {3, 17, 40}
    assert sample(logits, params(temperature=0.0), rng, NONE).token == 40


# --- repetition penalty -------------------------------------------------------------------------


def greedy(logits, recent, **kw) -> int:
    p = SamplingParams(temperature=0.0, repeat_penalty=1.2, **kw)
    return sample(np.asarray(logits, np.float32), p, np.random.default_rng(0), np.asarray(recent)).token


def test_penalty_divides_positive_and_multiplies_negative_logits():
    assert greedy([0.0, 2.0, 1.9], []) == 1
    assert greedy([0.0, 2.0, 1.9], [1]) == 2  # 2.0 / 1.2 < 1.9
    assert greedy([-5.0, -1.0, -1.1], []) == 1
    assert greedy([-5.0, -1.0, -1.1], [1]) == 2  # -1.0 * 1.2 < -1.1 (dividing would have raised it)


def test_penalty_is_once_per_distinct_id():
    assert greedy([0.0, 2.0, 1.5], [1, 1, 1]) == 1  # 2.0 / 1.2 > 1.5; 2.0 / 1.2**3 would not be


def test_penalty_respects_the_window():
    recent = [1, 0, 0, 0]
    assert greedy([0.0, 2.0, 1.9], recent, repeat_last_n=3) == 1  # 1 is outside the last 3
    assert greedy([0.0, 2.0, 1.9], recent, repeat_last_n=4) == 2
    assert greedy([0.0, 2.0, 1.9], recent, repeat_last_n=0) == 1  # 0 = off


def test_penalty_does_not_touch_the_input():
    logits = np.array([0.0, 2.0, 1.9], np.float32)
    logits.flags.writeable = False
    greedy(logits, [1])
    assert logits.tolist() == pytest.approx([0.0, 2.0, 1.9])


# --- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "logits, words",
    [
        (np.zeros((2, 3), np.float32), "1-D"),
        (np.zeros(0, np.float32), "1-D"),
        (np.array([0.0, np.nan, 1.0], np.float32), "NaN"),
        (np.array([0.0, np.inf], np.float32), "+inf"),
        (np.full(3, -np.inf, np.float32), "-inf"),
        (np.arange(3), "floating"),
    ],
)
def test_bad_logits_raise(logits, words):
    with pytest.raises(ValueError, match=f"logits.*{re.escape(words)}"):
        sample(logits, params(), np.random.default_rng(0), NONE)


def test_recent_ids_outside_vocab_raise():
    with pytest.raises(ValueError, match="recent"):
        sample(np.zeros(5, np.float32), params(repeat_penalty=1.1), np.random.default_rng(0), np.array([5]))


_DRAWS = """
import json, sys
import numpy as np
from tracelm.stages.sample import sample
from tracelm.state.records import SamplingParams
out = []
logits = (np.random.default_rng(3).standard_normal(151936) * 3).astype(np.float32)
for kw in ({"temperature": 0.8}, {"temperature": 1.3, "top_k": 0, "top_p": 0.9, "min_p": 0.0},
           {"temperature": 0.7, "top_k": 0, "top_p": 1.0, "min_p": 0.0}, {"temperature": 0.0}):
    rng = np.random.default_rng(11)
    for _ in range(40):
        c = sample(logits, SamplingParams(**kw), rng, np.zeros(0, np.int64))
        out.append([c.token, np.float64(c.prob).view(np.uint64).item()])
json.dump(out, sys.stdout)
"""


def test_draws_do_not_depend_on_numpys_simd_level():
    """The same tokens and probability bits whatever SIMD code numpy dispatches to: a child process with every
    dispatched target disabled (numpy's baseline only; its float32 exp is another function there) draws as this one
    does. The exponentials are the kernels' own, as the model's are."""
    import json
    import os
    import subprocess
    import sys

    from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__

    on = [f for f in __cpu_dispatch__ if __cpu_features__.get(f)]  # what this CPU runs past the baseline
    env = dict(os.environ, NPY_DISABLE_CPU_FEATURES=" ".join(on))
    runs = [subprocess.run([sys.executable, "-c", _DRAWS], capture_output=True, text=True, check=True, env=e).stdout
            for e in (os.environ, env)]
    here, baseline = (json.loads(r) for r in runs)
    assert len(here) == 160 and here == baseline
