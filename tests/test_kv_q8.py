"""kv_cache q8_0: keys and values held as ggml's q8_0 blocks (state/cache.py q8_0_blocks), attend's scores as
integer dot products with the query rounded alike (stages/attention.py q8_0_scores, q8_0_weighted).

- storage: the bytes of each block against the rule computed value by value in plain Python (edge cases: zeros,
  tiny blocks, NaN, inf, a short last block), and a Cache's keys/values read back as written (plain and ring
  layers, a snapshot restored);
- the reference's scores against the same rule in float64 integers and f32 steps, and attend within the rounding
  of the f32 Cache's;
- the run config's choice and its error, the bytes a context costs, a saved Cache refused by another kv_cache;
- the kernels: the same bits as the reference's order (scores exact, then the kernels' softmax and sums), on
  every path, at 1 and 2 threads, in phases or not, a row alone or in a pass; the fused layers and the staged ones
  give the same logits.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest

from tests.test_attend_phases import every_way, phases_restored  # noqa: F401 -- a fixture
from tests.test_layer_kernels import CASES, assert_same_bits, causal_spans, every_setting
from tracelm import Session, kernels
from tracelm.io.run_config import load_run_config
from tracelm.kernels import _core
from tracelm.pipeline.bounds import kv_cache_bytes
from tracelm.pipeline.runner import Runner
from tracelm.stages.attention import attend as attend_stage
from tracelm.stages.attention import q8_0_scores, rope_tables
from tracelm.state.cache import Cache, kv_row_bytes, q8_0_blocks, q8_0_split, q8_0_values
from tracelm.state.errors import SessionIncompatible, TracelmError
from tracelm.state.model_config import ModelConfig


def block_by_hand(values: list[float]) -> bytes:
    """One q8_0 block of up to 32 values, the rule step by step (f32 arithmetic through struct round trips)."""
    f32 = lambda x: struct.unpack("<f", struct.pack("<f", x))[0]  # noqa: E731
    xs = [f32(x) for x in values] + [0.0] * (32 - len(values))
    amax = max(abs(x) for x in xs) if all(math.isfinite(x) for x in xs) else math.nan
    if math.isnan(amax):
        return struct.pack("<e", math.nan) + bytes(32)
    if amax < 2.0**-100:
        return bytes(34)
    d = f32(amax / 127)
    inv = f32(1 / d)
    qs = [round(f32(x * inv)) for x in xs]  # Python's round: half to even
    return struct.pack("<e", d) + struct.pack("<32b", *qs)


def test_blocks_are_the_rule_value_by_value():
    rng = np.random.default_rng(1)
    rows = [rng.standard_normal(70) * 3, np.zeros(70), np.full(70, 1e-31), rng.standard_normal(70) * 1e-6,
            rng.standard_normal(70) * 1e4, np.arange(70) - 35.0]
    rows[1][40] = 1e-31  # a tiny value in a zero block
    odd = rng.standard_normal(70)
    odd[5], odd[50] = np.nan, np.inf  # non-finite: blocks 0 and 1
    rows.append(odd)
    halves = np.linspace(-127, 127, 70) / 127 * 2.5  # values whose x * (1/d) fall near .5
    rows.append(halves)
    x = np.stack(rows).astype(np.float32)
    got = q8_0_blocks(x)
    assert got.shape == (len(rows), 3 * 34) and got.dtype == np.uint8
    for r, row in enumerate(x):
        want = b"".join(block_by_hand(row[i : i + 32].tolist()) for i in range(0, 70, 32))
        assert got[r].tobytes() == want, f"row {r}"
    d, q = q8_0_split(got)
    assert np.isnan(d[6, :2]).all() and (q[6, :2] == 0).all() and not np.isnan(d[6, 2])
    assert (q[:, 2, 6:] == 0).all()  # the short last block padded with zeros
    normal = [0, 4, 5, 7]  # scales f16 holds to 11 bits: back within half a step plus d's rounding
    back, amax = q8_0_values(got[normal], 70), np.abs(x[normal]).max(axis=1, keepdims=True)
    assert (np.abs(back - x[normal]) <= amax * (1 / 254 + 2.0**-11)).all()
    assert (q8_0_values(got[1:3], 70) == 0).all()  # tiny blocks: zeros


@pytest.mark.usefixtures("kernels_restored")
def test_kernels_make_the_same_blocks():
    """kernels.q8_0_blocks (what a pass on the kernels stores) gives q8_0_blocks' bytes, on every path and thread
    count, from rows at any stride: heads of a qkv product, edge cases, a long prompt's rows."""
    rng = np.random.default_rng(7)
    scales = rng.choice([1e-38, 1e-5, 1, 3e4], (300, 1))
    qkv = (rng.standard_normal((300, 9 * 40)) * scales).astype(np.float32)
    qkv[3, 5], qkv[4, 50], qkv[5, :32], qkv[6, 100:] = np.nan, -np.inf, 1e-31, 0.0
    for x in (qkv[:, 40:160].reshape(300, 3, 40), qkv[:, :64], qkv[:7, 3:76].reshape(7, 1, 73)):
        want = q8_0_blocks(x).tobytes()
        for path in kernels.paths():
            kernels.use_path(path)
            for threads in (1, 2):
                kernels.set_threads(threads)
                assert kernels.q8_0_blocks(x).tobytes() == want, f"{path} threads={threads} {x.shape}"
    with pytest.raises(ValueError, match="out must be C-contiguous with x's shape but a last dim of 68"):
        kernels.q8_0_blocks(qkv[:2, :64], np.empty((2, 64), np.uint8))


