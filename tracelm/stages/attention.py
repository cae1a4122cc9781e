"""Attention stages: QKV projection, rotary position embedding, causal attention, output projection."""

from __future__ import annotations

import numpy as np

from tracelm.stages.linear import linear
from tracelm.stages.norm import rms_normalize
from tracelm.state.cache import q8_0_blocks, q8_0_split
from tracelm.state.records import Heads, Hidden


def qkv(h: Hidden, wqkv: np.ndarray, bqkv: np.ndarray | None, n_head: int, n_head_kv: int,
        head_dim: int) -> Heads:
    """One product with the fused [q; k; v] matrix, split into per-head q [T,H,hd], k and v [T,Hkv,hd]."""
    y = linear(h.x, wqkv)
    if bqkv is not None:
        y += bqkv
    T, q_dim, kv_dim = y.shape[0], n_head * head_dim, n_head_kv * head_dim
    q = y[:, :q_dim].reshape(T, n_head, head_dim)
    k = y[:, q_dim : q_dim + kv_dim].reshape(T, n_head_kv, head_dim)
    v = y[:, q_dim + kv_dim :].reshape(T, n_head_kv, head_dim)
    return Heads(q, k, v, h.start)


def rope_tables(n_ctx: int, rope_dim: int, base: float, mode: str,
                freq_factors: tuple[float, ...] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of angle[p, i] = p * base^(-2i / rope_dim) / factor[i], laid out per dimension for
    `mode`: [n_ctx, rope_dim], each angle repeated on both dims of its pair (see `rotate`).
    `freq_factors` (llama 3 frequency scaling, GGUF `rope_freqs`) divide pair i's frequency; None = 1."""
    inv_freq = base ** (-np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
    if freq_factors is not None:
        inv_freq = inv_freq / np.asarray(freq_factors, np.float64)
    angle = np.arange(n_ctx, dtype=np.float64)[:, None] * inv_freq[None, :]
    if mode == "adjacent":
        angle = np.repeat(angle, 2, axis=1)  # pair i is dims (2i, 2i+1)
    elif mode == "neox":
        angle = np.concatenate([angle, angle], axis=1)  # pair i is dims (i, i + rope_dim/2)
    else:
        raise ValueError(f"unknown rope mode {mode!r}")
    return np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, mode: str) -> np.ndarray:
    """Rotate each pair (a, b) of the first rope_dim dims of x [T, H, hd] by its angle:
    (a, b) -> (a cos - b sin, b cos + a sin), computed as x * cos + partner(x) * sin with
    partner(a, b) = (-b, a). cos, sin: [T, rope_dim] rows of `rope_tables` for the same mode.

    mode "adjacent": pairs are dims (2i, 2i+1) (GGUF llama weights, llama.cpp's default);
    mode "neox": pairs are dims (i, i + rope_dim/2) (rotate-half, as in HF / GPT-NeoX).
    Dims past rope_dim pass through unchanged (partial rotary).
    """
    rope_dim = cos.shape[-1]
    xr = x[..., :rope_dim]
    partner = np.empty_like(xr)
    if mode == "adjacent":
        np.negative(xr[..., 1::2], out=partner[..., 0::2])
        partner[..., 1::2] = xr[..., 0::2]
    elif mode == "neox":
        half = rope_dim // 2
        np.negative(xr[..., half:], out=partner[..., :half])
        partner[..., half:] = xr[..., :half]
    else:
        raise ValueError(f"unknown rope mode {mode!r}")
    partner *= sin[:, None, :]
    rotated = xr * cos[:, None, :]
    rotated += partner
    if rope_dim == x.shape[-1]:
        return rotated
    return np.concatenate((rotated, x[..., rope_dim:]), axis=-1)


def qk_norm(heads: Heads, q_weight: np.ndarray, k_weight: np.ndarray, eps: float) -> Heads:
    """RMSNorm of every head of q and of k over its head_dim values (weights [head_dim] shared by heads)."""
    return Heads(rms_normalize(heads.q, q_weight, eps), rms_normalize(heads.k, k_weight, eps), heads.v, heads.start)


def rope(heads: Heads, cos: np.ndarray, sin: np.ndarray, mode: str) -> Heads:
    """Rotary position embedding of q and k (rotated together); cos/sin are the T positions' table rows."""
    n_head = heads.q.shape[1]
    qk = rotate(np.concatenate((heads.q, heads.k), axis=1), cos, sin, mode)
    return Heads(qk[:, :n_head], qk[:, n_head:], heads.v, heads.start)


ATTEND_ROWS = 16  # up to this many query rows (decode, speculation, batched decode): each row alone over the
# keys it sees, the call a one-row decode step makes there (as `linear` keeps up to 16 rows the one-row numbers)
SCORE_BYTES = 2 << 20  # more rows: chunks of query rows whose scores [Hkv, g * rows, keys] stay within this


def attend(q: np.ndarray, keys: np.ndarray, values: np.ndarray, mask: np.ndarray | None, scale: float,
           start: int) -> Hidden:
    """softmax(q k^T * scale + mask) v for every head, grouped-query style.

    q [T, H, hd]; keys, values [Hkv, L, hd] (the L cached positions the queries may see, the T new ones
    last), or uint8 [Hkv, L, row bytes] of q8_0 blocks (kv_cache q8_0: `q8_0_scores`, `q8_0_weighted`); mask
    [T, L] of 0 / -inf or None (every key visible to every query). Query head h reads kv head h // (H/Hkv).
    Returns the heads concatenated: [T, H * hd].

    Up to ATTEND_ROWS queries go one by one, each over exactly the span of keys its mask row leaves
    visible, unmasked: the same products and sums, on the same numbers, as a one-row decode step at that
    position, so a row's numbers do not depend on the rows beside it on any BLAS. More (a prompt) go in
    chunks of query rows small enough that a chunk's scores fit in a core's cache, each over only the keys
    its mask leaves visible to some row of the chunk (causal: none past its last query; a window: none
    before its first query's window), so a 2,048-token prompt never holds [H, T, L] scores, and does about
    half the work.
    """
    T, H, hd = q.shape
    if T == 1 or mask is None and T <= ATTEND_ROWS:
        return Hidden(attend_rows(q, keys, values, mask, scale), start)
    if T <= ATTEND_ROWS:
        out = np.empty((T, H * hd), np.float32)
        for t in range(T):
            k0, k1 = visible_keys(mask[t : t + 1])
            seen = None if mask[t, k0:k1].min() == 0 else mask[t : t + 1, k0:k1]  # a causal or window row: None
            out[t : t + 1] = attend_rows(q[t : t + 1], keys[:, k0:k1], values[:, k0:k1], seen, scale)
        return Hidden(out, start)
    L = keys.shape[1]
    rows = max(ATTEND_ROWS, SCORE_BYTES // (4 * H * max(L, 1)))
    out = np.empty((T, H * hd), np.float32)
    for a in range(0, T, rows):
        b = min(T, a + rows)
        if mask is None:
            out[a:b] = attend_rows(q[a:b], keys, values, None, scale)
            continue
        k0, k1 = visible_keys(mask[a:b])
        out[a:b] = attend_rows(q[a:b], keys[:, k0:k1], values[:, k0:k1], mask[a:b, k0:k1], scale)
    return Hidden(out, start)


def visible_keys(mask: np.ndarray) -> tuple[int, int]:
    """The span k0..k1-1 of key columns holding every key some row of `mask` [rows, L] sees (all L when none)."""
    seen = np.flatnonzero(mask.max(axis=0) > -np.inf)
    if seen.size == 0:  # rows that see nothing: keep their (undefined) softmax what the unchunked form gives
        return 0, mask.shape[1]
    return int(seen[0]), int(seen[-1]) + 1


def attend_rows(q: np.ndarray, keys: np.ndarray, values: np.ndarray, mask: np.ndarray | None,
                scale: float) -> np.ndarray:
    """`attend` of T query rows over all L keys in one product: scores [Hkv, g, T, L], their softmax's sums
    dividing the product with v. Returns [T, H * hd]."""
    T, H, hd = q.shape
    n_kv, L = keys.shape[0], keys.shape[1]
    g = H // n_kv
    qg = np.empty((n_kv, g, T, hd), np.float32)  # scaled q, grouped by kv head, in one copy
    np.multiply(q.reshape(T, n_kv, g, hd).transpose(1, 2, 0, 3), np.float32(scale), out=qg)
    q8 = keys.dtype == np.uint8
    if q8:
        scores = q8_0_scores(qg.reshape(n_kv, g * T, hd), keys).reshape(n_kv, g, T, L)
    else:
        scores = (qg.reshape(n_kv, g * T, hd) @ keys.transpose(0, 2, 1)).reshape(n_kv, g, T, L)
    if mask is not None:
        scores += mask
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    # normalise after the product with v: divide [.., hd] sums instead of [.., L] weights
    p = scores.reshape(n_kv, g * T, L)
    out = (q8_0_weighted(p, values, hd) if q8 else p @ values).reshape(n_kv, g, T, hd)
    out /= scores.sum(axis=-1, keepdims=True)
    return out.transpose(2, 0, 1, 3).reshape(T, H * hd)


def q8_0_scores(qs: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """kv_cache q8_0's scores: qs [Hkv, R, hd] (queries already scaled) against keys [Hkv, L, nb * 34] of q8_0
    blocks (state/cache.py q8_0_blocks). The query is rounded to q8_0 blocks too (the same quantizer), and

        s = acc over blocks b = 0..nb-1 in order, from acc = 0:  acc = acc + (dq_b * dk_b) * isum_b

    with isum_b = sum of qq * qk over the block's 32 values: an exact integer (ggml's vec_dot_q8_0_q8_0), so the
    kernels may sum it any way (int8 products, madd) -- then f32 steps in this order. Returns [Hkv, R, L] f32."""
    dq, qq = q8_0_split(q8_0_blocks(qs))  # [Hkv, R, nb], [Hkv, R, nb, 32]
    dk, qk = q8_0_split(keys)  # [Hkv, L, nb], [Hkv, L, nb, 32]
    acc = np.zeros((qs.shape[0], qs.shape[1], keys.shape[1]), np.float32)
    for b in range(dq.shape[-1]):
        # |isum| <= 32 * 127^2 < 2^24: every partial sum an integer f32 holds exactly, whatever BLAS's order
        isum = qq[..., b, :].astype(np.float32) @ qk[..., b, :].astype(np.float32).transpose(0, 2, 1)
        acc += (dq[..., b, None] * dk[:, None, :, b]) * isum
    return acc


def q8_0_weighted(p: np.ndarray, values: np.ndarray, hd: int) -> np.ndarray:
    """kv_cache q8_0's sum over positions of p v: p [Hkv, R, L] (the softmax's exps) and values [Hkv, L, nb * 34]
    of q8_0 blocks; out[d] = sum over positions i of (p_i * dv_i) * qv_i[d], each product in that order (dv: the
    scale of the block holding dim d), summed over i in position order (the kernels: one chain per dim; here as
    BLAS sums). Returns [Hkv, R, hd] f32."""
    dv, qv = q8_0_split(values)  # [Hkv, L, nb], [Hkv, L, nb, 32]
    out = np.empty((p.shape[0], p.shape[1], dv.shape[-1], qv.shape[-1]), np.float32)
    for b in range(dv.shape[-1]):
        out[..., b, :] = (p * dv[:, None, :, b]) @ qv[..., b, :].astype(np.float32)
    return out.reshape(*out.shape[:2], -1)[..., :hd]


def out_proj(attn: Hidden, wo: np.ndarray, residual: Hidden | None) -> Hidden:
    """residual + attn wo^T (just attn wo^T when residual is None: a post-norm comes first)."""
    out = linear(attn.x, wo)
    if residual is None:
        return Hidden(out, attn.start)
    out += residual.x
    return Hidden(out, residual.start)
