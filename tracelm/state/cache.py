"""The Cache: the one mutable object of a run (KV per layer, RoPE tables, causal masks)."""

from __future__ import annotations

import mmap

import attrs
import numpy as np

from tracelm.state.errors import TracelmError
from tracelm.state.model_config import ModelConfig
from tracelm.state.records import frozen_array

# A window ring's room past the window (mistral-style models, see Cache): a pass of up to this many new
# positions is written and read in place, and a truncate may go back up to this many positions.
RING_SLACK = 64
MASK_KEEP_BYTES = 1 << 20  # masks up to this size are kept for the next pass that asks
# the run config's kv_cache -> the dtype of the Cache's arrays (q8_0: bytes of ggml's q8_0 blocks, see q8_0_blocks)
KV_DTYPES = {"f32": np.float32, "f16": np.float16, "q8_0": np.uint8}
Q8_VALUES, Q8_BYTES = 32, 34  # a q8_0 block: 32 values as an f16 scale d, then 32 int8
Q8_TINY = np.float32(2.0**-100)  # a q8_0 block whose max |x| is below this is all zeros (1 / d stays finite)
BUFFER_KEEP_BYTES = 1 << 20  # scratch arrays of a pass up to this size are kept for the next pass (Cache.buffer)


def mapped_zeros(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Zeros in an anonymous mapping of their own, for a Cache's keys and values: a page is resident once written
    (a KV array fills a few positions at a time in every slab, so ordinary pages: a huge one would make 2 MiB
    resident for the first token), and the mapping goes back to the OS with the array. From malloc, a freed KV
    array would stay in the heap (glibc raises its mapping threshold to the size of each mapped block freed),
    and the next Cache's arrays would come from there, zeroed and resident at once."""
    count = int(np.prod(shape))
    buf = mmap.mmap(-1, max(1, count * np.dtype(dtype).itemsize))
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(buf, dtype, count).reshape(shape)


def kv_row_bytes(kv_dtype: str, head_dim: int) -> int:
    """The bytes of one kv head's key (or value) at one position in `kv_dtype`."""
    if kv_dtype == "q8_0":
        return -(-head_dim // Q8_VALUES) * Q8_BYTES
    return head_dim * np.dtype(KV_DTYPES[kv_dtype]).itemsize


def q8_0_blocks(x: np.ndarray) -> np.ndarray:
    """x [..., n] f32 as ggml's q8_0 blocks: [..., nb * 34] bytes, nb = ceil(n / 32), block b of values
    32b..32b+31 (the last padded with zeros) = its scale d as f16 (2 bytes, little-endian), then 32 int8 q:

        d = max|x| / 127 (f32),  q = round(x * (1 / d))  (f32 product, rounded half to even; |q| <= 127),
        stored d = f16(d) (nearest), so the block stands for f16(d) * q.

    A block with a non-finite value gets d = NaN and q = 0 (whatever meets it is NaN); one whose max |x| is below
    2^-100 is all zeros (d = 0). The kernels read these bytes as they are (tracelm/kernels/kernels.h)."""
    *lead, n = x.shape
    nb = -(-n // Q8_VALUES)
    xb = np.zeros((*lead, nb * Q8_VALUES), np.float32)
    xb[..., :n] = x
    xb = xb.reshape(*lead, nb, Q8_VALUES)
    amax = np.abs(xb).max(axis=-1)
    ok = np.isfinite(amax) & (amax >= Q8_TINY)
    d = amax / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=ok)
    with np.errstate(invalid="ignore"):
        q = np.where(ok[..., None], np.rint(xb * inv[..., None]), 0).astype(np.int8)
    d = np.where(ok, d, np.where(np.isfinite(amax), np.float32(0), np.float32(np.nan))).astype("<f2")
    out = np.empty((*lead, nb, Q8_BYTES), np.uint8)
    out[..., :2] = d[..., None].view(np.uint8)
    out[..., 2:] = q.view(np.uint8)
    return out.reshape(*lead, nb * Q8_BYTES)


def q8_0_split(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """q8_0 bytes [..., nb * 34] -> the scales d as f32 [..., nb] (exact) and the int8 q [..., nb, 32]."""
    *lead, width = blocks.shape
    b = blocks.reshape(*lead, width // Q8_BYTES, Q8_BYTES)
    d = np.ascontiguousarray(b[..., :2]).view("<f2")[..., 0].astype(np.float32)
    return d, b[..., 2:].view(np.int8)


def q8_0_values(blocks: np.ndarray, n: int) -> np.ndarray:
    """The n values [..., n] f32 that q8_0 bytes stand for: d * q (exact in f32: 11 bits times 8)."""
    d, q = q8_0_split(blocks)
    x = d[..., None] * q.astype(np.float32)
    return x.reshape(*x.shape[:-2], -1)[..., :n]


def kv_name(dtype: np.dtype) -> str:
    """A Cache array's dtype as a message names it (float16, float32, q8_0 blocks)."""
    return "q8_0 blocks" if dtype == np.uint8 else dtype.name


@attrs.frozen(slots=True, eq=False)
class CacheSnapshot:
    """What a Cache holds, to save and restore (`Cache.snapshot`, `Cache.restore`): the token ids of its
    positions and, per layer, the keys and values [n_head_kv, n_past - first, head_dim] (q8_0: [.., row bytes]
    of blocks) of positions first..n_past-1 (first: the oldest a window ring still holds; 0 elsewhere). No RoPE
    tables: they are recomputed."""

    tokens: tuple[int, ...] = attrs.field(converter=lambda ids: tuple(int(i) for i in ids))
    first: tuple[int, ...] = attrs.field(converter=tuple)
    keys: tuple[np.ndarray, ...] = attrs.field(converter=lambda a: tuple(frozen_array(x) for x in a))
    values: tuple[np.ndarray, ...] = attrs.field(converter=lambda a: tuple(frozen_array(x) for x in a))

    def __attrs_post_init__(self) -> None:
        n = len(self.tokens)
        for layer, (lo, k, v) in enumerate(zip(self.first, self.keys, self.values, strict=True)):
            if not 0 <= lo <= n or k.ndim != 3 or k.shape[1] != n - lo or k.shape != v.shape:
                raise ValueError(f"layer {layer}: keys {list(k.shape)} / values {list(v.shape)} do not hold "
                                 f"positions {lo}..{n - 1}")

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (*self.keys, *self.values))


class Cache:
    """Keys and values of every layer for up to n_ctx positions, preallocated, plus the tables that
    depend only on position. `tokens` are the ids whose keys/values are stored, in position order.

    A layer that attends over a window W (mistral: every layer; gemma3: five in six) never reads a position
    older than W - 1 before a query again, so its KV arrays are a ring of `rings[layer]` = W - 1 + slack
    slots instead of n_ctx positions: position p lives in slot p % ring, written twice, at index slot and
    slot + ring of arrays 2 * ring long, so that any `ring` consecutive positions are one contiguous view in
    position order (keys and masks as an unbounded Cache gives them, with the same numbers). A pass of T rows
    reads positions p - W + 1.. of its first query p: up to `slack` rows read the ring in place; a longer one
    (a prompt) reads the held positions joined with its own new ones, and the ring keeps its last `ring`.
    `held_from[layer]` is the oldest position a layer still holds; `reusable(n)` says whether a truncate to
    n can continue from there (the next pass reads n - W + 1..n - 1 of each windowed layer), and `truncate`
    refuses what it cannot keep. Layers without a window (and windows whose ring would not be smaller than
    n_ctx) keep n_ctx positions (`rings[layer]` = 0)."""

    def __init__(self, cfg: ModelConfig, n_ctx: int, rope_cos: np.ndarray, rope_sin: np.ndarray,
                 rope_extra: dict[float, tuple[np.ndarray, np.ndarray]] | None = None, slack: int = RING_SLACK,
                 kv_dtype: str = "f16"):
        self.n_ctx = n_ctx
        self.kv_cache = kv_dtype  # the run config's name: f32, f16 or q8_0
        self.kv_dtype = np.dtype(KV_DTYPES[kv_dtype])  # keys and values are rounded to it as they are stored
        self.windows = [cfg.window(i) for i in range(cfg.n_layer)]
        rings = [w - 1 + max(1, slack) if w else 0 for w in self.windows]
        self.rings = [r if 0 < 2 * r < n_ctx else 0 for r in rings]  # per layer: ring slots; 0: positions in place
        # per layer [kv head, position (ring: slot), head dim]; f32/f16 keys are stored with positions last, so that
        # attend's q k^T streams rows of positions (the same products, summed as BLAS does for that layout); q8_0
        # keys and values [kv head, position, q8_0 blocks of the head dim] (a position's blocks side by side, for
        # the integer dot products of attend)
        self.k, self.v = [], []
        width = kv_row_bytes(kv_dtype, cfg.head_dim)
        for r in self.rings:
            n = 2 * r if r else n_ctx
            if kv_dtype == "q8_0":
                self.k.append(mapped_zeros((cfg.n_head_kv, n, width), self.kv_dtype))
            else:
                self.k.append(mapped_zeros((cfg.n_head_kv, cfg.head_dim, n), self.kv_dtype).transpose(0, 2, 1))
            self.v.append(mapped_zeros((cfg.n_head_kv, n, width // self.kv_dtype.itemsize), self.kv_dtype))
        self.held_from = [0] * cfg.n_layer  # per layer, the oldest position whose keys/values are still held
        self._joined: tuple | None = None  # a long pass's held + new keys/values of one layer, until read
        self.rope_cos, self.rope_sin = rope_cos, rope_sin  # [n_ctx, rope_dim], laid out for the rope mode
        # tables of other RoPE bases (gemma3's windowed layers), keyed by base
        self.rope_extra = dict(rope_extra or {})
        for table in (self.rope_cos, self.rope_sin, *(t for pair in self.rope_extra.values() for t in pair)):
            table.flags.writeable = False
        self.tokens: list[int] = []
        self._masks: dict[tuple[int, int, int], np.ndarray] = {}  # (start, T, window) -> mask
        self._buffers: dict[tuple[str, tuple[int, ...]], np.ndarray] = {}  # (name, shape) -> a pass's scratch

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    @property
    def ring(self) -> int:
        """The ring slots of windowed layers (0: every layer keeps n_ctx positions)."""
        return max(self.rings)

    @property
    def kv_nbytes(self) -> int:
        return sum(a.nbytes for a in (*self.k, *self.v))

    @property
    def nbytes(self) -> int:
        return self.kv_nbytes + self.rope_cos.nbytes + self.rope_sin.nbytes + sum(
            m.nbytes for m in self._masks.values()) + sum(t.nbytes for p in self.rope_extra.values() for t in p)

    def reset(self) -> None:
        """Forget every position (the arrays stay allocated; stale rows are never read)."""
        self.tokens.clear()
        self._masks.clear()
        self.held_from, self._joined = [0] * len(self.held_from), None

    @property
    def first(self) -> int:
        """The oldest position every layer still holds (a pass cut short may have advanced some layers)."""
        return max(self.held_from)

    def first_visible(self, layer: int, position: int) -> int:
        """The oldest position a query at `position` reads in a ring layer (0 in a layer without a ring)."""
        return max(0, position - self.windows[layer] + 1) if self.rings[layer] else 0

    def reusable(self, n: int) -> int:
        """How many of the first n cached positions a next pass can build on: n (at most n_past), or 0 when a
        window ring no longer holds the positions a query at n reads (recompute from the start)."""
        n = min(n, self.n_past)
        return n if all(self.first_visible(i, n) >= h for i, h in enumerate(self.held_from)) else 0

    def truncate(self, n: int) -> None:
        """Keep only the first n positions (a shared prompt prefix, or a rollback of guessed tokens).
        A window ring refuses a position whose window it has overwritten (see `reusable`)."""
        if n < self.n_past and self.reusable(n) != n:
            raise TracelmError(f"cannot go back to position {n}: the KV window ring holds positions "
                               f"{self.first}.. only (ring of {self.ring} slots); recompute from the start")
        del self.tokens[n:]
        if n == 0:
            self.reset()

    def write(self, layer: int, start: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store k, v [T, n_head_kv, head_dim] at positions start..start+T-1 of one layer (q8_0: or their blocks,
        uint8 [T, n_head_kv, row bytes], as q8_0_blocks gives them)."""
        T, ring = k.shape[0], self.rings[layer]
        if self.kv_cache == "q8_0" and k.dtype != np.uint8:
            k, v = q8_0_blocks(k), q8_0_blocks(v)
        # rounded to the Cache's dtype as stored, so that a pass reads its own keys as a later one will
        if not ring:  # (an assignment rounds as astype does, without the copy)
            self.k[layer][:, start : start + T] = k.transpose(1, 0, 2)
            self.v[layer][:, start : start + T] = v.transpose(1, 0, 2)
            return
        k, v = (a.transpose(1, 0, 2).astype(self.kv_dtype, copy=False) for a in (k, v))
        lo, end = self.first_visible(layer, start), start + T
        self._joined = None
        if lo < self.held_from[layer]:
            raise RuntimeError(f"position {start} reads position {lo}, no longer held by layer {layer} "
                               f"(oldest {self.held_from[layer]})")
        if end - lo > ring:  # more than the slack: this pass reads the held positions joined with its own
            held_k, held_v = self._ring_views(layer, lo, start)
            self._joined = (layer, lo, end, np.concatenate((held_k, k), axis=1), np.concatenate((held_v, v), axis=1))
            k, v, start = k[:, -ring:], v[:, -ring:], max(start, end - ring)
        self._put(layer, start, k, v)
        self.held_from[layer] = max(self.held_from[layer], end - ring)

    def _put(self, layer: int, start: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store k, v [n_head_kv, n <= ring, head_dim] of positions start.. in their slots of a ring layer."""
        ring = self.rings[layer]
        for buf, new in ((self.k[layer], k), (self.v[layer], v)):
            n, s = new.shape[1], start % ring
            buf[:, s : s + n] = new  # each slot s also at s + ring (s + n <= 2 * ring)
            if s + n <= ring:
                buf[:, s + ring : s + n + ring] = new
            else:
                buf[:, s + ring :] = new[:, : ring - s]
                buf[:, : s + n - ring] = new[:, ring - s :]

    def _ring_views(self, layer: int, lo: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        s = lo % self.rings[layer]
        return self.k[layer][:, s : s + end - lo], self.v[layer][:, s : s + end - lo]

    def in_place_views(self, layer: int, lo: int, end: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Writable views of positions lo..end-1 of a layer that keeps its positions in place (no window ring), as
        keys_values gives them, for a pass that stores its own last positions there as it attends
        (kernels.attend_parts, rounding as `write` does); None for a ring layer: `write`, then `keys_values`."""
        if self.rings[layer]:
            return None
        return self.k[layer][:, lo:end], self.v[layer][:, lo:end]

    def in_place_layers(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Every layer's keys and values arrays ([n_head_kv, position, ...], as `in_place_views` slices them), for
        kernels.attend_layer on the layers that keep their positions in place (`rings[layer]` 0)."""
        return self.k, self.v

    def keys_values(self, layer: int, end: int, lo: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Read-only views of positions lo..end-1 of one layer: [n_head_kv, end - lo, head_dim] each (q8_0: uint8
        [n_head_kv, end - lo, row bytes], each position's blocks of the head dim side by side)."""
        ring = self.rings[layer]
        if not ring:
            k, v = self.k[layer][:, lo:end], self.v[layer][:, lo:end]
        elif self._joined is not None and self._joined[:3] == (layer, lo, end):
            k, v = self._joined[3:]
            self._joined = None
        elif lo >= self.held_from[layer] and end - lo <= ring:
            k, v = self._ring_views(layer, lo, end)
        else:
            raise RuntimeError(f"positions {lo}..{end - 1} are not all held by layer {layer}'s KV window ring "
                               f"(oldest {self.held_from[layer]}, {ring} slots)")
        k.flags.writeable = v.flags.writeable = False
        return k, v

    def rope_rows(self, start: int, T: int, base: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Rows start..start+T-1 of the RoPE tables (of `base` when it has its own tables)."""
        cos, sin = self.rope_extra.get(base, (self.rope_cos, self.rope_sin))
        return cos[start : start + T], sin[start : start + T]

    def window_mask(self, start: int, T: int, window: int) -> tuple[int, np.ndarray | None]:
        """For a layer that sees only the last `window` positions (query p sees keys k with p - k < window;
        window 0: every earlier position): the first key position lo it can see, and the additive mask
        [T, start+T-lo] of 0 / -inf over keys lo..start+T-1 (None when every one of them is visible)."""
        lo = max(0, start - window + 1) if window else 0
        if T == 1:
            return lo, None
        key = (start, T, window)
        mask = self._masks.get(key)
        if mask is None:
            q = np.arange(start, start + T)[:, None]
            k = np.arange(lo, start + T)[None, :]
            visible = (k <= q) & ((q - k < window) if window else True)
            mask = np.where(visible, np.float32(0), np.float32(-np.inf)).astype(np.float32)
            mask.flags.writeable = False
            if len(self._masks) > 8:
                self._masks.clear()
            if mask.nbytes <= MASK_KEEP_BYTES:  # a prompt's mask is rebuilt when asked again, not held
                self._masks[key] = mask
        return lo, mask

    def window_spans(self, start: int, T: int, window: int) -> tuple[int, np.ndarray]:
        """`window_mask` as spans: the first key position lo, and per query row t the columns k0..k1-1 of keys
        lo..start+T-1 it sees ([T, 2] int64; a causal or window mask leaves one contiguous run visible)."""
        lo = max(0, start - window + 1) if window else 0
        p = np.arange(start, start + T, dtype=np.int64)
        first = np.maximum(p - window + 1, lo) if window else np.full(T, lo, np.int64)
        return lo, np.stack([first - lo, p + 1 - lo], axis=1)

    def snapshot(self) -> CacheSnapshot:
        """The positions every layer holds, as a record to save (copies): each layer's keys/values from its
        oldest held position (0 in a layer without a ring) to n_past - 1. Positions a next pass could not build
        on (`reusable`) are left out: such a Cache is recomputed from the start anyway."""
        n = self.reusable(self.n_past)
        first = tuple(self.held_from[i] if self.rings[i] and n else 0 for i in range(len(self.rings)))
        kv = [self._ring_views(i, lo, n) if self.rings[i] else (self.k[i][:, :n], self.v[i][:, :n])
              for i, lo in enumerate(first)]
        return CacheSnapshot(tuple(self.tokens[:n]), first, tuple(np.array(k) for k, _ in kv),
                             tuple(np.array(v) for _, v in kv))

    def restore(self, snap: CacheSnapshot) -> None:
        """Hold a snapshot's positions again (the RoPE tables and masks are this Cache's own). A ring smaller
        than the snapshot's keeps the newest positions it has room for. A context shorter than the snapshot, or
        a layer that keeps every position where the snapshot has a ring's last ones, is refused (the Cache left
        as it was)."""
        n = len(snap.tokens)
        if n > self.n_ctx:
            raise TracelmError(f"the saved conversation holds {n} positions, more than the context of {self.n_ctx}")
        partial = [i for i, lo in enumerate(snap.first) if lo and not self.rings[i]]
        if partial:
            raise TracelmError(f"layer {partial[0]} keeps every position in this context of {self.n_ctx}, but only "
                               f"positions {snap.first[partial[0]]}.. were saved (a window ring's)")
        held = {a.dtype for a in (*snap.keys, *snap.values)} - {self.kv_dtype}
        if held:
            raise TracelmError(f"the saved conversation holds keys/values in {kv_name(held.pop())}, this Cache in "
                               f"{kv_name(self.kv_dtype)} (kv_cache): they would not give the same numbers")
        self.reset()
        for layer, lo in enumerate(snap.first):
            k, v = snap.keys[layer], snap.values[layer]
            ring = self.rings[layer]
            if not ring:
                self.k[layer][:, :n], self.v[layer][:, :n] = k, v
                continue
            cut = max(lo, n - ring)
            self._put(layer, cut, k[:, cut - lo :], v[:, cut - lo :])
            self.held_from[layer] = cut
        self.tokens.extend(snap.tokens)
    def buffer(self, name: str, shape: tuple[int, ...], dtype: type = np.float32) -> np.ndarray:
        """A scratch array of a pass (a stage's output, rewritten by the next pass: nothing may keep it). Arrays up
        to BUFFER_KEEP_BYTES are kept and reused, so a decode step allocates none; a prompt's are made anew."""
        key = (name, shape)
        a = self._buffers.get(key)
        if a is None:
            a = np.empty(shape, dtype)
            if a.nbytes <= BUFFER_KEEP_BYTES:
                if len(self._buffers) > 64:
                    self._buffers.clear()
                self._buffers[key] = a
        return a

    def commit(self, ids) -> None:
        """Record that positions n_past.. now hold the keys/values of `ids`."""
        self.tokens.extend(int(i) for i in ids)
