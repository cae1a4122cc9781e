"""tracelm's compiled kernels: y = x W^T computed directly on GGUF blocks, bit-exact by construction.

out[i, j] depends on x row i and w row j only -- the same float operations whatever the number of rows,
threads or the path (AVX512-VNNI, AVX-VNNI, AVX2 or portable C). For quantized weights each x row is split
per block into two int8 blocks -- hi (d = amax/127) and lo, the same quantizer on the residual x - d*q -- so
the activations keep ~15 bits; for each half the integer dot of each weight block is exact and one fixed float
update per block follows, block after block from k = 0, and out = acc_hi + acc_lo. For F32/F16/BF16 weights
the f32 products go to 32 lanes (k mod 32) and one fixed reduction tree. kernels.h states the order in full;
portable.c is its plain-C reading.

    out = matmul(x, w_rows, qtype)        # x float32 [M, K], w_rows uint8 [N, row_bytes] (the GGUF rows)
    matmul(x, w_rows, qtype, out=y[:, lo:hi])   # out may have a row stride (unit column stride)
    set_threads(2); path(); use_path("portable")

Paths: the best one this CPU has is chosen at import (CPUID), but only after it met the portable path bit for bit
on a fixed battery of products and layer rows (kernels/selftest.c, ~10 ms); a path that differs in a single bit is
refused, with a RuntimeWarning, and the next best runs. selftest() says what each path's check found.

The rest of a layer, in the same discipline (one fixed order of float steps, written down in kernels.h; the same
bits on both paths, at any thread count, for a row alone or in a pass): rms_norm, rms_norm_add, rope, attend,
silu_mul, gelu_tanh_mul. Their exp and tanh are the kernels' own (a fixed polynomial, no libm), so no result
depends on the C library either.

Arguments: every entry point of _core checks what it is given against the buffers themselves (their own shapes,
strides and dtypes, never an object's attributes) and raises a ValueError naming the argument: an array the call
writes (out, scratch, attend's keys and values when it stores) may not share a byte with another it reads or writes,
except where an out may be its input itself (rms_norm, rms_norm_add, rope, exp, pack: the same view); attend wants at
least one head; out of memory inside a call is a MemoryError.

Threads: at import, all CPUs this process may run on (os.sched_getaffinity); set_threads(n) changes it.

Environment: TRACELM_KERNELS=NAME (portable, avx2, avxvnni, avx512vnni, amx) picks that path at import where it may run;
TRACELM_SPIN_US (default 200) is how long idle workers spin before they sleep; TRACELM_K_AHEAD=0..64 (default 4) is
how many super-blocks ahead the K-quants' packed decode kernels prefetch each stream (0: none; set_k_ahead(n) from
code; the same bits at every value); TRACELM_SELFTEST_FAULT=NAME makes that path's self-test fail (for tests of the
refusal).
"""

from __future__ import annotations

import atexit
import os
import time
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from tracelm.kernels import _core

F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30
SUPPORTED = frozenset(_core.SUPPORTED)  # GGML type numbers (gguf.GGMLQuantizationType)
FLOATS = frozenset((F32, F16, BF16))  # weights met by f32 activations as they are (no scratch)
BLOCK = {F32: (1, 4), F16: (1, 2), BF16: (1, 2), Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22),
         Q5_1: (32, 24), Q8_0: (32, 34), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}
"""qtype -> (values per block, bytes per block)"""
PACKABLE = frozenset((Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K))  # types `pack` reorders for the kernels

set_threads = _core.set_threads  # set_threads(n): n threads in all, the calling thread included
threads = _core.threads
set_k_ahead = _core.set_k_ahead  # set_k_ahead(n): the K-quants' decode kernels prefetch n super-blocks ahead
k_ahead = _core.k_ahead
MAX_K_AHEAD = _core.MAX_K_AHEAD  # 64: set_k_ahead's and TRACELM_K_AHEAD's most (0: no software prefetch)
set_prefetch_hint = _core.set_prefetch_hint  # set_prefetch_hint(h): the weights' software prefetch, PREFETCH_HINTS
prefetch_hint = _core.prefetch_hint
# ("t0", "nta"): into every cache level; non-temporal (kernels.h). The default: TRACELM_PREFETCH_HINT, else nta on
# AMD's CPUs and t0 on others (core.c)
PREFETCH_HINTS = _core.PREFETCH_HINTS
pool_counting = _core.pool_counting  # pool_counting(on): count the pool's jobs from now (reset), or stop
pool_counts = _core.pool_counts  # -> (jobs, offered s: each job's wall x the threads, busy s: inside its tasks)
path = _core.path  # "amx" | "avx512vnni" | "avxvnni" | "avx2" | "portable"

