"""The layer kernels (tracelm.kernels: rms_norm, rms_norm_add, rope, attend, silu_mul, gelu_tanh_mul) against the
numpy stages they stand for, and the promise they share with matmul: the same bits on both paths, at 1 and 2
threads, for a row alone or in a pass.

Tolerances, with u = 2^-24 (f32's unit roundoff):
- the kernels' exp: within 2 ulp of the exact e^x (measured: 1.19) on every 97th float of [-104, 89]; tanh within
  4u absolute (measured: 1.5u);
- rms_norm, against float64 on the same f32 input: |got - ref| <= ((m + 7) / 2 + 4) u |ref| with m = ceil(d / 32)
  (ss: m sequential adds per lane and 5 tree levels; /d, +eps, sqrt halves it, 1/x; two products); against numpy
  the same bound with numpy's sum taken as sequential over d (m = d) added to it;
- rope: bit for bit equal to stages/attention.py `rotate` (the same IEEE operations on every value);
- attend, against float64 on the same f32 (or f16 upcast) input and the same f32 q * scale: per output,
  B = (rho + n u) A + (rho + (n/8 + 5) u) |out|, times 1.5 for second-order terms, where n is the span, A =
  sum p |v| / sum p, and rho = max over keys of (hd + 2) u sum |qs k| + u |s - m| + 4u bounds the relative error
  of each p (the score's dot product, the subtraction and exp; an error of m is a common factor and cancels); n u
  and (n/8 + 5) u bound the sequential sums over keys of p v and of p. Against the numpy stage: 2B (numpy's own
  error is bounded alike);
- silu_mul: |got - numpy| <= 8u |numpy| (2 ulp of exp each side through 1 + e, a divide, a product);
- gelu_tanh_mul: |got - numpy| <= 8u (0.5 |g up| + |numpy|) (tanh's absolute error is kept by 1 + tanh).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from tracelm import kernels
from tracelm.kernels import _core
from tracelm.stages.attention import attend as attend_stage
from tracelm.stages.attention import rope_tables, rotate
from tracelm.stages.ffn import gelu_tanh, silu
from tracelm.stages.norm import post_norm, rms_normalize
from tracelm.state.cache import Cache
from tracelm.state.model_config import ModelConfig
from tracelm.state.records import Hidden

U = 2.0**-24
PATHS = kernels.paths()
# (name, n_embd, H, Hkv, hd, n_ff, rope mode)
MODELS = [("smollm2", 576, 9, 3, 64, 1536, "adjacent"), ("qwen2.5", 896, 14, 2, 64, 4864, "neox"),
          ("gemma3", 640, 4, 1, 256, 2048, "neox")]


pytestmark = pytest.mark.usefixtures("kernels_restored")  # each test may switch path and threads


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32)


def assert_same_bits(a: np.ndarray, b: np.ndarray, msg: str = "") -> None:
    """Equal bit for bit; NaNs only where NaNs (their payload is not promised)."""
    nan = np.isnan(a)
    np.testing.assert_array_equal(nan, np.isnan(b), err_msg=msg)
    np.testing.assert_array_equal(bits(np.where(nan, 0, a)), bits(np.where(nan, 0, b)), err_msg=msg)


def every_setting(fn, *args):
    """fn(*args) on every path at 1 and 2 threads; asserts the same bits each time, returns the first result."""
    ref = None
    for path in PATHS:
        kernels.use_path(path)
        for threads in (1, 2):
            kernels.set_threads(threads)
            got = fn(*args)
            if ref is None:
                ref = got
            assert_same_bits(got, ref, f"{path} threads={threads}")
    return ref


# ---------------------------------------------------------------------------------------------------- exp, tanh


def test_exp_within_2_ulp_on_every_path():
    x = np.arange(0, 0xC2D00001, 97, dtype=np.uint64).astype(np.uint32).view(np.float32)  # [0, 89], [-0, -104]
    x = np.concatenate([x[x <= 89], x[(x >= -104) & (x <= 0)]]).astype(np.float32)
    got = every_setting(lambda: _core.exp(x, np.empty_like(x)))
    ref = np.exp(x.astype(np.float64))
    finite = ref < np.finfo(np.float32).max
    ulp = np.spacing(ref[finite].astype(np.float32)).astype(np.float64)  # subnormals: 2^-149
    assert (np.abs(got[finite] - ref[finite]) <= 2 * ulp).all()
    assert np.isinf(got[~finite]).all()
    special = np.array([0, -0.0, 1, -1, 88.7, 89, 1e30, np.inf, -104, -1e30, -np.inf, np.nan], np.float32)
    out = every_setting(lambda: _core.exp(special, np.empty_like(special)))
    assert out[0] == out[1] == 1 and out[2] == np.float32(math.e) and np.isfinite(out[4])
    assert np.isinf(out[5:8]).all() and (out[8:11] == 0).all() and np.isnan(out[11])


@pytest.mark.parametrize("n", [1, 7, 4096, 4096 * 3 + 13, 151936])
def test_exp_sum_is_its_stated_order_on_every_path(n):
    """exp_sum = the kernels' exp of each float32 difference, summed in float64 per 4096 values in 8 running sums
    (value k into sum k mod 8) and a fixed tree, the chunks in order: the same bits on every path and thread count."""
    x = (np.random.default_rng(n).standard_normal(n) * 4).astype(np.float32)
    shift = x.max()
    got = every_setting(lambda: np.array([kernels.exp_sum(x, shift)]))[0]
    e = _core.exp(x - shift, np.empty_like(x)).astype(np.float64)
    want = 0.0
    for c in range(0, n, 4096):
        chunk = np.zeros(-(-min(4096, n - c) // 8) * 8)
        chunk[: min(4096, n - c)] = e[c : c + 4096]
        s = np.zeros(8)
        for row in chunk.reshape(-1, 8):  # running sums, in order
            s = s + row
        want += ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]))
    assert got == want
    assert got == pytest.approx(np.exp(x.astype(np.float64) - shift).sum(), rel=1e-6)


def test_exp_sum_checks_its_input():
    with pytest.raises(ValueError, match="exp_sum: x"):
        kernels.exp_sum(np.zeros(8, np.float64), 0.0)
    with pytest.raises(ValueError, match="exp_sum: x"):
        kernels.exp_sum(np.zeros((2, 8), np.float32), 0.0)


# ---------------------------------------------------------------------------------------------------- all_finite


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_all_finite_is_isfinite_all(dtype):
    """all_finite = np.isfinite(x).all(), wherever the one bad value sits (a 16-value block's first or last, the
    tail past the blocks, any chunk of a row, any row of a strided 2-D array), at 1 and 2 threads."""
    n = 16384 * 2 + 21
    base = np.random.default_rng(7).standard_normal((3, n + 5)).astype(dtype) * 1e30  # finite, large
    for threads in (1, 2):
        kernels.set_threads(threads)
        assert kernels.all_finite(base) and kernels.all_finite(base[:, :n]) and kernels.all_finite(base[1])
        assert kernels.all_finite(np.zeros((0, 4), dtype)) and kernels.all_finite(np.zeros(0, dtype))
        for bad in (np.nan, np.inf, -np.inf):
            for r in (0, 2):
                for i in (0, 15, 16, 16383, 16384, n - 21, n - 1):
                    x = base.copy()
                    x[r, i] = bad
                    assert not kernels.all_finite(x[:, :n]), (bad, r, i)
                    assert kernels.all_finite(x[1, :n])  # the other rows are still finite
                    assert not kernels.all_finite(x[r, :n])
                x = base.copy()
                x[r, n + 2] = bad  # past the columns looked at
                assert kernels.all_finite(x[:, :n])
    with pytest.raises(ValueError, match="all_finite: x must be float32 or float64"):
        kernels.all_finite(np.zeros(8, np.float16))
    with pytest.raises(ValueError, match="all_finite: x must have unit stride"):
        kernels.all_finite(base[:, ::2])


# ---------------------------------------------------------------------------------------------------- top_k


def top_k_by_definition(x: np.ndarray, k: int) -> np.ndarray:
    """The k largest values' ids, lowest ids first at ties, ascending: the sort that defines it."""
    return np.sort(np.lexsort((np.arange(x.size), -x))[:k])


