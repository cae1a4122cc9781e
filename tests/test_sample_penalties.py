"""Frequency and presence penalties (OpenAI's rule, over the repetition window) and top log-probabilities,
against plain references written with Python loops."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tracelm import TracelmError
from tracelm.io.run_config import load_run_config
from tracelm.stages.sample import distribution, sample, top_logprobs
from tracelm.state.records import SamplingParams

OFF = dict(top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0)


def params(**kw) -> SamplingParams:
    return SamplingParams(**{**OFF, "temperature": 1.0, **kw})


def penalised_reference(logits, p: SamplingParams, recent) -> list[float]:
    """Repetition penalty, then logit -= f * count + p * (count > 0), over the last repeat_last_n ids."""
    out = [float(v) for v in logits]
    window = list(recent)[-p.repeat_last_n :] if p.repeat_last_n else []
    if p.repeat_penalty != 1.0:
        for t in set(window):
            out[t] = out[t] / p.repeat_penalty if out[t] > 0 else out[t] * p.repeat_penalty
    for t in set(window):
        count = window.count(t)
        out[t] -= p.frequency_penalty * count + p.presence_penalty * (1 if count > 0 else 0)
    return out


def softmax_reference(x: list[float]) -> dict[int, float]:
    m = max(x)
    z = sum(math.exp(v - m) for v in x)
    return {i: math.exp(v - m) / z for i, v in enumerate(x)}


def logits_of(n: int, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * 2.0).astype(np.float32)


@pytest.mark.parametrize("freq,pres,rep,last_n", [(0.5, 0.0, 1.0, 64), (0.0, 1.5, 1.0, 64), (0.7, -0.3, 1.3, 64),
                                                   (-1.0, 0.4, 1.0, 5), (2.0, 2.0, 1.1, 3)])
def test_distribution_matches_reference(freq, pres, rep, last_n):
    rng = np.random.default_rng(1)
    for seed in range(5):
        logits = logits_of(40, seed)
        recent = rng.integers(0, 40, size=30)
        p = params(frequency_penalty=freq, presence_penalty=pres, repeat_penalty=rep, repeat_last_n=last_n)
        ids, probs = distribution(logits, p, recent)
        ref = softmax_reference(penalised_reference(logits, p, recent))
        assert sorted(ids.tolist()) == sorted(i for i, q in ref.items() if q > 0)
        np.testing.assert_allclose(probs, [ref[i] for i in ids.tolist()], rtol=2e-5, atol=1e-9)


def test_frequency_penalty_counts_repeats():
    logits = np.zeros(4, np.float32)
    p = params(temperature=0.0, frequency_penalty=1.0)
    # token 0 seen three times, token 1 once: 0 drops by 3, 1 by 1; token 2 (unseen) becomes the argmax
    logits[:3] = [2.5, 0.5, 0.0]
    assert sample(logits, p, np.random.default_rng(0), np.array([0, 0, 1, 0])).token == 2
    assert sample(logits, params(temperature=0.0), np.random.default_rng(0), np.array([0, 0, 1, 0])).token == 0


def test_presence_penalty_ignores_counts():
    logits = np.array([3.0, 2.9, 0.0], np.float32)
    p = params(presence_penalty=1.0)
    ids, probs = distribution(logits, p, np.array([0, 0, 0, 0, 1]))
    ref = softmax_reference([2.0, 1.9, 0.0])  # once each, whatever the count
    np.testing.assert_allclose(probs, [ref[i] for i in ids.tolist()], rtol=1e-6)


def test_window_and_off_values_leave_logits_alone():
    logits = logits_of(30, 3)
    recent = np.array([1, 2, 3, 1])
    base = distribution(logits, params(), recent)[1]
    for p in (params(frequency_penalty=0.0, presence_penalty=0.0), params(frequency_penalty=1.0, repeat_last_n=0)):
        np.testing.assert_array_equal(distribution(logits, p, recent)[1], base)
    # only the last repeat_last_n ids count: a window of 1 penalises token 1 alone
    ids, probs = distribution(logits, params(presence_penalty=1.0, repeat_last_n=1), recent)
    ref = list(map(float, logits))
    ref[1] -= 1.0
    np.testing.assert_allclose(probs, list(softmax_reference(ref).values()), rtol=2e-5)


def test_penalties_leave_the_input_alone_and_check_ids():
    logits = logits_of(10, 4)
    before = logits.copy()
    distribution(logits, params(frequency_penalty=1.0), np.array([1, 1, 2]))
    np.testing.assert_array_equal(logits, before)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        distribution(logits, params(frequency_penalty=1.0), np.array([1, 10]))
    with pytest.raises(ValueError, match="1-D integer"):
        distribution(logits, params(presence_penalty=1.0), np.array([1.0, 2.0]))


def test_range_is_checked():
    for bad in (-2.5, 2.01):
        with pytest.raises(ValueError):
            SamplingParams(frequency_penalty=bad)
        with pytest.raises(ValueError):
            SamplingParams(presence_penalty=bad)
    cfg = load_run_config(None, ["sampling.frequency_penalty=0.5", "sampling.presence_penalty=-1"])
    assert (cfg.sampling.frequency_penalty, cfg.sampling.presence_penalty) == (0.5, -1.0)
    with pytest.raises(TracelmError, match="sampling.presence_penalty"):
        load_run_config(None, ["sampling.presence_penalty=3"])


def test_top_logprobs_match_log_softmax():
    for seed in range(5):
        logits = logits_of(50, seed)
        ref = softmax_reference([float(v) for v in logits])
        order = sorted(ref, key=lambda i: (-ref[i], i))
        lp, ids, lps = top_logprobs(logits, 7, 5)
        assert lp == pytest.approx(math.log(ref[7]), abs=1e-6)  # float32 exps (kernels.exp_sum)
        assert ids.tolist() == order[:5]
        np.testing.assert_allclose(lps, [math.log(ref[i]) for i in order[:5]], atol=1e-6)
    assert top_logprobs(logits_of(8, 0), 0, 0)[1].size == 0
    ties = np.array([1.0, 3.0, 3.0, 3.0, 0.0], np.float32)
    assert top_logprobs(ties, 0, 2)[1].tolist() == [1, 2]
    assert top_logprobs(ties, 0, 10)[1].tolist() == [1, 2, 3, 0, 4]