# the trace's kernels (trace_stats.c): stage events held as they come (each output's statistics then, its bytes for the
# digests), the statistics and digests of a batch of them, the batch's JSON lines and hash chain
TraceHolder = _core.TraceHolder  # TraceHolder(arena, meta, stats, stage_ids, refused, keep).note(stage, layer, ...)
trace_stats = _core.trace_stats  # trace_stats(arena, offsets, stats, digests)
trace_lines = _core.trace_lines  # trace_lines(template, seq, tok, meta, stats, digests, prev, key[, tail])
trace_lines_post = _core.trace_lines_post  # the same arguments -> PendingLines, rendered on the pool's idle worker
quantize_rows = _core.quantize_rows  # quantize_rows(x, qtype, scratch, halves=2): x's int8 blocks as matmul
# makes them (x row m -> block rows 2m = hi, 2m + 1 = lo; with halves=1, row m = hi) from the scratch's first 64-byte
# boundary, K / 32 blocks of 40 bytes or K / 256 of 320 a block row (matmul's Q4_0/Q5_0 scratch holds them twice)


def selftest() -> dict[str, tuple[str, str]]:
    """Each compiled path's self-test against the portable path: {name: (status, detail)}, status 'passed' (detail:
    cases and ms), 'refused' (the first case that differs), 'untested' (not used yet: `paths()` tests them all) or
    'unsupported' (this CPU lacks its instructions)."""
    return _core.selftest()


_warned: set[str] = set()


def _warn_refused() -> None:
    """A RuntimeWarning for each path whose self-test failed since the last call."""
    for name, (status, detail) in selftest().items():
        if status == "refused" and name not in _warned:
            _warned.add(name)
            warnings.warn(f"tracelm kernels: the {name} path is refused: {detail}; running {path()}", RuntimeWarning,
                          stacklevel=3)


def paths() -> tuple[str, ...]:
    """The paths this CPU can run that passed their self-test, best first (self-tests each one not yet used)."""
    try:
        return _core.paths()
    finally:
        _warn_refused()


def use_path(name: str) -> None:
    """Run `name` from now on (for tests and comparisons): self-tested at its first use; ValueError if this CPU
    lacks it or its self-test failed."""
    try:
        _core.use_path(name)
    finally:
        _warn_refused()


_warn_refused()


def _check_k_ahead(value: str | None) -> None:
    """A RuntimeWarning when TRACELM_K_AHEAD is set to what the extension did not take at import (digits for 0 to
    MAX_K_AHEAD; another value leaves its default)."""
    if value and not (value.isascii() and value.isdigit() and int(value) == k_ahead()):
        warnings.warn(f"tracelm kernels: TRACELM_K_AHEAD={value!r} is not a number of super-blocks 0..{MAX_K_AHEAD}; "
                      f"prefetching {k_ahead()} ahead", RuntimeWarning, stacklevel=2)


def _check_prefetch_hint(value: str | None) -> None:
    """A RuntimeWarning when TRACELM_PREFETCH_HINT is set to what the extension did not take at import (one of
    PREFETCH_HINTS; another value leaves the CPU's default)."""
    if value and value not in PREFETCH_HINTS:
        warnings.warn(f"tracelm kernels: TRACELM_PREFETCH_HINT={value!r} is not one of {', '.join(PREFETCH_HINTS)}; "
                      f"prefetching with {prefetch_hint()}", RuntimeWarning, stacklevel=2)


_check_k_ahead(os.environ.get("TRACELM_K_AHEAD"))
_check_prefetch_hint(os.environ.get("TRACELM_PREFETCH_HINT"))