def top_k_cases(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    spread = rng.standard_normal(n) * 3
    spread[rng.integers(0, n, n // 4)] = -np.inf  # a grammar's mask
    return [rng.integers(-20, 20, n).astype(np.float64),  # every value tied many times
            spread, np.sort(spread), np.sort(spread)[::-1].copy(),  # ascending: every value enters; descending
            np.full(n, 0.5), np.linspace(-1, 1, n)]


@pytest.mark.parametrize("n,k", [(1, 1), (9, 3), (151936, 40), (151936, 1024), (40000, 39999), (70000, 16385),
                                 (49152, 1), (20000, 20000)])
def test_top_k_is_its_definition_on_every_path(n, k):
    """The selection: the same ids as the definition, ties to the lowest ids, for float32 and float64, on every
    path at 1 and 2 threads (the ranges one per thread, cut and merged in id order)."""
    for x in top_k_cases(n, n + k):
        for dtype in (np.float32, np.float64):
            y = x.astype(dtype)
            want = top_k_by_definition(y, k)
            got = every_setting(lambda y=y: kernels.top_k(y, k).view(np.uint32))  # int64 ids, compared as bits
            np.testing.assert_array_equal(got.view(np.int64), want)


def test_top_k_ranges_merge_as_one():
    """Past a million values each thread scans a range of its own; the ranges' survivors merge to the same ids, ties
    across a range's border included (the ids of a tie group straddle it)."""
    n = 2_200_001
    rng = np.random.default_rng(3)
    tied = rng.integers(0, 500, n).astype(np.float32)  # ~4,400 ids per value: the k-th value's group straddles
    spread = rng.standard_normal(n).astype(np.float32)
    for x, k in ((tied, 9000), (spread, 40), (spread, 3000)):
        want = top_k_by_definition(x, k)
        for threads in (1, 2, 3):
            kernels.set_threads(threads)
            np.testing.assert_array_equal(kernels.top_k(x, k), want, err_msg=f"threads={threads} k={k}")


def test_top_k_checks_its_input():
    x = np.arange(100000, dtype=np.float32)
    x[77777] = np.nan
    with pytest.raises(ValueError, match="top_k: x holds NaN"):
        kernels.top_k(x, 5)
    x[:5] = np.nan  # among the first k, kept before any comparison
    with pytest.raises(ValueError, match="top_k: x holds NaN"):
        kernels.top_k(x, 50)
    for bad_k in (0, 100001):
        with pytest.raises(ValueError, match=r"top_k: k must be 1\.\.100000"):
            kernels.top_k(np.zeros(100000, np.float32), bad_k)
    with pytest.raises(ValueError, match="top_k: x must be float32 or float64"):
        kernels.top_k(np.zeros(8, np.float16), 2)
    with pytest.raises(ValueError, match="top_k: x must be 1-D"):
        kernels.top_k(np.zeros((2, 8), np.float32), 2)


# ---------------------------------------------------------------------------------------------------- top_p


def top_p_by_definition(e: np.ndarray, total: float, top_p: float) -> np.ndarray:
    """The shortest prefix of the full sort by descending e / total (ties: lower index first) whose np.cumsum reaches
    top_p, ascending; every index when it never does."""
    p = e.astype(np.float64) / total
    order = np.lexsort((np.arange(p.size), -p))
    n = int(np.searchsorted(np.cumsum(p[order]), top_p, side="left")) + 1
    return np.arange(p.size) if n > p.size else np.sort(order[:n])


def top_p_cases(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n)
    cases = [np.exp(x * s - (x * s).max()).astype(np.float32) for s in (0.3, 3.0, 12.0)]  # flat .. peaky
    cases += [np.exp(rng.integers(-8, 1, n)).astype(np.float32),  # every value tied many times
              np.full(n, 1.0, np.float32),
              np.where(rng.random(n) < 0.3, 0, np.exp(x - x.max())).astype(np.float32)]  # zeros among them
    return cases[:5] if n == 1 else cases  # (one value: not one that may be 0)


@pytest.mark.parametrize("n", [1, 7, 5000, 151936])
def test_top_p_is_its_definition(n):
    """The set of the full sort, for top_p across (0, 1] and at the cumulative sums' own values and their neighbours
    (where the histogram's sums, in another order, may disagree with the exact ones); the same on every path."""
    for e in top_p_cases(n, n):
        for total in (e.sum(dtype=np.float64), float(np.float32(e.sum(dtype=np.float64)))):
            p = e.astype(np.float64) / total
            cum = np.cumsum(p[np.lexsort((np.arange(n), -p))])
            at = cum[np.unique(np.linspace(0, n - 1, 6).astype(int))]
            for top_p in (1e-9, 0.1, 0.5, 0.9, 0.95, 0.999, 1.0, *at, *np.nextafter(at, 0), *np.nextafter(at, 2)):
                if not 0 < top_p <= 1:
                    continue
                want = top_p_by_definition(e, total, top_p)
                got = kernels.top_p(e, total, top_p)
                np.testing.assert_array_equal(got, want, err_msg=f"n={n} top_p={top_p!r} total={total!r}")
    e = top_p_cases(n, 1)[1]
    got = every_setting(lambda: kernels.top_p(e, e.sum(dtype=np.float64), 0.9).view(np.uint32))
    np.testing.assert_array_equal(got.view(np.int64), top_p_by_definition(e, e.sum(dtype=np.float64), 0.9))


def test_top_p_checks_its_input():
    e = np.ones(10, np.float32)
    assert kernels.top_p(np.zeros(0, np.float32), 1.0, 0.5).size == 0
    for bad, what in ((np.nan, "nan"), (-1.0, "-1"), (np.inf, "inf")):
        x = e.copy()
        x[7] = bad
        with pytest.raises(ValueError, match=f"top_p: e must be finite and >= 0, got {what} at index 7"):
            kernels.top_p(x, 10.0, 0.5)
    for top_p, total in ((0.0, 10.0), (1.5, 10.0), (np.nan, 10.0), (0.5, 0.0), (0.5, np.inf), (0.5, -1.0)):
        with pytest.raises(ValueError, match=r"top_p: top_p must be in \(0, 1\] and total finite and > 0"):
            kernels.top_p(e, total, top_p)
    with pytest.raises(ValueError, match="top_p: e must be float32"):
        kernels.top_p(e.astype(np.float64), 10.0, 0.5)


def test_tanh_absolute_error():
    x = np.random.default_rng(0).standard_normal(1 << 18).astype(np.float32) * np.float32(4)
    x = np.concatenate([x, np.float32(2.0) ** -np.arange(1, 150, dtype=np.float32)])
    got = every_setting(lambda: _core.tanh(x, np.empty_like(x)))
    assert (np.abs(got - np.tanh(x.astype(np.float64))) <= 4 * U).all()
    special = np.array([0, -0.0, 20, -20, np.inf, -np.inf, np.nan], np.float32)
    out = _core.tanh(special, np.empty_like(special))
    assert bits(out[:2]).tolist() == [0, 0x80000000] and out[2:6].tolist() == [1, -1, 1, -1] and np.isnan(out[6])


# ---------------------------------------------------------------------------------------------------- rms_norm


def rms_bound(d: int) -> float:
    return ((-(-d // 32) + 7) / 2 + 4) * U


@pytest.mark.parametrize("shape", [(7, 576), (5, 896), (3, 640), (4, 100), (6, 9, 64), (2, 4, 256)],
                         ids=lambda s: "x".join(map(str, s)))
def test_rms_norm_against_numpy(shape):
    """[T, d] hidden rows and [T, H, hd] heads (qk_norm); d = 100 has a zero-padded tail of lanes."""
    rng = np.random.default_rng(len(shape) + shape[-1])
    x = (rng.standard_normal(shape) * rng.choice([1e-3, 1.0, 50.0], size=shape[:-1] + (1,))).astype(np.float32)
    w = rng.standard_normal(shape[-1]).astype(np.float32)
    res = rng.standard_normal(shape).astype(np.float32)
    eps, d = 1e-6, shape[-1]
    got = every_setting(lambda: kernels.rms_norm(x, w, eps))
    x64 = x.astype(np.float64)
    ref64 = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + np.float32(eps)) * w
    assert (np.abs(got - ref64) <= rms_bound(d) * np.abs(ref64)).all()
    numpy = rms_normalize(x, w, eps)
    assert (np.abs(got - numpy) <= (rms_bound(d) + rms_bound(32 * d)) * np.abs(ref64)).all()
    added = every_setting(lambda: kernels.rms_norm_add(x, w, eps, res))
    assert (np.abs(added - (ref64 + res)) <= rms_bound(d) * np.abs(ref64) + U * np.abs(ref64 + res)).all()
    if len(shape) == 2:
        stage = post_norm(Hidden(x, 0), w, eps, Hidden(res, 0)).x
        both = (rms_bound(d) + rms_bound(32 * d)) * np.abs(ref64)
        assert (np.abs(added - stage) <= both + 2 * U * np.abs(stage)).all()


def test_rms_norm_in_place_and_strided():
    """q heads of a fused qkv product normalised in place (rows at the qkv row stride); out may be x itself."""
    rng = np.random.default_rng(5)
    qkv = rng.standard_normal((3, 15 * 64)).astype(np.float32)
    w = rng.standard_normal(64).astype(np.float32)
    q = qkv[:, : 9 * 64].reshape(3, 9, 64)
    expect = kernels.rms_norm(np.ascontiguousarray(q), w, 1e-5)
    rest = qkv[:, 9 * 64 :].copy()
    assert kernels.rms_norm(q, w, 1e-5, out=q) is q
    assert_same_bits(q, expect)
    assert_same_bits(qkv[:, 9 * 64 :], rest)  # nothing else written
    x = rng.standard_normal((4, 576)).astype(np.float32)
    res = rng.standard_normal((4, 576)).astype(np.float32)
    expect = kernels.rms_norm_add(x, w.repeat(9), 1e-5, res)
    kernels.rms_norm_add(x, w.repeat(9), 1e-5, res, out=res)
    assert_same_bits(res, expect)
    x[1, 7] = np.nan  # a NaN makes its row NaN (ss is NaN), and only its row
    got = every_setting(kernels.rms_norm, x, w.repeat(9), 1e-5)
    assert np.isnan(got[1]).all() and np.isfinite(np.delete(got, 1, axis=0)).all()


# ---------------------------------------------------------------------------------------------------- rope


@pytest.mark.parametrize("mode", ["adjacent", "neox"])
@pytest.mark.parametrize("H,hd,rope_dim", [(9, 64, 64), (4, 256, 256), (32, 96, 32), (3, 64, 24), (2, 8, 2)])
def test_rope_is_rotate_bit_for_bit(mode, H, hd, rope_dim):
    """Real tables at positions far apart, and random tables (any values, the pair's two entries different):
    the kernel's bits are `rotate`'s; partial rotary dims pass through; in place too."""
    rng = np.random.default_rng(hd + rope_dim)
    T, start = 6, 4000
    cos, sin = rope_tables(start + T, rope_dim, 10000.0, mode)
    tables = [(cos[start:], sin[start:]), (cos[:T], sin[:T]),
              tuple(rng.standard_normal((2, T, rope_dim)).astype(np.float32) * 3)]
    x = (rng.standard_normal((T, H, hd)) * 10).astype(np.float32)
    for c, s in tables:
        expect = rotate(x, c, s, mode)
        got = every_setting(kernels.rope, x, c, s, mode)
        assert_same_bits(got, expect)
        y = x.copy()
        kernels.rope(y, c, s, kernels.ROPE_MODES[mode], out=y)
        assert_same_bits(y, expect)


def test_rope_on_the_qkv_product_in_place():
    """q and k of a fused [T, q | k | v] product as one [T, H + Hkv, hd] view, rotated in place; v untouched."""
    rng = np.random.default_rng(7)
    H, Hkv, hd, T = 9, 3, 64, 5
    y = rng.standard_normal((T, (H + 2 * Hkv) * hd)).astype(np.float32)
    cos, sin = rope_tables(50, hd, 10000.0, "adjacent")
    qk = y[:, : (H + Hkv) * hd].reshape(T, H + Hkv, hd)
    expect, v = rotate(qk, cos[40:45], sin[40:45], "adjacent"), y[:, (H + Hkv) * hd :].copy()
    kernels.rope(qk, cos[40:45], sin[40:45], "adjacent", out=qk)
    assert_same_bits(qk, expect)
    assert_same_bits(y[:, (H + Hkv) * hd :], v)


# ---------------------------------------------------------------------------------------------------- attend


def reference(q, keys, values, spans, scale):
    """float64 attention on the kernel's inputs (q * scale in f32, f16 upcast), and the error bound B (module doc)."""
    T, H, hd = q.shape
    g = H // keys.shape[0]
    qs = (q * np.float32(scale)).astype(np.float64)
    k64, v64 = keys.astype(np.float64), values.astype(np.float64)
    out, bound = np.zeros((T, H, hd)), np.zeros((T, H, hd))
    for t, (k0, k1) in enumerate(spans):
        n = k1 - k0
        if n == 0:
            continue
        for h in range(H):
            k, v = k64[h // g, k0:k1], v64[h // g, k0:k1]
            s = k @ qs[t, h]
            m = s.max()
            p = np.exp(s - m)
            rho = ((hd + 2) * U * (np.abs(k) @ np.abs(qs[t, h])) + U * np.abs(s - m)).max() + 4 * U
            out[t, h] = p @ v / p.sum()
            a = p @ np.abs(v) / p.sum()
            bound[t, h] = 1.5 * ((rho + n * U) * a + (rho + (n / 8 + 5) * U) * np.abs(out[t, h])) + 1e-30
    return out.reshape(T, H * hd), bound.reshape(T, H * hd)


def cache_for(Hkv: int, hd: int, n_ctx: int, window: int = 0) -> Cache:
    cfg = ModelConfig(arch="llama", n_vocab=10, n_embd=Hkv * hd, n_layer=1, n_head=Hkv, n_head_kv=Hkv, head_dim=hd,
                      n_ff=8, rope_base=1e4, rope_dim=hd, rope_mode="neox", rms_eps=1e-5, n_ctx_train=n_ctx,
                      tied_head=True, sliding_window=window)
    cos, sin = rope_tables(n_ctx, hd, 1e4, "neox")
    return Cache(cfg, n_ctx, cos, sin, kv_dtype="f32")  # the tests round keys and values themselves


CASES = [  # (start, T, window): decode at L = 1, 100, 3000; speculation rows; a prompt; windowed rows in a ring
    (0, 1, 0), (99, 1, 0), (2999, 1, 0), (1200, 16, 0), (0, 40, 0), (2990, 10, 512), (700, 3, 512)]


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("model", MODELS, ids=[m[0] for m in MODELS])
def test_attend_against_numpy(model, dtype):
    """Keys and values as the Cache holds them (keys a transposed view, a window ring's views), spans from
    causal_spans, which see exactly Cache.window_mask's keys; against float64 and the numpy stage (on the f16
    values upcast to f32)."""
    _, _, H, Hkv, hd, _, _ = model
    rng = np.random.default_rng(hd + H)
    for start, T, window in CASES:
        cache = cache_for(Hkv, hd, 4096, window)
        kv = rng.standard_normal((2, start + T, Hkv, hd)).astype(dtype).astype(np.float32)
        for p0 in range(0, start + T, 64):  # written a pass at a time, as the graph does (a ring wraps)
            cache.write(0, p0, kv[0, p0 : p0 + 64], kv[1, p0 : p0 + 64])
        lo, mask = cache.window_mask(start, T, window)
        keys, values = cache.keys_values(0, start + T, lo)
        assert keys.strides[1] == 4  # positions adjacent: the Cache's transposed layout
        spans = causal_spans(start, T, lo, window)
        if mask is not None:
            assert [[int(r.argmax()), len(r) - int(r[::-1].argmax())] for r in mask == 0] == spans.tolist()
        q = rng.standard_normal((T, H, hd)).astype(np.float32) * 2
        scale = 1 / math.sqrt(hd)
        k_in, v_in = np.ascontiguousarray(keys, dtype), np.ascontiguousarray(values, dtype)  # the view: below
        got = every_setting(kernels.attend, q, k_in, v_in, spans, scale)
        if dtype == np.float32:
            assert_same_bits(kernels.attend(q, keys, values, spans, scale), got)
        ref, bound = reference(q, k_in, v_in, spans, scale)
        assert (np.abs(got - ref) <= bound).all(), f"start={start} T={T} window={window}"
        stage = attend_stage(q, keys.astype(np.float32), values.astype(np.float32), mask, scale, start).x
        assert (np.abs(got - stage) <= 2 * bound).all(), f"start={start} T={T} window={window}"


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
def test_attend_rows_alone_and_layouts(dtype):
    """A row alone (its own q row and span) gives the bits it gets in a pass of 16; keys in any layout (the
    Cache's transposed view, C-contiguous, a strided copy) give the same bits; out may be a column slice."""
    H, Hkv, hd, L = 9, 3, 64, 300
    rng = np.random.default_rng(11)
    keys = rng.standard_normal((Hkv, L, hd)).astype(dtype)
    values = rng.standard_normal((Hkv, L, hd)).astype(dtype)
    q = rng.standard_normal((16, H, hd)).astype(np.float32)
    spans = causal_spans(L - 16, 16)
    spans[3] = (5, 5)  # an empty span among them
    spans[4], spans[5] = (0, 3), (10, 19)  # shorter than a vector of keys; 8 + 1 (the last 8 scored again)
    full = every_setting(lambda: kernels.attend(q, keys, values, spans, 0.125))
    for t in range(16):
        assert_same_bits(kernels.attend(q[t : t + 1], keys, values, spans[t : t + 1], 0.125), full[t : t + 1])
    transposed = np.ascontiguousarray(keys.transpose(0, 2, 1)).transpose(0, 2, 1)
    strided = np.zeros((Hkv, 2 * L, 3 * hd), dtype)[:, ::2, ::3]
    strided[:] = keys
    for k in (transposed, strided):
        assert_same_bits(every_setting(kernels.attend, q, k, values, spans, 0.125), full)
    wide = np.full((16, H * hd + 10), 7.0, np.float32)
    kernels.attend(q, keys, values, spans, 0.125, out=wide[:, 5 : 5 + H * hd])
    assert_same_bits(wide[:, 5 : 5 + H * hd], full)
    assert (wide[:, :5] == 7).all() and (wide[:, 5 + H * hd :] == 7).all()


def test_attend_edge_cases():
    H, Hkv, hd, L = 4, 2, 16, 40
    rng = np.random.default_rng(3)
    keys = rng.standard_normal((Hkv, L, hd)).astype(np.float32)
    values = rng.standard_normal((Hkv, L, hd)).astype(np.float32)
    q = rng.standard_normal((3, H, hd)).astype(np.float32)
    spans = np.array([(0, 0), (7, 8), (0, L)], np.int64)
    run = lambda q=q, k=keys, v=values: every_setting(kernels.attend, q, k, v, spans, 0.25)  # noqa: E731
    out = run()
    assert (out[0] == 0).all()  # an empty span: zeros
    assert_same_bits(out[1].reshape(H, hd), values[[0, 0, 1, 1], 7])  # one key: p = 1, its value exactly
    big = np.zeros_like(q)
    big[:, :, 0] = 1e4
    k = keys.copy()
    k[:, :, 0] = np.linspace(-1, 1, L)  # scores 1e4 * 0.25 * k: every key but the last underflows to p = 0
    assert_same_bits(run(q=big, k=k)[2].reshape(H, hd), values[[0, 0, 1, 1], L - 1])
    assert_same_bits(run(q=-big, k=k)[2].reshape(H, hd), values[[0, 0, 1, 1], 0])
    low = np.full_like(q, -1e15)  # scores ~ -1e30 and differing: all but the largest underflow, no NaN
    assert np.isfinite(run(q=low)).all()
    nan_q = q.copy()
    nan_q[2, 1, 3] = np.nan  # a NaN score: the whole (row, head) is NaN, nothing else
    got = run(q=nan_q).reshape(3, H, hd)
    assert np.isnan(got[2, 1]).all() and np.isfinite(np.delete(got[2], 1, axis=0)).all()
    nan_v = values.copy()
    nan_v[1, 20, 5] = np.nan  # a NaN value: that dim of the heads that read it
    got = run(v=nan_v).reshape(3, H, hd)
    assert np.isnan(got[2, 2:, 5]).all() and np.isfinite(np.delete(got[2, 2:], 5, axis=1)).all()
    assert np.isfinite(got[:2]).all() and np.isfinite(got[2, :2]).all()
    inf_k, pos_q = keys.copy(), q.copy()
    inf_k[0, 9, 0], pos_q[2, :, 0] = np.inf, 1.0  # a score of +inf: inf - inf = NaN, as numpy gives
    assert np.isnan(run(q=pos_q, k=inf_k).reshape(3, H, hd)[2, :2]).all()


def kv_cache_for(kv: str, Hkv: int, hd: int, n_ctx: int, layers: int = 1) -> Cache:
    cfg = ModelConfig(arch="llama", n_vocab=10, n_embd=Hkv * hd, n_layer=layers, n_head=Hkv, n_head_kv=Hkv, head_dim=hd,
                      n_ff=8, rope_base=1e4, rope_dim=hd, rope_mode="neox", rms_eps=1e-5, n_ctx_train=n_ctx,
                      tied_head=True)
    cos, sin = rope_tables(n_ctx, hd, 1e4, "neox")
    return Cache(cfg, n_ctx, cos, sin, kv_dtype=kv)


def test_attend_parts_stores_and_attends_each_part_as_alone():
    """Several sequences in one call (a server pass): each part's own keys/values stored at the end of its views
    byte for byte as Cache.write stores them (f32, f16 rounded as numpy's astype, q8_0 blocks), and each part's
    out the bits attend gives it alone after that write -- on every path, at 1 and 2 threads; decode rows, a
    prompt's rows, an empty part list."""
    H, Hkv, hd = 9, 3, 64
    parts = [("f16", 70, 1), ("f32", 5, 1), ("q8_0", 33, 1), ("f16", 0, 12), ("f16", 300, 1), ("q8_0", 8, 5)]

    def run():
        written, alone, got, outs = [], [], [], []
        rng_ = np.random.default_rng(5)
        jobs = []
        for kv, start, T in parts:
            old = rng_.standard_normal((2, start, Hkv, hd)).astype(np.float32)
            new = (rng_.standard_normal((2, T, Hkv, hd)) * 3).astype(np.float32)
            new[0, 0, 0, :3] = [70000.0, 1e-6, -2.0**-25]  # f16: overflow to inf, a subnormal, a tie to even zero
            q = rng_.standard_normal((T, H, hd)).astype(np.float32)
            spans = causal_spans(start, T)
            a, b = kv_cache_for(kv, Hkv, hd, 512), kv_cache_for(kv, Hkv, hd, 512)
            for c in (a, b):
                if start:
                    c.write(0, 0, old[0], old[1])
            with np.errstate(over="ignore"):
                b.write(0, start, new[0], new[1])  # the Cache's own write, then attend alone
            alone.append(kernels.attend(q, *b.keys_values(0, start + T), spans, 0.125))
            written.append([np.asarray(x).copy() for x in b.keys_values(0, start + T)])
            out = np.full((T, H * hd), np.nan, np.float32)
            jobs.append((q, *a.in_place_views(0, 0, start + T), spans, out, new[0], new[1]))
            got.append(a)
            outs.append(out)
        kernels.attend_parts(jobs, 0.125)
        for (kv, start, T), a, want, out, ref in zip(parts, got, written, outs, alone, strict=True):
            for x, y in zip(a.keys_values(0, start + T), want, strict=True):
                assert np.asarray(x).tobytes() == y.tobytes(), (kv, start, T)
            assert_same_bits(out, ref, f"{kv} start={start} T={T}")
        return np.concatenate([o.ravel() for o in outs])

    every_setting(run)
    kernels.attend_parts([], 0.125)


def test_attend_layer_is_attend_parts_on_the_layers_views():
    """attend_layer (a pass's parts once, every layer's arrays, this layer's windows) stores and attends as
    attend_parts does on the views Cache.in_place_views gives: the same bytes stored, the same bits out -- f32, f16
    and q8_0 caches, a window's first position lo > 0, decode and prompt rows, on every path at 1 and 2 threads."""
    H, Hkv, hd, layer = 9, 3, 64, 1
    parts = [("f16", 70, 1, 0), ("f32", 40, 1, 17), ("q8_0", 33, 1, 5), ("f16", 0, 12, 0), ("q8_0", 8, 5, 3)]

    def run():
        rng_ = np.random.default_rng(8)
        whole, windows, views, outs, caches = [], [], [], [], []
        for kv, start, T, lo in parts:
            old = rng_.standard_normal((2, start, Hkv, hd)).astype(np.float32)
            new = (rng_.standard_normal((2, T, Hkv, hd)) * 3).astype(np.float32)
            q = rng_.standard_normal((T, H, hd)).astype(np.float32)
            end = start + T
            spans = np.stack([np.zeros(T, np.int64), np.arange(start, end) + 1 - lo], axis=1)
            a, b = kv_cache_for(kv, Hkv, hd, 512, layers=2), kv_cache_for(kv, Hkv, hd, 512, layers=2)
            for c in (a, b):
                if start:
                    c.write(layer, 0, old[0], old[1])
            out_a, out_b = (np.full((T, H * hd), np.nan, np.float32) for _ in range(2))
            whole.append((q, *a.in_place_layers(), end, out_a, new[0], new[1]))
            windows.append((lo, spans))
            views.append((q, *b.in_place_views(layer, lo, end), spans, out_b, new[0], new[1]))
            outs.append((out_a, out_b))
            caches.append((a, b, end))
        with np.errstate(over="ignore"):
            kernels.attend_layer(whole, layer, windows, 0.125)
            kernels.attend_parts(views, 0.125)
        for (a, b, end), (out_a, out_b), case in zip(caches, outs, parts, strict=True):
            for x, y in zip(a.keys_values(layer, end), b.keys_values(layer, end), strict=True):
                assert np.asarray(x).tobytes() == np.asarray(y).tobytes(), case
            assert not np.asarray(a.keys_values(0, end)[0]).any(), case  # the other layer untouched
            assert_same_bits(out_a, out_b, str(case))
        return np.concatenate([o.ravel() for o, _ in outs])

    every_setting(run)
    kernels.attend_layer([], 0, [], 0.125)


def test_attend_layer_names_what_is_wrong():
    H, Hkv, hd = 4, 2, 16
    c = kv_cache_for("f32", Hkv, hd, 16, layers=2)
    q, new = np.zeros((1, H, hd), np.float32), np.zeros((1, Hkv, hd), np.float32)
    out, spans = np.zeros((1, H * hd), np.float32), np.array([[0, 4]], np.int64)
    part = (q, *c.in_place_layers(), 4, out, new, new)
    with pytest.raises(ValueError, match=r"attend_layer: 2 windows for 1 parts"):
        kernels.attend_layer([part], 0, [(0, spans), (0, spans)], 0.5)
    with pytest.raises(ValueError, match=r"attend_layer: parts\[0\] has no keys and values of layer 2"):
        kernels.attend_layer([part], 2, [(0, spans)], 0.5)
    with pytest.raises(ValueError, match=r"attend_layer: parts\[0\] must be a tuple \(q, keys, values, end"):
        kernels.attend_layer([part[:5]], 0, [(0, spans)], 0.5)
    with pytest.raises(ValueError, match=r"attend_layer: windows\[0\] must be a tuple \(lo, spans\)"):
        kernels.attend_layer([part], 0, [spans], 0.5)
    with pytest.raises(ValueError, match=r"attend_layer: parts\[0\]: positions 0..16 are not within keys' 16"):
        kernels.attend_layer([(q, *c.in_place_layers(), 17, out, new, new)], 0, [(0, spans)], 0.5)
    with pytest.raises(ValueError, match=r"attend_layer: parts\[0\]: positions 5..3 are not within keys' 16"):
        kernels.attend_layer([part], 0, [(5, spans)], 0.5)
    with pytest.raises(ValueError, match=r"attend_layer: parts\[0\]: spans\[0\] = \(0, 4\) must satisfy"):
        kernels.attend_layer([part], 0, [(1, spans)], 0.5)  # 3 positions from lo = 1


def test_attend_parts_names_the_bad_part():
    H, Hkv, hd = 4, 2, 16
    q = np.zeros((1, H, hd), np.float32)
    keys = np.zeros((Hkv, 10, hd), np.float32)
    spans, out = np.array([[0, 10]], np.int64), np.zeros((1, H * hd), np.float32)
    good = (q, keys, keys.copy(), spans, out)
    with pytest.raises(ValueError, match=r"parts\[1\] must be a tuple \(q, keys, values, spans, out\)"):
        kernels.attend_parts([good, (q, keys)], 0.5)
    with pytest.raises(ValueError, match=r"attend_parts: parts\[1\]: k_new must have shape \[1, 2, 16\]"):
        kernels.attend_parts([good, (*good, np.zeros((1, 2, 8), np.float32), np.zeros((1, 2, 16), np.float32))], 0.5)
    frozen = keys.copy()
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match=r"parts\[0\]: keys must be a writable numpy array"):
        kernels.attend_parts([(q, frozen, keys, spans, out, q[:, :2], q[:, :2])], 0.5)
    with pytest.raises(ValueError, match=r"attend_parts: parts\[0\]: spans\[0\] = \(0, 11\)"):
        kernels.attend_parts([(q, keys, keys, np.array([[0, 11]], np.int64), out)], 0.5)


# ---------------------------------------------------------------------------------------------------- silu, gelu


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("n_ff", [1536, 4864, 2048, 13])
def test_gated_activations_against_numpy(act, n_ff):
    rng = np.random.default_rng(n_ff)
    T = 9
    g = (rng.standard_normal((T, 2 * n_ff)) * rng.choice([0.01, 1, 5, 40], size=(T, 1))).astype(np.float32)
    g[0, :12] = [0, -0.0, 1e-30, -1e-30, 88, -88, -89, 100, -100, 1e6, -1e6, 3]
    gate, up = g[:, :n_ff], g[:, n_ff:]
    fn = kernels.silu_mul if act == "silu" else kernels.gelu_tanh_mul
    got = every_setting(lambda: fn(g, n_ff))
    expect = (silu(gate) if act == "silu" else gelu_tanh(gate)) * up
    scale = np.abs(expect) if act == "silu" else 0.5 * np.abs(gate * up) + np.abs(expect)
    assert (np.abs(got - expect) <= 8 * U * scale + 1e-38).all()
    special = np.array([[np.inf, -np.inf, np.nan, 2.0, 1.0, 1.0, 1.0, np.nan]], np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        ref = (silu(special[:, :4]) if act == "silu" else gelu_tanh(special[:, :4])) * special[:, 4:]
    assert_same_bits(fn(special, 4), ref)  # inf, -inf (gelu: 0 * -inf = NaN, as numpy), NaN; a NaN up


def test_one_long_row_in_pieces_over_the_pool_gives_each_values_bits():
    """A decode step's single row of n_ff activations is spread over the pool in pieces: each value's bits are those of
    the value computed in a short row of its own (vector lanes or the scalar tail), on every path and thread count."""
    n_ff = 18949  # a 7B FFN's 18944, and a scalar tail
    g = (np.random.default_rng(7).standard_normal((1, 2 * n_ff)) * 3).astype(np.float32)
    for fn in (kernels.silu_mul, kernels.gelu_tanh_mul):
        whole = every_setting(fn, g, n_ff)
        for k, m in ((0, 7), (2040, 20), (4093, 9), (n_ff - 13, 13)):
            alone = np.concatenate([g[:, k : k + m], g[:, n_ff + k : n_ff + k + m]], axis=1)
            assert_same_bits(fn(alone, m), whole[:, k : k + m])


# ---------------------------------------------------------------------------------------------------- the promise


def test_rows_alone_equal_rows_in_a_pass():
    """Every row-wise kernel: a row alone gives the bits of its row in a pass of 64 (large enough for the pool)."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((64, 576)).astype(np.float32)
    w = rng.standard_normal(576).astype(np.float32)
    gu = rng.standard_normal((64, 2 * 1536)).astype(np.float32)
    heads = rng.standard_normal((64, 12, 64)).astype(np.float32)
    cos, sin = rope_tables(64, 64, 1e4, "adjacent")
    calls = [lambda a, b: kernels.rms_norm(x[a:b], w, 1e-5), lambda a, b: kernels.rms_norm_add(x[a:b], w, 1e-5, x[a:b]),
             lambda a, b: kernels.silu_mul(gu[a:b], 1536), lambda a, b: kernels.gelu_tanh_mul(gu[a:b], 1536),
             lambda a, b: kernels.rope(heads[a:b], cos[a:b], sin[a:b], 0),
             lambda a, b: kernels.rms_norm(heads[a:b], w[:64], 1e-5)]
    for call in calls:
        full = every_setting(call, 0, 64)
        for t in (0, 17, 63):
            assert_same_bits(call(t, t + 1), full[t : t + 1])


def causal_spans(start: int, T: int, lo: int = 0, window: int = 0) -> np.ndarray:
    """The spans of T queries at positions start.. over keys lo..start+T-1, from the visibility matrix itself
    (query p sees key k when k <= p and, with a window, p - k < window): first and one past the last seen."""
    q, k = np.arange(start, start + T)[:, None], np.arange(lo, start + T)[None, :]
    seen = (k <= q) & ((q - k < window) if window else True)
    return np.stack([seen.argmax(1), seen.shape[1] - seen[:, ::-1].argmax(1)], 1).astype(np.int64)


def test_causal_spans():
    assert causal_spans(5, 3).tolist() == [[0, 6], [0, 7], [0, 8]]
    assert causal_spans(10, 2, lo=8, window=3).tolist() == [[0, 3], [1, 4]]  # positions 8..11
    assert causal_spans(1, 2, window=4).tolist() == [[0, 2], [0, 3]]

def test_bad_arguments_name_the_argument():
    f = np.ones((2, 8), np.float32)
    w = np.ones(8, np.float32)
    q = np.ones((2, 4, 8), np.float32)
    kv = np.ones((2, 5, 8), np.float32)
    spans = np.array([[0, 5], [1, 3]], np.int64)
    out = np.empty((2, 32), np.float32)
    cs = np.ones((2, 8), np.float32)
    c = _core
    cases = [
        (lambda: c.rms_norm(f.astype(np.float64), w, 1e-5, f.copy()), "rms_norm: x must be float32"),
        (lambda: c.rms_norm(f, w[:4], 1e-5, f.copy()), r"w must have shape \[8\]"),
        (lambda: c.rms_norm(f, w, 1e-5, f[:1].copy()), "out must have the shape of x"),
        (lambda: c.rms_norm(f[:, ::2], w[:4], 1e-5, f[:, :4].copy()), "x must have unit stride"),
        (lambda: c.rms_norm(f, w, 1e-5, np.empty((2, 8), np.float32)[::-1]), "out must have its rows apart"),
        (lambda: c.rms_norm(f.ravel(), w, 1e-5, f.ravel()), "x must be 2-D or 3-D"),
        (lambda: c.rms_norm_add(f, w, 1e-5, f[:1], f.copy()), "residual must have the shape of x"),
        (lambda: c.rms_norm(f, w, 1e-5, "out"), "out must be a writable numpy array"),
        (lambda: c.rope(q, cs, cs, 2, q.copy()), "mode must be 0"),
        (lambda: c.rope(q, cs[:1], cs[:1], 0, q.copy()), r"cos and sin must be \[T, rope_dim\]"),
        (lambda: c.rope(q, cs[:, :3], cs[:, :3], 0, q.copy()), "rope_dim even"),
        (lambda: c.rope(q, cs, cs[:, :4], 0, q.copy()), "sin must have the shape of cos"),
        (lambda: c.attend(q, kv, kv.astype(np.float16), spans, 1.0, out), "values must have the dtype of keys"),
        (lambda: c.attend(q, kv.astype(np.float64), kv, spans, 1.0, out),
         r"keys must be float32, float16 or uint8 \(q8_0 blocks\)"),
        (lambda: c.attend(q, np.ones((3, 5, 8), np.float32), np.ones((3, 5, 8), np.float32), spans, 1.0, out),
         "keys must be .* dividing H = 4"),
        (lambda: c.attend(q, kv, kv[:, :4], spans, 1.0, out), "values must have the shape of keys"),
        (lambda: c.attend(q, kv, np.ones((2, 5, 16), np.float32)[:, :, ::2], spans, 1.0, out), "values must have unit"),
        (lambda: c.attend(q, kv, kv, spans.astype(np.int32), 1.0, out), "spans must be int64"),
        (lambda: c.attend(q, kv, kv, spans[:1], 1.0, out), r"spans must be C-contiguous \[2, 2\]"),
        (lambda: c.attend(q, kv, kv, np.array([[0, 6], [0, 1]], np.int64), 1.0, out), r"spans\[0\] = \(0, 6\)"),
        (lambda: c.attend(q, kv, kv, np.array([[0, 1], [3, 2]], np.int64), 1.0, out), r"spans\[1\]"),
        (lambda: c.attend(q, kv, kv, spans, 1.0, out[:, :16].copy()), r"out must have shape \[2, 32\]"),
        (lambda: c.attend(q[:, :, ::2], kv[:, :, :4], kv[:, :, :4], spans, 1.0, out[:, :16]), "q must have unit"),
        (lambda: c.silu_mul(f, 3, np.empty((2, 3), np.float32)), r"gate_up must be \[T, 2 \* n_ff\]"),
        (lambda: c.gelu_tanh_mul(f, 4, np.empty((2, 5), np.float32)), r"out must have shape \[2, 4\]"),
        (lambda: c.exp(f, f.copy()), "exp: x must be 1-D"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    with pytest.raises(TypeError):
        c.attend(q, kv, kv, spans, "scale", out)
