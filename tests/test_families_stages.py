"""The graph options' stages against plain references: GeGLU (tanh GELU), per-head q/k norm, post-norms,
embedding scale, windowed attention masks, RoPE frequency factors and per-layer RoPE bases."""

from __future__ import annotations

import math

import numpy as np

from tracelm.pipeline.graph import forward, new_cache
from tracelm.stages.attention import qk_norm, rope_tables
from tracelm.stages.embed import embed
from tracelm.stages.ffn import ffn, gelu_tanh
from tracelm.stages.norm import post_norm
from tracelm.state.cache import Cache
from tracelm.state.model_config import ModelConfig
from tracelm.state.records import Heads, Hidden

rng = np.random.default_rng(0)


def test_gelu_tanh_matches_the_formula() -> None:
    x = np.linspace(-8, 8, 101, dtype=np.float32)
    ref = [0.5 * v * (1 + math.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v**3))) for v in x.astype(float)]
    np.testing.assert_allclose(gelu_tanh(x), ref, rtol=1e-5, atol=1e-6)


def test_geglu_ffn_without_residual() -> None:
    x = rng.standard_normal((3, 8)).astype(np.float32)
    wgu, wd = rng.standard_normal((10, 8)).astype(np.float32), rng.standard_normal((8, 5)).astype(np.float32)
    out = ffn(Hidden(x, 4), wgu, wd, None, "gelu_tanh")
    g, u = x @ wgu[:5].T, x @ wgu[5:].T
    np.testing.assert_allclose(out.x, (gelu_tanh(g) * u) @ wd.T, rtol=1e-5)
    assert out.start == 4


def test_qk_norm_normalises_each_head() -> None:
    q, k = rng.standard_normal((2, 4, 6)).astype(np.float32), rng.standard_normal((2, 2, 6)).astype(np.float32)
    wq, wk = rng.standard_normal(6).astype(np.float32), rng.standard_normal(6).astype(np.float32)
    out = qk_norm(Heads(q, k, k, 0), wq, wk, 1e-6)
    for a, w, got in ((q, wq, out.q), (k, wk, out.k)):
        ref = a / np.sqrt((a**2).mean(-1, keepdims=True) + 1e-6) * w
        np.testing.assert_allclose(got, ref, rtol=1e-5)


def test_post_norm_adds_the_normed_output_to_the_residual() -> None:
    h, r = rng.standard_normal((2, 8)).astype(np.float32), rng.standard_normal((2, 8)).astype(np.float32)
    w = rng.standard_normal(8).astype(np.float32)
    ref = r + h / np.sqrt((h**2).mean(-1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(post_norm(Hidden(h, 0), w, 1e-6, Hidden(r, 0)).x, ref, rtol=1e-5)


def test_embed_scale() -> None:
    table = rng.standard_normal((5, 4)).astype(np.float32)
    before = table.copy()
    np.testing.assert_allclose(embed(table, np.array([3, 1]), 0, 2.5).x, before[[3, 1]] * 2.5)
    np.testing.assert_array_equal(table, before)  # the table itself is untouched
    np.testing.assert_array_equal(embed(table, np.array([3]), 0).x, table[[3]])


def _cfg(**kw) -> ModelConfig:
    base = dict(arch="t", n_vocab=16, n_embd=8, n_layer=4, n_head=2, n_head_kv=1, head_dim=4, n_ff=8,
                rope_base=1e4, rope_dim=4, rope_mode="neox", rms_eps=1e-6, n_ctx_train=64, tied_head=True)
    return ModelConfig(**{**base, **kw})


def test_window_mask_against_brute_force() -> None:
    cache = Cache(_cfg(), 64, *rope_tables(64, 4, 1e4, "neox"))
    for start, T, window in ((0, 10, 4), (7, 5, 3), (20, 1, 4), (3, 6, 100)):
        lo, mask = cache.window_mask(start, T, window)
        for t in range(T):
            q = start + t
            for k in range(start + T):
                visible = k <= q and q - k < window
                if k < lo:
                    assert not visible
                elif mask is not None:
                    assert (mask[t, k - lo] == 0) == visible, (start, T, window, t, k)
                else:
                    assert visible


def test_layer_windows_and_rope_bases() -> None:
    cfg = _cfg(sliding_window=8, swa_pattern=2, rope_base_swa=100.0)
    assert [cfg.window(i) for i in range(4)] == [8, 0, 8, 0]
    assert [cfg.layer_rope_base(i) for i in range(4)] == [100.0, 1e4, 100.0, 1e4]
    cache = new_cache(cfg, 32)
    cos_local, _ = cache.rope_rows(5, 1, 100.0)
    cos_global, _ = cache.rope_rows(5, 1, 1e4)
    np.testing.assert_allclose(cos_local[0, 1], math.cos(5 * 100.0 ** (-2 / 4)), rtol=1e-6)
    np.testing.assert_allclose(cos_global[0, 1], math.cos(5 * 1e4 ** (-2 / 4)), rtol=1e-6)
    assert _cfg(sliding_window=8).window(3) == 8  # no pattern: every layer windowed (mistral)


def test_rope_freq_factors_divide_the_frequencies() -> None:
    cos, sin = rope_tables(10, 4, 1e4, "adjacent", (1.0, 8.0))
    np.testing.assert_allclose(cos[7, 2], math.cos(7 * 1e4 ** (-2 / 4) / 8.0), rtol=1e-6)
    np.testing.assert_allclose(sin[7, 0], math.sin(7.0), rtol=1e-6)


def test_windowed_decode_equals_windowed_prefill(tiny_gguf) -> None:
    """A model with a window of 5 gives the same logits decoding one position at a time as in one batch."""
    import attrs

    from tracelm.io.loader import load_model

    m = load_model(str(tiny_gguf), progress=False)
    cfg = attrs.evolve(m.cfg, sliding_window=5)
    ids = list(rng.integers(0, 200, 12))
    batch = forward(cfg, m.weights, new_cache(cfg, 16), ids, all_logits=True).values
    cache = new_cache(cfg, 16)
    steps = np.concatenate([forward(cfg, m.weights, cache, [i]).values for i in ids])
    np.testing.assert_allclose(steps, batch, rtol=1e-4, atol=1e-4)
    full = forward(m.cfg, m.weights, new_cache(m.cfg, 16), ids, all_logits=True).values
    np.testing.assert_allclose(full[:5], batch[:5], rtol=1e-4, atol=1e-4)  # inside the window: no change
    assert np.abs(full[-1] - batch[-1]).max() > 1e-3  # past it: the window matters
