"""attend in phases (layer.c): when the rows and kv heads are too few to keep every thread busy, the threads share
each kv head -- the scores and the max's lanes over runs of keys, then the exps, then the outputs a block of dims
at a time -- with every float chain in the order one task gives it (kernels.h). So the bits must not move: phases
always, never, or when they pay (the default: long spans, kv heads that do not divide among the threads), at 1 to
4 threads, on every path, for a row alone or in a pass of 16, against the float64 reference of
tests/test_layer_kernels.py."""

from __future__ import annotations

import numpy as np
import pytest

from tests.test_layer_kernels import assert_same_bits, causal_spans, reference
from tracelm import kernels
from tracelm.kernels import _core

pytestmark = pytest.mark.usefixtures("kernels_restored", "phases_restored")


@pytest.fixture
def phases_restored():
    old = _core.attend_phases(-1)
    yield
    _core.attend_phases(old)


def every_way(q, keys, values, spans, scale):
    """attend with phases always, never and when they pay, at 1..4 threads, on every path: the same bits each time;
    returns them."""
    ref = None
    for path in kernels.paths():
        kernels.use_path(path)
        for threads in (1, 2, 3, 4):
            kernels.set_threads(threads)
            for mode in (1, 0, -1):
                _core.attend_phases(mode)
                got = kernels.attend(q, keys, values, spans, scale)
                if ref is None:
                    ref = got
                assert_same_bits(got, ref, f"{path} threads={threads} phases={mode}")
    return ref


def kv(rng, Hkv, L, hd, dtype, cache_layout=True):
    keys = rng.standard_normal((Hkv, L, hd)).astype(dtype)
    values = rng.standard_normal((Hkv, L, hd)).astype(dtype)
    if cache_layout:  # positions adjacent, as the Cache holds keys
        keys = np.ascontiguousarray(keys.transpose(0, 2, 1)).transpose(0, 2, 1)
    return keys, values


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("L", [1, 2, 7, 8, 9, 15, 17, 63, 257, 1601, 2083])
def test_phases_keep_the_bits_of_one_task(L, dtype):
    """Decode rows (smollm2's 9 heads on 3 kv heads, gemma's 4 on 1), spans of every length, causal and windowed:
    the same bits every way, within the float64 bound."""
    rng = np.random.default_rng(L)
    for H, Hkv, hd in ((9, 3, 64), (4, 1, 24)):
        keys, values = kv(rng, Hkv, L, hd, dtype)
        for spans in (causal_spans(L - 1, 1), causal_spans(L - 2, 2, lo=0, window=max(1, L // 3))
                      if L >= 2 else causal_spans(0, 1)):
            q = rng.standard_normal((len(spans), H, hd)).astype(np.float32) * 2
            got = every_way(q, keys, values, spans, 0.125)
            ref, bound = reference(q, keys, values, spans, 0.125)
            assert (np.abs(got - ref) <= bound).all(), f"H={H} L={L}"


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
def test_phases_row_alone_and_in_a_pass(dtype):
    """A pass of 16 rows (speculation, a prompt's chunk: one task each) and each row alone (phases when they pay,
    at 2 and 3 threads): the same bits; keys in the Cache's layout and C-contiguous (through the tiles)."""
    H, Hkv, hd, L = 14, 2, 64, 1700
    rng = np.random.default_rng(5)
    q = rng.standard_normal((16, H, hd)).astype(np.float32)
    spans = causal_spans(L - 16, 16)
    spans[4] = (9, 9)  # an empty span among them
    spans[7] = (L - 600, L - 8)  # a window
    for cache_layout in (True, False):
        keys, values = kv(rng, Hkv, L, hd, dtype, cache_layout)
        full = every_way(q, keys, values, spans, 0.125)
        for threads in (2, 3):
            kernels.set_threads(threads)
            _core.attend_phases(-1)
            for t in range(16):
                alone = kernels.attend(q[t : t + 1], keys, values, spans[t : t + 1], 0.125)
                assert_same_bits(alone, full[t : t + 1], f"row {t} threads={threads}")
        assert (full[4] == 0).all()


def test_phases_nan_and_inf():
    """A NaN among a row's scores (in a key of its span) makes the whole row NaN, an inf value that dim, the same
    way with phases or without (the max's lanes forget what came before a NaN: layer.c joins runs so)."""
    H, Hkv, hd, L = 9, 3, 16, 1800
    rng = np.random.default_rng(9)
    keys, values = kv(rng, Hkv, L, hd, np.float32, cache_layout=False)
    keys[1, 5, 3] = np.nan  # early in kv head 1's first run: later runs must not forget it
    keys[2, L - 3, 0] = np.nan  # late, in the last run
    values[0, 100, 7] = np.inf
    q = rng.standard_normal((1, H, hd)).astype(np.float32)
    out = every_way(q, keys, values, np.array([[0, L]], np.int64), 0.25).reshape(H, hd)
    assert np.isnan(out[3:]).all() and not np.isnan(out[:3, :7]).any()
    assert np.isinf(out[:3, 7]).all() or np.isnan(out[:3, 7]).all()


def test_attend_phases_mode():
    assert _core.attend_phases(0) == -1
    assert _core.attend_phases(-1) == 0
    with pytest.raises(ValueError, match="attend_phases: mode must be"):
        _core.attend_phases(2)
