"""Each stage against a plain reference written here, on synthetic inputs."""

from __future__ import annotations

import numpy as np
import pytest

from tracelm.stages.attention import attend, out_proj, qkv, rope, rope_tables, rotate
from tracelm.stages.embed import embed
from tracelm.stages.ffn import ffn
from tracelm.stages.head import head
from tracelm.stages.norm import rms_norm
from tracelm.state.records import Heads, Hidden

rng = np.random.default_rng(42)


def randn(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def test_embed_gathers_rows_and_freezes() -> None:
    table = randn(10, 4)
    h = embed(table, np.array([3, 3, 7]), start=5)
    assert h.start == 5
    np.testing.assert_array_equal(h.x, table[[3, 3, 7]])
    with pytest.raises(ValueError):
        h.x[0, 0] = 1.0  # records are read-only


def test_rms_norm_matches_reference() -> None:
    x, w = randn(5, 16), randn(16)
    ref = np.array([row / np.sqrt(sum(v * v for v in row) / len(row) + 1e-6) * w for row in x.astype(np.float64)])
    np.testing.assert_allclose(rms_norm(Hidden(x, 0), w, 1e-6).x, ref, rtol=1e-5, atol=1e-6)


def test_qkv_splits_the_fused_projection() -> None:
    T, d, H, Hkv, hd = 3, 32, 4, 2, 8
    x, wq, wk, wv, b = randn(T, d), randn(H * hd, d), randn(Hkv * hd, d), randn(Hkv * hd, d), randn((H + 2 * Hkv) * hd)
    out = qkv(Hidden(x, 0), np.concatenate([wq, wk, wv]), b, H, Hkv, hd)
    bq, bk, bv = np.split(b, [H * hd, (H + Hkv) * hd])
    np.testing.assert_allclose(out.q, (x @ wq.T + bq).reshape(T, H, hd), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.k, (x @ wk.T + bk).reshape(T, Hkv, hd), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.v, (x @ wv.T + bv).reshape(T, Hkv, hd), rtol=1e-5, atol=1e-5)


def rope_reference(x: np.ndarray, positions: np.ndarray, base: float, mode: str) -> np.ndarray:
    """Pairs as complex numbers multiplied by e^(i p theta_j), theta_j = base^(-2j/d)."""
    T, H, d = x.shape
    theta = base ** (-np.arange(d // 2) * 2.0 / d)
    turn = np.exp(1j * positions[:, None, None] * theta[None, None, :])
    if mode == "adjacent":
        z = (x[..., 0::2] + 1j * x[..., 1::2]) * turn
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = z.real, z.imag
        return out
    z = (x[..., : d // 2] + 1j * x[..., d // 2 :]) * turn
    return np.concatenate([z.real, z.imag], axis=-1)


@pytest.mark.parametrize("mode", ["adjacent", "neox"])
def test_rope_matches_complex_rotation(mode: str) -> None:
    T, H, d, start = 6, 3, 16, 9
    cos, sin = rope_tables(64, d, 10000.0, mode)
    x = randn(T, H, d)
    out = rotate(x, cos[start : start + T], sin[start : start + T], mode)
    np.testing.assert_allclose(out, rope_reference(x, np.arange(start, start + T), 10000.0, mode), atol=2e-5)


@pytest.mark.parametrize("mode", ["adjacent", "neox"])
def test_rope_is_identity_at_zero_and_keeps_norms(mode: str) -> None:
    cos, sin = rope_tables(512, 16, 10000.0, mode)
    x = randn(1, 4, 16)
    np.testing.assert_array_equal(rotate(x, cos[:1], sin[:1], mode), x)
    far = rotate(np.repeat(x, 3, axis=0), cos[[1, 100, 511]], sin[[1, 100, 511]], mode)
    np.testing.assert_allclose(np.linalg.norm(far, axis=-1), np.linalg.norm(np.repeat(x, 3, 0), axis=-1), rtol=1e-5)
    assert not np.allclose(far[1], x[0])


def test_rope_partial_rotary_passes_the_rest_through() -> None:
    cos, sin = rope_tables(16, 8, 10000.0, "neox")  # rotate 8 of 16 dims
    x = randn(2, 3, 16)
    out = rotate(x, cos[3:5], sin[3:5], "neox")
    np.testing.assert_array_equal(out[..., 8:], x[..., 8:])
    np.testing.assert_allclose(out[..., :8], rope_reference(x[..., :8], np.array([3, 4]), 10000.0, "neox"), atol=2e-5)


def test_rope_stage_rotates_q_and_k_not_v() -> None:
    cos, sin = rope_tables(8, 8, 10000.0, "adjacent")
    h = Heads(randn(2, 4, 8), randn(2, 2, 8), randn(2, 2, 8), 3)
    out = rope(h, cos[3:5], sin[3:5], "adjacent")
    np.testing.assert_array_equal(out.v, h.v)
    np.testing.assert_allclose(out.k, rotate(h.k, cos[3:5], sin[3:5], "adjacent"))


def attention_reference(q, keys, values, start, scale):
    """One head at a time, one query at a time, causal."""
    T, H, hd = q.shape
    n_kv = keys.shape[0]
    out = np.zeros((T, H, hd))
    for t in range(T):
        for h in range(H):
            kv = h // (H // n_kv)
            visible = start + t + 1
            s = keys[kv, :visible] @ q[t, h] * scale
            p = np.exp(s - s.max())
            out[t, h] = (p / p.sum()) @ values[kv, :visible]
    return out.reshape(T, H * hd)


@pytest.mark.parametrize("start,T", [(0, 5), (4, 3), (7, 1)])
def test_attend_grouped_causal(start: int, T: int) -> None:
    H, n_kv, hd = 6, 2, 8
    L = start + T
    q, keys, values = randn(T, H, hd), randn(n_kv, L, hd), randn(n_kv, L, hd)
    mask = None if T == 1 else np.triu(np.full((T, L), -np.inf, np.float32), k=start + 1)
    out = attend(q, keys, values, mask, 0.35, start)
    np.testing.assert_allclose(out.x, attention_reference(q, keys, values, start, 0.35), rtol=1e-4, atol=1e-5)


def test_out_proj_and_ffn_add_the_residual() -> None:
    T, d, ff = 3, 16, 24
    res, a, wo = randn(T, d), randn(T, d), randn(d, d)
    np.testing.assert_allclose(out_proj(Hidden(a, 0), wo, Hidden(res, 0)).x, res + a @ wo.T, rtol=1e-5, atol=1e-5)
    x, wg, wu, wd = randn(T, d), randn(ff, d), randn(ff, d), randn(d, ff)
    g, u = x @ wg.T, x @ wu.T
    ref = res + (g / (1 + np.exp(-g)) * u) @ wd.T
    out = ffn(Hidden(x, 0), np.concatenate([wg, wu]), wd, Hidden(res, 0))
    np.testing.assert_allclose(out.x, ref, rtol=1e-4, atol=1e-4)


def test_ffn_silu_handles_extreme_inputs_without_nan() -> None:
    import warnings

    x = np.array([[-1e4, 1e4, -100.0, -88.5]], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow warning either
        out = ffn(Hidden(x, 0), np.vstack([np.eye(4, dtype=np.float32)] * 2), np.eye(4, dtype=np.float32),
                  Hidden(np.zeros_like(x), 0))
    assert np.isfinite(out.x).all()
    # silu(x) * x for the gate and up both x: x^2 sigmoid(x); ~0 for the very negative ones, x^2 for 1e4
    np.testing.assert_allclose(out.x, [[0.0, 1e8, 0.0, 0.0]], atol=1e-30, rtol=1e-6)


def test_head_is_a_product_with_the_vocabulary_matrix() -> None:
    x, w = randn(2, 8), randn(50, 8)
    out = head(Hidden(x, 3), w)
    assert out.values.shape == (2, 50) and out.start == 3
    np.testing.assert_allclose(out.values, x @ w.T, rtol=1e-5, atol=1e-5)