def default_threads() -> int:
    """All CPUs this process may run on (its affinity mask), at least 1."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no sched_getaffinity (macOS, Windows)
        n = os.cpu_count() or 1
    return max(1, min(n, 256))


def row_bytes(K: int, qtype: int) -> int:
    """Bytes of one GGUF row of K values."""
    bs, tb = BLOCK[int(qtype)]
    if K % bs:
        raise ValueError(f"row_bytes: K={K} is not a multiple of the block size {bs} of qtype {qtype}")
    return K // bs * tb


def scratch_bytes(M: int, K: int, qtype: int, halves: int = 2) -> int:
    """Bytes of the scratch buffer matmul needs for M rows of K values in `halves` int8 blocks each (0 for
    F32/F16/BF16; Q4_0, Q5_0: the blocks twice, the second time with every q made unsigned, which the avx2 path's
    tiles read)."""
    return _core.scratch_bytes(M, K, int(qtype), int(halves))


def _as_bytes(w: np.ndarray, qtype: int) -> np.ndarray:
    """Float weights may come as their own dtype ([N, K] float32 / float16 / uint16): their bytes."""
    if qtype in FLOATS and w.dtype != np.uint8 and w.dtype.itemsize in (2, 4) and w.flags.c_contiguous:
        return w.view(np.uint8)
    return w


def matmul(x: np.ndarray, w_rows: np.ndarray, qtype: int, out: np.ndarray | None = None,
           scratch: np.ndarray | None = None, halves: int = 2, packed: bool = False) -> np.ndarray:
    """out = x @ W^T with W given as its GGUF rows.

    x: float32 [M, K] or [K], C-contiguous. w_rows: uint8 [N, row_bytes] (F32/F16/BF16 also as [N, K] of their
    dtype). out: float32 [M, N] (or [N]), unit column stride, rows at any stride >= N (e.g. y[:, lo:hi] of a
    wider y); scratch: >= scratch_bytes(M, K, qtype, halves) bytes. Both are made when not given: pass them to
    keep a hot loop free of allocation. halves (quantized weights): 1, x as one int8 block per weight block
    (llama.cpp's q8 precision, ~8 bits); 2, a hi and a lo block (~15 bits, twice the integer work). packed: w_rows
    as `pack` made them (the same bits, fewer loads)."""
    qtype = int(qtype)
    w_rows = _as_bytes(w_rows, qtype)
    one = x.ndim == 1
    x2 = x.reshape(1, -1) if one else x
    if out is None:
        out = np.empty((w_rows.shape[0],) if one else (x2.shape[0], w_rows.shape[0]), np.float32)
    out2 = out.reshape(1, -1) if one and out.ndim == 1 else out  # a view: the kernel writes into `out`
    if scratch is None and qtype in SUPPORTED and qtype not in FLOATS and x2.ndim == 2:
        bs = BLOCK[qtype][0]
        scratch = np.empty(_core.scratch_bytes(x2.shape[0], x2.shape[1] // bs * bs, qtype, halves), np.uint8)
    _core.matmul(x2, w_rows, qtype, out2, scratch, int(halves), bool(packed))
    return out


def packable(qtype: int, rows: int) -> bool:
    """Whether `pack` takes a matrix: a quantized type in whole groups of 8 rows."""
    return int(qtype) in PACKABLE and rows % 8 == 0


def pack(w_rows: np.ndarray, qtype: int, out: np.ndarray | None = None) -> np.ndarray:
    """GGUF rows uint8 [N, row_bytes] (N a multiple of 8) -> the same bytes reordered per group of 8 rows, block
    by block (kernels.h, "Packed weights"; Q5_0/Q5_1's and Q6_K's bits regrouped within their bytes), so a kernel
    loads a block of 8 rows with a few vector loads; matmul with packed=True gives the bits of the rows. out:
    [N, row_bytes], made when None, may be w_rows itself."""
    if out is None:
        out = np.empty(w_rows.shape, np.uint8)
    return _core.pack(w_rows, int(qtype), out)


def unpack_rows(w_packed: np.ndarray, qtype: int, ids: np.ndarray) -> np.ndarray:
    """Rows `ids` of a packed matrix as the file's GGUF rows (for dequantize: an embedding lookup)."""
    ids = np.ascontiguousarray(ids, np.int64).reshape(-1)
    return _core.unpack_rows(w_packed, int(qtype), ids, np.empty((ids.size, w_packed.shape[1]), np.uint8))


def dequantize(w_rows: np.ndarray, qtype: int, out: np.ndarray | None = None) -> np.ndarray:
    """GGUF rows uint8 [R, row_bytes] -> float32 [R, K], the same bits as gguf.quants.dequantize."""
    qtype = int(qtype)
    w_rows = _as_bytes(w_rows, qtype)
    if out is None:
        bs, tb = BLOCK.get(qtype, (1, 1))
        out = np.empty((w_rows.shape[0], w_rows.shape[-1] // tb * bs), np.float32)
    return _core.dequantize(w_rows, qtype, out)


ROPE_MODES = {"adjacent": 0, "neox": 1}


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray | None = None) -> np.ndarray:
    """RMSNorm of every row (last axis) of x: out = (x * inv) * w, inv = 1 / sqrt(ss / d + eps).

    ss = sum of x*x over the row's d values in 32 lanes (lane l takes k = l mod 32, in order, the row padded with
    zeros), then reduce32's tree (kernels.h); then f32 ss / d, + eps, a correctly rounded sqrt, 1 / that: the
    steps of stages/norm.py rms_normalize with only the order of ss fixed.
    x: float32 [T, d] or [T, H, d] (rows at any strides, unit last stride: e.g. the q heads of a qkv product);
    w: float32 [d]; out: like x, made when None, may be x itself."""
    if out is None:
        out = np.empty(x.shape, np.float32)
    return _core.rms_norm(x, w, float(eps), out)


def rms_norm_add(x: np.ndarray, w: np.ndarray, eps: float, residual: np.ndarray,
                 out: np.ndarray | None = None) -> np.ndarray:
    """out = ((x * inv) * w) + residual: rms_norm, then the residual added (gemma's post-norms, stages/norm.py
    post_norm). residual: like x; out may be x or residual itself."""
    if out is None:
        out = np.empty(x.shape, np.float32)
    return _core.rms_norm_add(x, w, float(eps), residual, out)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, mode: str | int, out: np.ndarray | None = None) -> np.ndarray:
    """Rotary position embedding, bit for bit stages/attention.py `rotate`: each pair (a, b) of the first rope_dim
    dims of every head goes to (a cos_a + (-b) sin_a, b cos_b + a sin_b) with the table values at each value's own
    dim (x * cos + partner * sin); dims rope_dim.. pass through.

    x: float32 [T, H, hd] (rows and heads at any strides, unit last stride: e.g. q and k of a qkv product as one
    [T, H + Hkv, hd] view); cos, sin: float32 [T, rope_dim] (Cache.rope_rows); mode "adjacent" (pairs 2i, 2i+1)
    or "neox" (pairs i, i + rope_dim/2), or 0 / 1; out: like x, made when None, may be x itself."""
    mode = ROPE_MODES[mode] if isinstance(mode, str) else int(mode)
    if out is None:
        out = np.empty(x.shape, np.float32)
    return _core.rope(x, cos, sin, mode, out)


def attend(q: np.ndarray, keys: np.ndarray, values: np.ndarray, spans: np.ndarray, scale: float,
           out: np.ndarray | None = None) -> np.ndarray:
    """softmax(q k^T * scale) v, each query row over its own span of keys; grouped-query (head h reads kv head
    h // (H / Hkv)). Per (row t, head h), with the span k0..k1-1 and i = j - k0 (kernels.h states it once):

        qs = q * scale;  s_i = qs . k_j, one chain over the dims in order (acc = acc + qs[d] * k[d] from 0)
        m = max s_i over 8 lanes (i mod 8), then lanes l, l+4 / l, l+2 / 0, 1
        p_i = exp(s_i - m)  (the kernels' exp: Taylor to r^7 around n ln2, within 2 ulp)
        sum = 8 lanes (i mod 8) of p_i, the same tree;  out[d] = (sum_i p_i v_j[d], i in order) / sum

    A span k0 == k1 gives zeros. A NaN among a (row, head)'s scores (in q or a key of its span) makes its whole
    output NaN; a NaN in a value makes that dim NaN; a score of +inf gives NaN (inf - inf), as numpy does.

    q: float32 [T, H, hd] (unit last stride); keys, values: [Hkv, L, hd], both float32 or both float16 (f16 values
    are converted exactly); keys at any strides (the Cache's transposed view included), values with a unit last
    stride; spans: int64 [T, 2], 0 <= k0 <= k1 <= L (`Cache.window_spans`); out: float32 [T, H * hd], rows at any stride
    (made when None). A task over the pool is a row's query heads of one kv head (split when there are fewer such
    groups than threads), so a key is read once for all of them; each thread keeps one scratch buffer (the task's
    scores: 4 bytes x heads x span), grown to the longest span seen, so a warm call allocates nothing. When such
    groups are few and do not divide among the threads and a span is long, the ones left over (groups % threads)
    are shared by all threads in three phases (runs of keys: scores and the max's lanes; their exps; blocks of
    output dims, each summing p itself), every chain in the order above: the same bits
    (_core.attend_phases(1 | 0) forces phases for all or none, for tests)."""
    if out is None:
        out = np.empty((q.shape[0], q.shape[1] * q.shape[2]), np.float32)
    return _core.attend(q, keys, values, spans, float(scale), out)


def attend_parts(parts: Sequence[tuple], scale: float) -> None:
    """`attend` for the sequences of one pass, as one job over the pool (a decode step of 8 sequences is 8 small
    attends per layer: one call keeps every thread busy and pays one dispatch). Each part is (q, keys, values,
    spans, out), as attend takes them, or (q, keys, values, spans, out, k_new, v_new): the part's own keys and
    values, float32 [T, Hkv, hd], are first stored at the last T positions of keys and values (writable views of
    the Cache's arrays: `Cache.in_place_views`), rounded as the Cache stores them (f16 to nearest even, as numpy's
    astype; q8_0 by q8_0_blocks' rule). Every part's out is bitwise what attend gives it alone."""
    _core.attend_parts(parts, float(scale))


def attend_layer(parts: Sequence[tuple], layer: int, windows: Sequence[tuple[int, np.ndarray]], scale: float) -> None:
    """attend_parts for one layer of a pass, with no tuple per part and layer: part p is (q, keys, values, end, out,
    k_new, v_new) for the whole pass, keys and values every layer's arrays of its Cache ([n_head_kv, position, ...]
    each: `Cache.in_place_layers`), and windows[p] = (lo, spans) this layer's. It is attend_parts' part (q,
    keys[layer][:, lo:end], values[layer][:, lo:end], spans, out, k_new, v_new): the same stores and bits."""
    _core.attend_layer(parts, int(layer), windows, float(scale))


def q8_0_blocks(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """x float32 [..., n] (2-D or 3-D, unit last stride) as kv_cache q8_0's blocks: uint8 [..., ceil(n / 32) * 34],
    the bytes of state/cache.py q8_0_blocks (its rule, in C: a decode step stores its keys and values without a
    dozen numpy calls per layer). out: C-contiguous (made when None)."""
    if out is None:
        out = np.empty((*x.shape[:-1], -(-x.shape[-1] // 32) * 34), np.uint8)
    return _core.q8_0_blocks(x, out)


def exp(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """e^x value by value, the kernels' own exp (kernels.h: x clamped to [-104, 89], within 2 ulp), over the pool:
    the same bits on every path, thread count and CPU (numpy's exp picks its SIMD code by CPU). x: float32 1-D,
    unit stride; out: like x (made when None), may be x itself."""
    if out is None:
        out = np.empty_like(x)
    return _core.exp(x, out)


def exp_sum(x: np.ndarray, shift: float) -> float:
    """sum over x of e^(x - shift): each float32 difference through the kernels' exp (as `exp`), summed in float64
    in one fixed order (per 4096 values 8 running sums, value k into sum k mod 8, then a fixed tree; the chunks in
    order), so the same bits on every path and thread count; nothing is written. x: float32 1-D, unit stride."""
    return _core.exp_sum(x, float(shift))


def dot_peak(seconds: float = 0.02, repeat: int = 5) -> dict[str, Any] | None:
    """The path's integer dot at its peak on every thread now (12 independent accumulators of its widest integer
    step, operands in registers: vpdpbusd, or AVX2's maddubs and its add): int8 products per second, the best of
    `repeat` runs of about `seconds` each (a first, shorter run sizes them). The bound a quantized product's integer
    work cannot pass (the amx path's tiles can: it times its 512-bit vpdpbusd). None on the portable path."""
    rounds = 20_000
    t0 = time.perf_counter()
    products, insn = _core.dot_peak(rounds)
    if not products:
        return None
    rounds = max(rounds, int(rounds * seconds / max(time.perf_counter() - t0, 1e-6)))
    rate = 0.0
    for _ in range(repeat):
        t0 = time.perf_counter()
        products, insn = _core.dot_peak(rounds)
        rate = max(rate, products / (time.perf_counter() - t0))
    return {"int8_products_g_s": round(rate / 1e9, 1), "instruction": insn, "path": path(), "threads": threads()}


def all_finite(x: np.ndarray) -> bool:
    """Whether every value of x (1-D, or 2-D with rows at any stride; float32 or float64, unit last stride) is finite:
    np.isfinite(x).all() in one pass that writes nothing (a pass's logits, checked every step)."""
    return _core.all_finite(x)


def mask_logits(logits: np.ndarray, mask: np.ndarray) -> int:
    """A grammar's allowed-token mask applied in place: logits[t] = -inf for every token t whose bit is clear (bit
    t mod 8 of byte t // 8 of the mask's bytes: the grammar engine's packed int32 words, little-endian). logits:
    float32 or float64 1-D, unit stride, written; mask: uint8 1-D of at least ceil(len / 8) bytes. Returns how many
    tokens are allowed."""
    return _core.mask_logits(logits, mask)


def top_k(x: np.ndarray, k: int) -> np.ndarray:
    """The ids (int64, ascending) of the k largest values of x (1-D float32 or float64, unit stride; 1 <= k <=
    x.size), the lowest ids winning ties at the k-th value: top-k sampling's selection in one pass (16 values at a
    time against the k-th largest so far), comparisons only, so the same ids everywhere. NaN is refused (ValueError)."""
    return _core.top_k(x, int(k), np.empty(int(k), np.int64))


def top_p(e: np.ndarray, total: float, top_p: float) -> np.ndarray:
    """Top-p sampling's set: the indices (int64, ascending) of the shortest prefix of the order by descending
    p = e / total (float64; ties: lower index first) whose cumulative sum, added one by one in that order as np.cumsum
    does, reaches top_p; every index when it never does (rounding). Only that prefix's candidates are sorted (a
    histogram of e's bits finds where it ends; a stable radix sort of their bits): the set of the full sort. e: float32
    1-D, unit stride, finite and >= 0 (a softmax's numerators); total > 0; 0 < top_p <= 1."""
    out = np.empty(e.shape[0] if e.ndim == 1 else 0, np.int64)
    return out[: _core.top_p(e, float(total), float(top_p), out)]


def silu_mul(gate_up: np.ndarray, n_ff: int, out: np.ndarray | None = None) -> np.ndarray:
    """silu(gate) * up of gate_up = [gate | up] (float32 [T, 2 n_ff], rows at any stride): per value
    (g / (1 + exp(min(-g, 88)))) * u, the ops of stages/ffn.py silu with the kernels' exp. out: [T, n_ff]."""
    if out is None:
        out = np.empty((gate_up.shape[0], n_ff), np.float32)
    return _core.silu_mul(gate_up, int(n_ff), out)


def gelu_tanh_mul(gate_up: np.ndarray, n_ff: int, out: np.ndarray | None = None) -> np.ndarray:
    """gelu_tanh(gate) * up (GeGLU): per value ((tanh((((g g) c + 1) g) k) + 1) g) 0.5 * u with c = 0.044715 and
    k = sqrt(2/pi) as f32, stages/ffn.py gelu_tanh's ops in its order; tanh(y) = sign(y) (1 - e) / (1 + e),
    e = exp(-2|y|) (absolute error a few 2^-24, what 1 + tanh keeps)."""
    if out is None:
        out = np.empty((gate_up.shape[0], n_ff), np.float32)
    return _core.gelu_tanh_mul(gate_up, int(n_ff), out)


set_threads(default_threads())
atexit.register(_core.shutdown)  # join the workers before the interpreter goes