def cfg_for(Hkv: int, hd: int, n_ctx: int, window: int = 0, n_layer: int = 1) -> ModelConfig:
    return ModelConfig(arch="llama", n_vocab=10, n_embd=Hkv * hd, n_layer=n_layer, n_head=Hkv, n_head_kv=Hkv,
                       head_dim=hd, n_ff=8, rope_base=1e4, rope_dim=hd, rope_mode="neox", rms_eps=1e-5,
                       n_ctx_train=n_ctx, tied_head=True, sliding_window=window)


def q8_cache(Hkv: int, hd: int, n_ctx: int, window: int = 0) -> Cache:
    cos, sin = rope_tables(n_ctx, hd, 1e4, "neox")
    return Cache(cfg_for(Hkv, hd, n_ctx, window), n_ctx, cos, sin, kv_dtype="q8_0")


@pytest.mark.parametrize("window", [0, 40])
def test_cache_holds_the_blocks_it_was_given(window):
    """Written a few positions at a time (a ring wraps), read back as the blocks of what was written; a
    snapshot restored into a new Cache holds the same bytes."""
    Hkv, hd, n = 3, 64, 300
    rng = np.random.default_rng(window)
    k, v = rng.standard_normal((2, n, Hkv, hd)).astype(np.float32)
    cache = q8_cache(Hkv, hd, 512, window)
    assert bool(cache.rings[0]) == bool(window)
    for p0 in range(0, n, 7):
        cache.write(0, p0, k[p0 : p0 + 7], v[p0 : p0 + 7])
        cache.commit(range(p0, min(n, p0 + 7)))
    lo = cache.first_visible(0, n - 1)
    keys, values = cache.keys_values(0, n, lo)
    assert keys.dtype == np.uint8 and keys.shape == (Hkv, n - lo, kv_row_bytes("q8_0", hd))
    np.testing.assert_array_equal(keys, q8_0_blocks(k[lo:].transpose(1, 0, 2)))
    np.testing.assert_array_equal(values, q8_0_blocks(v[lo:].transpose(1, 0, 2)))
    again = q8_cache(Hkv, hd, 512, window)
    again.restore(cache.snapshot())
    for a, b in zip(again.keys_values(0, n, lo), (keys, values), strict=True):
        np.testing.assert_array_equal(a, b)


