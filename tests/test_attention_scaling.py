"""Attention that scales with context: prompts are attended in chunks of query rows over only the keys each
chunk can see, with the numbers of the one-product form (within rounding); up to ATTEND_ROWS rows each row is
a one-row decode step's call, bit for bit."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import tracelm.stages.attention as attention
from tracelm.pipeline.graph import forward, new_cache
from tracelm.stages.attention import attend, attend_rows
from tracelm.state.cache import Cache

rng = np.random.default_rng(7)


def _qkv(T: int, L: int, H: int = 8, n_kv: int = 2, hd: int = 16):
    q = rng.standard_normal((T, H, hd), dtype=np.float32)
    keys = rng.standard_normal((n_kv, L, hd), dtype=np.float32)
    values = rng.standard_normal((n_kv, L, hd), dtype=np.float32)
    return q, keys, values


def _mask(start: int, T: int, window: int = 0) -> tuple[int, np.ndarray]:
    lo = max(0, start - window + 1) if window else 0
    qpos = np.arange(start, start + T)[:, None]
    kpos = np.arange(lo, start + T)[None, :]
    visible = (kpos <= qpos) & ((qpos - kpos < window) if window else True)
    return lo, np.where(visible, 0, -np.inf).astype(np.float32)


@pytest.mark.parametrize("start, T, window", [(0, 300, 0), (37, 200, 0), (0, 300, 24), (50, 129, 24), (5, 17, 0)])
def test_chunked_attend_equals_one_product(monkeypatch, start, T, window) -> None:
    lo, mask = _mask(start, T, window)
    q, keys, values = _qkv(T, start + T - lo)
    expect = attend_rows(q, keys, values, mask, 0.25)
    spans = []

    def spy(q, keys, values, mask, scale):
        spans.append((q.shape[0], keys.shape[1]))
        return attend_rows(q, keys, values, mask, scale)

    monkeypatch.setattr(attention, "SCORE_BYTES", 64 << 10)  # many chunks of ATTEND_ROWS+ rows
    monkeypatch.setattr(attention, "attend_rows", spy)
    got = attend(q, keys, values, mask, 0.25, start)
    assert got.x.dtype == np.float32 and got.x.shape == expect.shape and got.start == start
    np.testing.assert_allclose(got.x, expect, rtol=1e-5, atol=2e-6)
    rows = max(attention.ATTEND_ROWS, (64 << 10) // (4 * 8 * keys.shape[1]))
    assert [n for n, _ in spans] == [min(rows, T - a) for a in range(0, T, rows)]
    # every chunk but the last reads fewer keys than all of them (causal), a windowed one far fewer
    assert all(n_keys < keys.shape[1] for _, n_keys in spans[:-1])
    if window:
        assert max(n_keys for _, n_keys in spans) <= window + max(n for n, _ in spans)


def test_no_mask_attends_every_key_in_chunks(monkeypatch) -> None:
    q, keys, values = _qkv(40, 60)
    monkeypatch.setattr(attention, "SCORE_BYTES", 16 << 10)
    np.testing.assert_allclose(attend(q, keys, values, None, 0.5, 20).x, attend_rows(q, keys, values, None, 0.5),
                               rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("T, window", [(2, 0), (8, 0), (16, 0), (16, 6), (5, 300)])
def test_few_rows_are_each_the_one_row_call_bit_for_bit(T, window) -> None:
    """A speculation pass (up to ATTEND_ROWS rows) gives each query row the numbers of a one-row decode step
    at its position -- the same call on the same keys, so on any BLAS -- and the one-product form within rounding."""
    start = 500
    lo, mask = _mask(start, T, window)
    q, keys, values = _qkv(T, start + T - lo)
    got = attend(q, keys, values, mask, 0.125, start).x
    for t in range(T):
        k0, _ = _mask(start + t, 1, window)
        alone = attend(q[t : t + 1], keys[:, k0 - lo : start + t + 1 - lo], values[:, k0 - lo : start + t + 1 - lo],
                       None, 0.125, start + t).x
        assert np.array_equal(got[t : t + 1], alone), t
    np.testing.assert_allclose(got, attend_rows(q, keys, values, mask, 0.125), rtol=1e-5, atol=2e-6)


def test_prompt_scores_stay_within_the_chunk_budget() -> None:
    """A 1,024-row prompt with 8 heads would hold 32 MB of scores at once; chunked it stays near SCORE_BYTES."""
    T = 1024
    _, mask = _mask(0, T)
    q, keys, values = _qkv(T, T, H=8, n_kv=2, hd=16)
    tracemalloc.start()
    try:
        out = attend(q, keys, values, mask, 0.25, 0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    one_product = 8 * T * T * 4
    assert peak < 3 * attention.SCORE_BYTES + 4 * out.x.nbytes, (peak, one_product)
    rows = slice(T - 8, T)
    np.testing.assert_allclose(out.x[rows], attend_rows(q[rows], keys, values, mask[rows], 0.25), rtol=1e-5,
                               atol=2e-6)


def test_long_prompt_logits_equal_stepwise_decode(tiny_gguf) -> None:
    """A 200-token prompt in one pass (chunked attention) gives the logits of decoding it one token at a time."""
    from tracelm.io.loader import load_model

    m = load_model(str(tiny_gguf), progress=False)
    ids = [int(i) for i in rng.integers(0, 250, 200)]
    batch = forward(m.cfg, m.weights, new_cache(m.cfg, 256), ids, all_logits=True).values
    cache = new_cache(m.cfg, 256)
    steps = np.concatenate([forward(m.cfg, m.weights, cache, [i]).values for i in ids])
    np.testing.assert_allclose(batch, steps, rtol=1e-4, atol=1e-4)
    assert isinstance(cache, Cache) and cache.n_past == 200


def test_context_scaling_bench_reports_each_position(tiny_gguf) -> None:
    from tracelm.tools.bench import context_scaling

    r = context_scaling(str(tiny_gguf), (10, 60), n_decode=3, n_prompt=100)
    assert r["positions"] == [10, 60] and r["prefill_tokens"] == 100 and r["prefill_tok_s"] > 0
    for p in (10, 60):
        assert r[f"decode_ms_at_{p}"] > 0 and 0 < r[f"attend_ms_at_{p}"] < r[f"decode_ms_at_{p}"]
    assert r["ratio_60_vs_10"] > 0 and r["cpu_ratio_60_vs_10"] > 0


def test_bench_positions_cli(tiny_gguf, capsys) -> None:
    import json

    from tracelm.cli import main

    assert main(["bench", "--model", str(tiny_gguf), "--positions", "20,200", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["positions"] == [20, 200] and r["prefill_tokens"] == 2048 and r["decode_tokens"] == 32
    assert main(["bench", "--model", str(tiny_gguf), "--positions", "20,20"]) == 2
    assert "--positions '20,20'" in capsys.readouterr().err
