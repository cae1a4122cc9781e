"""Mistral-style sliding window: when every layer has the window, the KV cache is a ring of window + slack
positions instead of n_ctx, with the logits of an unbounded cache, bit for bit; prefix reuse, rollback of
guesses, reset and nbytes keep working, and nothing stale is ever read."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from tests.conftest import write_tiny_gguf
from tracelm import TracelmError
from tracelm.pipeline.graph import forward, new_cache
from tracelm.pipeline.runner import Runner
from tracelm.state.records import SamplingParams

WINDOW, N_CTX = 16, 256
UNBOUNDED = N_CTX  # a slack this large makes the ring no smaller than n_ctx: positions in place


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    from tracelm.io.loader import load_model

    path = write_tiny_gguf(tmp_path_factory.mktemp("mistral") / "mistral-tiny.gguf", window=WINDOW, seed=3)
    m = load_model(str(path), progress=False)
    assert [m.cfg.window(i) for i in range(m.cfg.n_layer)] == [WINDOW] * m.cfg.n_layer
    return m


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).integers(0, 250, n)]


def _decode(m, cache, prompt: list[int], n: int) -> tuple[np.ndarray, list[int]]:
    """Greedy: the prompt's logits (every position), then n decoded tokens' logits; the tokens."""
    rows = [forward(m.cfg, m.weights, cache, prompt, all_logits=True).values]
    out = [int(np.argmax(rows[-1][-1]))]
    for _ in range(n - 1):
        rows.append(forward(m.cfg, m.weights, cache, [out[-1]]).values)
        out.append(int(np.argmax(rows[-1][-1])))
    return np.concatenate(rows), out


@pytest.mark.parametrize("slack", [8, 64])
@pytest.mark.parametrize("mixed", [False, True])
def test_ring_gives_the_unbounded_logits_bit_for_bit(mistral, slack, mixed) -> None:
    """64-token prompt (slack 8: longer than the slack, read joined with the held window; 64: in place),
    then 48 decoded positions, the ring wrapping several times. Mixed: layer 1 global (gemma3-style), layer 0
    windowed in a ring."""
    cfg = attrs.evolve(mistral.cfg, swa_pattern=2) if mixed else mistral.cfg
    m = attrs.evolve(mistral, cfg=cfg)
    ring, full = new_cache(cfg, N_CTX, slack), new_cache(cfg, N_CTX, UNBOUNDED)
    assert ring.rings == [WINDOW - 1 + slack, 0 if mixed else WINDOW - 1 + slack] and full.ring == 0
    got, toks = _decode(m, ring, _prompt(64), 48)
    expect, expect_toks = _decode(m, full, _prompt(64), 48)
    assert toks == expect_toks
    assert np.array_equal(got, expect)
    assert ring.n_past == full.n_past == 64 + 47 and ring.tokens == full.tokens
    assert ring.first == ring.n_past - ring.ring  # the oldest positions are gone


def test_ring_bounds_the_kv_bytes(mistral) -> None:
    cfg = mistral.cfg
    per_position = 2 * cfg.n_layer * cfg.n_head_kv * cfg.head_dim * 2  # k and v, f16 (kv_cache's default)
    kv = {n: new_cache(cfg, n).kv_nbytes for n in (512, 32768)}
    assert kv[512] == kv[32768] == 2 * (WINDOW - 1 + 64) * per_position
    full = new_cache(cfg, 32768, 32768)
    assert full.kv_nbytes == 32768 * per_position
    assert new_cache(cfg, 32768).nbytes == full.nbytes - (32768 - 2 * (WINDOW - 1 + 64)) * per_position
    # a window ring would not be smaller than n_ctx positions: positions in place
    small = new_cache(cfg, 100)
    assert small.ring == 0 and small.k[0].shape[1] == 100


def test_mixed_window_and_global_layers_bound_only_the_windowed(mistral) -> None:
    gemma_like = attrs.evolve(mistral.cfg, swa_pattern=2)  # layer 1 global
    c = new_cache(gemma_like, 4096)
    assert c.rings == [WINDOW - 1 + 64, 0]
    assert [k.shape[1] for k in c.k] == [v.shape[1] for v in c.v] == [2 * (WINDOW - 1 + 64), 4096]


def _runner(m, slack: int, draft: int = 0) -> Runner:
    r = Runner(m, N_CTX, draft_tokens=draft)
    r.cache = new_cache(m.cfg, N_CTX, slack)
    return r


@pytest.mark.parametrize("mixed", [False, True])
def test_prefix_reuse_keeps_what_the_ring_holds_else_recomputes(mistral, mixed) -> None:
    if mixed:  # layer 1 global: it holds everything, layer 0's ring decides
        mistral = attrs.evolve(mistral, cfg=attrs.evolve(mistral.cfg, swa_pattern=2))
    prompt = _prompt(64, seed=1)
    ring, full = _runner(mistral, 8), _runner(mistral, UNBOUNDED)
    for r in (ring, full):
        r.prefill(prompt + _prompt(40, seed=2))  # 104 positions; the ring (23 slots) holds 81..103
    assert ring.cache.first == 104 - 23
    # a follow-up sharing 100 tokens: position 100 reads 85..99, still held: reused
    follow = prompt + _prompt(40, seed=2)[:36] + [7, 8, 9]
    assert ring.cache.reusable(100) == 100
    a, b = ring.prefill(follow).values, full.prefill(follow).values
    assert ring.stats.n_reused == full.stats.n_reused == 100
    assert np.array_equal(a, b)
    # sharing only 64: position 64 reads 49..63, overwritten: computed from the start, same numbers
    other = prompt + [1, 2, 3]
    assert ring.cache.reusable(64) == 0
    a, b = ring.prefill(other).values, full.prefill(other).values
    assert ring.stats.n_reused == 0 and full.stats.n_reused == 64
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)  # full reuses its cached prompt: other rounding
    assert np.array_equal(a, _runner(mistral, UNBOUNDED).prefill(other).values)
    assert ring.cache.tokens == other


def test_truncate_refuses_what_the_ring_overwrote_and_reset_forgets(mistral) -> None:
    r = _runner(mistral, 8)
    r.prefill(_prompt(60))
    n = r.cache.n_past
    r.cache.truncate(n - 8)  # a rollback within the slack
    assert r.cache.n_past == n - 8
    with pytest.raises(TracelmError, match="cannot go back to position 30"):
        r.cache.truncate(30)
    assert r.cache.n_past == n - 8
    with pytest.raises(RuntimeError, match="not all held"):
        r.cache.keys_values(0, 30, 15)  # never a view of overwritten slots
    r.cache.reset()
    assert r.cache.first == 0 and r.cache.n_past == 0
    assert np.array_equal(r.prefill(_prompt(60)).values, _runner(mistral, UNBOUNDED).prefill(_prompt(60)).values)


def test_a_long_pass_cut_short_is_recomputed_not_read_stale(mistral) -> None:
    """A pass longer than the slack overwrites held positions layer by layer; if it stops after layer 0,
    the Cache no longer offers its prefix for reuse."""
    r = _runner(mistral, 8)
    r.prefill(_prompt(40))
    assert r.cache.reusable(40) == 40
    k = np.zeros((30, mistral.cfg.n_head_kv, mistral.cfg.head_dim), np.float32)
    r.cache.write(0, 40, k, k)  # layer 0 of a 30-row pass; no commit
    assert r.cache.n_past == 40 and r.cache.reusable(40) == 0
    with pytest.raises(RuntimeError, match="no longer held by layer 0"):
        r.cache.write(0, 40, k, k)
    ids = _prompt(40) + [5]
    assert np.array_equal(r.prefill(ids).values, _runner(mistral, UNBOUNDED).prefill(ids).values[-1:])
    assert r.stats.n_reused == 0


@pytest.mark.parametrize("mixed", [False, True])
def test_speculation_rolls_back_inside_the_ring(mistral, mixed) -> None:
    """Prompt-lookup guesses (rolled back when the sampler disagrees) on a ring of the runner's own sizing:
    the same tokens as plain decoding with an unbounded cache."""
    if mixed:
        mistral = attrs.evolve(mistral, cfg=attrs.evolve(mistral.cfg, swa_pattern=2))
    pattern = _prompt(12, seed=4)
    prompt = pattern * 5 + pattern[:4]
    greedy = SamplingParams(temperature=0.0)
    spec = Runner(mistral, N_CTX, draft_tokens=8)
    assert spec.cache.ring == WINDOW - 1 + 64
    plain = _runner(mistral, UNBOUNDED)
    got = list(spec.generate(prompt, 120, greedy))
    assert got == list(plain.generate(prompt, 120, greedy))
    assert spec.stats.tokens == plain.stats.tokens and len(spec.stats.tokens) == 120
    assert spec.stats.n_drafted > 0 and spec.cache.n_past == plain.cache.n_past > spec.cache.ring


def test_a_long_prompt_leaves_no_mask_held(mistral) -> None:
    """After a 600-token prompt the ring Cache holds its ring and tables only: its [600, 600] mask (1.4 MB
    here, 16 MB for 2,048 tokens) is not kept (numpy's route: the kernels take spans, never a mask)."""
    import tracelm.state.cache as cache_module
    from tracelm.io.loader import load_model

    m = load_model(str(mistral.path), progress=False, compute="reference")
    c = new_cache(m.cfg, 1024)
    before = c.nbytes
    forward(m.cfg, m.weights, c, _prompt(600))
    assert c.nbytes == before
    forward(m.cfg, mistral.weights, c, _prompt(5))
    assert c.nbytes == before  # the kernels' route holds no mask
    forward(m.cfg, m.weights, c, _prompt(5))  # small masks are kept
    assert before < c.nbytes <= before + cache_module.MASK_KEEP_BYTES


@pytest.mark.parametrize("window", [0, 1, 5, WINDOW])
def test_window_spans_are_the_masks_visible_runs(mistral, window) -> None:
    """The kernels' attend takes each query row's visible keys as a span: the one run of zeros of its mask row."""
    cache = new_cache(mistral.cfg, 64)
    for start, T in [(0, 1), (0, 7), (3, 1), (10, 12), (40, 5)]:
        lo, mask = cache.window_mask(start, T, window)
        lo_s, spans = cache.window_spans(start, T, window)
        assert lo_s == lo and spans.shape == (T, 2) and spans.dtype == np.int64
        rows = np.zeros((T, start + T - lo), np.float32) if mask is None else mask
        for t in range(T):
            seen = np.flatnonzero(rows[t] == 0)
            assert (spans[t, 0], spans[t, 1]) == (seen[0], seen[-1] + 1) == (seen[0], seen[0] + len(seen))