def test_scores_are_the_rule_in_exact_integers():
    """q8_0_scores: per block an exact integer dot product of the rounded query and key, then f32 steps in block
    order -- computed here in int64 and one f32 step at a time."""
    rng = np.random.default_rng(2)
    Hkv, R, L, hd = 2, 5, 37, 96
    qs = rng.standard_normal((Hkv, R, hd)).astype(np.float32) * 0.3
    keys = q8_0_blocks(rng.standard_normal((Hkv, L, hd)).astype(np.float32) * 2)
    got = q8_0_scores(qs, keys)
    dq, qq = q8_0_split(q8_0_blocks(qs))
    dk, qk = q8_0_split(keys)
    want = np.zeros((Hkv, R, L), np.float32)
    for b in range(3):
        isum = np.einsum("hri,hli->hrl", qq[..., b, :].astype(np.int64), qk[..., b, :].astype(np.int64))
        want = want + (dq[:, :, None, b] * dk[:, None, :, b]) * isum.astype(np.float32)
    np.testing.assert_array_equal(got, want)


def test_reference_attend_near_the_f32_one():
    """Attention over q8_0 keys and values against the same over f32 (its values and scores rounded to ~8 bits)."""
    rng = np.random.default_rng(4)
    H, Hkv, hd, L = 9, 3, 64, 200
    k, v = rng.standard_normal((2, Hkv, L, hd)).astype(np.float32)
    q = rng.standard_normal((20, H, hd)).astype(np.float32)
    mask = np.where(np.arange(L)[None, :] <= np.arange(L - 20, L)[:, None], 0, -np.inf).astype(np.float32)
    exact = attend_stage(q, k, v, mask, 0.125, L - 20).x
    got = attend_stage(q, q8_0_blocks(k), q8_0_blocks(v), mask, 0.125, L - 20).x
    assert np.abs(got - exact).max() < 0.02 * np.abs(exact).max()


def test_config_choice_and_bytes():
    assert load_run_config(None, ["kv_cache=q8_0"]).kv_cache == "q8_0"
    with pytest.raises(TracelmError, match=r"kv_cache.*must be in \('f16', 'f32', 'q8_0'\).*'q4_0'"):
        load_run_config(None, ["kv_cache=q4_0"])
    cfg = cfg_for(3, 64, 4096, n_layer=30)
    tables = 2 * 4096 * 64 * 4
    assert kv_cache_bytes(cfg, 4096, kv_dtype="q8_0") - tables == 2 * 30 * 3 * 4096 * 68
    assert kv_cache_bytes(cfg, 4096, kv_dtype="f16") - tables == 2 * 30 * 3 * 4096 * 128
    assert Cache(cfg, 4096, *rope_tables(4096, 64, 1e4, "neox"), kv_dtype="q8_0").kv_nbytes == 2 * 30 * 3 * 4096 * 68
    assert kv_row_bytes("q8_0", 16) == 34 and kv_row_bytes("q8_0", 256) == 8 * 34


def test_another_kv_cache_refuses_a_saved_cache(tiny_gguf, tmp_path):
    """A q8_0 session file is refused by an f16 run (the session's numerics name the KV dtype) and resumed by a
    q8_0 one; a Cache refuses a snapshot of another dtype."""
    settings = ["context=256", "max_tokens=8", "sampling.temperature=0", "threads=1"]
    live = Session(str(tiny_gguf), settings=[*settings, "kv_cache=q8_0"])
    live.chat("hello there")
    path = tmp_path / "q8.tlsession"
    live.save(path)
    f16 = Session(str(tiny_gguf), settings=settings)
    with pytest.raises(SessionIncompatible, match="kv-q8_0.*kv-f16"):
        f16.load(path)
    again = Session(str(tiny_gguf), settings=[*settings, "kv_cache=q8_0"])
    again.load(path)
    assert again.chat("and then?") == live.chat("and then?")
    with pytest.raises(TracelmError, match="q8_0 blocks, this Cache in float16"):
        f16.runner.cache.restore(live.runner.cache.snapshot())


@pytest.mark.parametrize("compute", ["reference", "kernels"])
def test_steps_equal_a_pass(tiny_gguf, compute):
    """The tiny model (head dim 16: one short block) on a q8_0 Cache: decode steps give the logits of one pass,
    near the f32 Cache's."""
    ids = [1, 5, 9, 3, 7, 2, 8, 4]
    s = Session(str(tiny_gguf), settings=["threads=1", f"compute={compute}", "kv_cache=q8_0"])
    whole = Runner(s.model, 32, kv_dtype="q8_0").logits(ids)
    steps = Runner(s.model, 32, kv_dtype="q8_0")
    rows = [steps.logits(ids[: i + 1])[-1] for i in range(len(ids))]
    np.testing.assert_array_equal(np.stack(rows), whole)
    exact = Runner(s.model, 32, kv_dtype="f32").logits(ids)
    np.testing.assert_allclose(whole, exact, rtol=0, atol=5e-2 * np.abs(exact).max())


# ---------------------------------------------------------------------------------------------------- the kernels
restored = pytest.mark.usefixtures("kernels_restored", "phases_restored")  # each test may switch path, threads, phases


def kernel_order(q, keys, values, spans, scale):
    """What the kernels' attend promises on q8_0 keys and values (kernels.h), in numpy one step at a time: the
    reference's scores (exact integers, then f32 steps), p = the kernels' exp(s - max), the sum in 8 lanes (i mod 8)
    then lanes l + l+4, l + l+2, 0 + 1, and per dim acc = acc + (p_i * dv) * qv over the keys in order; / sum."""
    T, H, hd = q.shape
    Hkv = keys.shape[0]
    g = H // Hkv
    out = np.zeros((T, H, hd), np.float32)
    for t, (k0, k1) in enumerate(spans):
        n = k1 - k0
        if n == 0:
            continue
        qs = (q[t] * np.float32(scale)).reshape(Hkv, g, hd)
        s = q8_0_scores(qs, keys[:, k0:k1]).reshape(H, n)
        d = (s - s.max(axis=1, keepdims=True)).ravel()
        p = _core.exp(d, np.empty_like(d)).reshape(H, n)
        lanes = np.zeros((H, 8), np.float32)
        for r in np.pad(p, ((0, 0), (0, -n % 8))).reshape(H, -1, 8).transpose(1, 0, 2):
            lanes = lanes + r
        u = lanes[:, :4] + lanes[:, 4:]
        v = u[:, :2] + u[:, 2:]
        total = v[:, 0] + v[:, 1]
        dv, qv = q8_0_split(values[:, k0:k1])
        dv = np.repeat(dv, 32, axis=-1)[..., :hd][np.arange(H) // g]  # [H, n, hd]
        qv = qv.reshape(Hkv, n, -1)[..., :hd].astype(np.float32)[np.arange(H) // g]
        acc = np.zeros((H, hd), np.float32)
        for i in range(n):
            acc = acc + (p[:, i, None] * dv[:, i]) * qv[:, i]
        out[t] = acc / total[:, None]
    return out.reshape(T, H * hd)


# (H, Hkv, hd): smollm2, qwen2.5, gemma3, the tiny model (one short block), a head dim of 1.25 blocks
SHAPES = [(9, 3, 64), (14, 2, 64), (4, 1, 256), (4, 2, 16), (6, 3, 40)]


@restored
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{h}-{kv}-{d}" for h, kv, d in SHAPES])
def test_kernels_keep_the_promised_order(shape):
    """Keys and values as a q8_0 Cache holds them (plain and ring layers, written a pass at a time), decode rows,
    speculation rows, a prompt and windowed rows: the kernels on every path at 1 and 2 threads give the bits of
    kernel_order, and stay near the reference stage (BLAS sums, numpy's exp)."""
    H, Hkv, hd = shape
    rng = np.random.default_rng(hd + H)
    for start, T, window in CASES:
        cache = q8_cache(Hkv, hd, 4096, window)
        kv = rng.standard_normal((2, start + T, Hkv, hd)).astype(np.float32)
        for p0 in range(0, start + T, 64):
            cache.write(0, p0, kv[0, p0 : p0 + 64], kv[1, p0 : p0 + 64])
        lo, mask = cache.window_mask(start, T, window)
        keys, values = cache.keys_values(0, start + T, lo)
        spans = causal_spans(start, T, lo, window)
        q = rng.standard_normal((T, H, hd)).astype(np.float32) * 2
        scale = 1 / math.sqrt(hd)
        got = every_setting(kernels.attend, q, keys, values, spans, scale)
        assert_same_bits(got, kernel_order(q, keys, values, spans, scale), f"start={start} T={T} window={window}")
        stage = attend_stage(q, keys, values, mask, scale, start).x
        np.testing.assert_allclose(got, stage, rtol=0, atol=1e-5 * max(1.0, np.abs(stage).max()))


@restored
@pytest.mark.parametrize("L", [1, 7, 9, 63, 257, 1601])
def test_phases_rows_alone_and_edge_cases(L):
    """Phases always, never or when they pay, at 1..4 threads (tests/test_attend_phases.py), a row alone or in a
    pass: the bits of kernel_order; an empty span gives zeros, a NaN in q its (row, head) NaN, in a value block its
    dims."""
    rng = np.random.default_rng(L)
    H, Hkv, hd = 9, 3, 64
    keys, values = (q8_0_blocks(rng.standard_normal((Hkv, L, hd)).astype(np.float32)) for _ in "kv")
    for T in (1, 3):
        q = rng.standard_normal((T, H, hd)).astype(np.float32)
        spans = causal_spans(L - T, T) if L >= T else np.array([(0, L)] * T, np.int64)
        got = every_way(q, keys, values, spans, 0.125)
        assert_same_bits(got, kernel_order(q, keys, values, spans, 0.125))
        for t in range(T):
            assert_same_bits(kernels.attend(q[t : t + 1], keys, values, spans[t : t + 1], 0.125), got[t : t + 1])
    q = rng.standard_normal((2, H, hd)).astype(np.float32)
    q[1, 4, 10] = np.nan
    bad = values.copy()
    bad[1, L - 1, :] = q8_0_blocks(np.full((1, hd), np.nan, np.float32))[0]  # the last key's value: NaN blocks
    out = every_way(q, keys, bad, np.array([(0, 0), (0, L)], np.int64), 0.125).reshape(2, H, hd)
    assert (out[0] == 0).all()
    assert np.isnan(out[1, 4]).all() and np.isnan(out[1, 3:6]).all()
    assert np.isfinite(np.delete(out[1], [3, 4, 5], axis=0)).all()


def test_bad_q8_keys_name_the_problem():
    q = np.ones((1, 2, 40), np.float32)
    keys = np.zeros((1, 3, 68), np.uint8)
    out = np.empty((1, 80), np.float32)
    spans = np.array([(0, 3)], np.int64)
    with pytest.raises(ValueError, match=r"keys must be \[Hkv, L, 68\].*ceil\(hd / 32\) blocks of 34 bytes"):
        kernels.attend(q, keys[:, :, :34], keys[:, :, :34], spans, 1.0, out)
    with pytest.raises(ValueError, match="values must have the dtype of keys"):
        kernels.attend(q, keys, np.zeros((1, 3, 68), np.float16), spans, 1.0, out)
    with pytest.raises(ValueError, match="keys must have unit stride"):
        kernels.attend(q, np.zeros((1, 3, 136), np.uint8)[:, :, ::2], keys, spans, 1.0, out)
    with pytest.raises(ValueError, match=r"keys must be float32, float16 or uint8 \(q8_0 blocks\)"):
        kernels.attend(q, keys.view(np.int8), keys, spans, 1.0, out)


@pytest.mark.parametrize("window", [0, 8])
def test_fused_layers_are_the_staged_ones(tmp_path, window):
    """On a q8_0 Cache the untraced pass (graph.fused_layers) gives the staged pass's logits and Cache bytes."""
    from tests.conftest import write_tiny_gguf
    from tests.test_compute import Q, _staged_and_fused

    path = write_tiny_gguf(tmp_path / "tiny.gguf", qtype=Q.Q4_1, window=window, seed=3)
    with Session(str(path)) as s:
        _staged_and_fused(s.model, kv_dtype="q8_0")
