"""The graph: Embed -> [AttnNorm -> QKV -> (QKNorm) -> RoPE -> Attend -> OutProj -> (PostAttnNorm) -> FFNNorm
-> FFN -> (PostFFNNorm)] x L -> Norm -> Head.

`forward` sequences the stages for T new positions, writes their keys/values into the Cache and
returns logits. Every stage call goes through `call(stage, layer, fn, *args)`, which is either a
plain call or a Tracer's timed, logged call. Architecture variants are options of `ModelConfig`
(stages in parentheses run only when their option is on); a stage never sees the architecture name.

`forward_batch` runs the same graph over several sequences in one pass (server batching): each `Part` is
one sequence with its own Cache and stage-call hook. Their rows are stacked for every row-wise stage
(embed, norms, the weight products, RoPE with each row's own table row, the head), so the weights are read
once per pass for all of them; keys/values are written and attended per sequence, each in its own Cache.
A row's numbers do not depend on its neighbours (`linear` is bitwise row-invariant for up to GEMV_ROWS = 16 rows, the
other stages are row-wise), so a sequence's logits in a batch equal, bitwise, its logits run alone; and a
traced sequence's hook sees exactly the events a lone pass would give (its rows of each stacked stage).
`forward` is the batch of one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

import tracelm.kernels as kernels
from tracelm.pipeline.trace import Tracer
from tracelm.stages import attention, compiled, ffn, norm
from tracelm.stages.attention import out_proj, qkv, rope_tables
from tracelm.stages.embed import embed
from tracelm.stages.head import head
from tracelm.stages.linear import kernel_scratch_bytes, linear_into
from tracelm.state.cache import RING_SLACK, Cache, q8_0_blocks
from tracelm.state.model_config import ModelConfig
from tracelm.state.records import Heads, Hidden, Logits, ModelWeights, QMatrix

StageCall = Callable[..., Any]


def plain_call(stage: str, layer: int | None, fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


@attrs.frozen
class Route:
    """The stage functions a pass calls besides the weight products (which follow their weights: `linear`). The
    attend stage takes each query row's visible keys as a mask (numpy) or as spans (the kernels)."""

    rms_norm: Callable[..., Hidden]
    post_norm: Callable[..., Hidden]
    qk_norm: Callable[..., Heads]
    rope: Callable[..., Heads]
    attend: Callable[..., Hidden]
    ffn: Callable[..., Hidden]
    spans: bool  # attend takes spans (Cache.window_spans) instead of masks (Cache.window_mask)
    q8_0_blocks: Callable[[np.ndarray], np.ndarray]  # kv_cache q8_0: keys/values as the Cache stores them


REFERENCE = Route(norm.rms_norm, norm.post_norm, attention.qk_norm, attention.rope, attention.attend, ffn.ffn, False,
                  q8_0_blocks)
KERNELS = Route(compiled.rms_norm, compiled.post_norm, compiled.qk_norm, compiled.rope, compiled.attend,
                compiled.ffn, True, kernels.q8_0_blocks)


def route(w: ModelWeights) -> Route:
    """The kernels' route for weights held as the file's blocks (`compute: kernels`), numpy's for f32 ones."""
    return KERNELS if isinstance(w.output, QMatrix) else REFERENCE


def new_cache(cfg: ModelConfig, n_ctx: int, slack: int = RING_SLACK, kv_dtype: str = "f16") -> Cache:
    """A Cache for n_ctx positions (a window ring with `slack` when every layer has one window: see Cache), keys
    and values held in `kv_dtype` ("f32", "f16" or "q8_0")."""
    tables = lambda base: rope_tables(n_ctx, cfg.rope_dim, base, cfg.rope_mode, cfg.rope_freq_factors)  # noqa: E731
    cos, sin = tables(cfg.rope_base)
    bases = {cfg.layer_rope_base(i) for i in range(cfg.n_layer)} - {cfg.rope_base}
    return Cache(cfg, n_ctx, cos, sin, {b: tables(b) for b in bases}, slack, kv_dtype)


@attrs.frozen
class Part:
    """One sequence of a pass: its Cache, its T new token ids, and the hook its stage events go through."""

    cache: Cache
    ids: Sequence[int]
    call: StageCall = plain_call


def rows_of(out: Any, a: int, b: int, start: int) -> Any:
    """Rows a..b-1 of a stacked stage output, as the record a lone pass over those rows returns."""
    if isinstance(out, Heads):
        return Heads(out.q[a:b], out.k[a:b], out.v[a:b], start)
    if isinstance(out, Logits):
        return Logits(out.values[a:b], start)
    return Hidden(out.x[a:b], start)


class Batch:
    """The row layout of a pass: part j owns stacked rows bounds[j]..bounds[j+1]-1, the first at `starts[j]`."""

    def __init__(self, parts: Sequence[Part], starts: Sequence[int], sizes: Sequence[int]):
        self.parts, self.starts, self.sizes = parts, list(starts), list(sizes)
        self.bounds = np.cumsum([0, *sizes]).tolist()

    def call(self, stage: str, layer: int | None, fn: Callable[..., Any], *args: Any) -> Any:
        """A row-wise stage, run once over every part's rows; each traced part's hook gets its own rows."""
        if len(self.parts) == 1:
            return self.parts[0].call(stage, layer, fn, *args)
        out = fn(*args)
        for p, a, b, start in zip(self.parts, self.bounds, self.bounds[1:], self.starts, strict=False):
            if p.call is not plain_call:
                p.call(stage, layer, rows_of, out, a, b, start)
        return out

    def stack(self, arrays: Sequence[np.ndarray]) -> np.ndarray:
        return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)

    def last_rows(self, h: Hidden) -> tuple[Batch, Hidden]:
        """The layout and rows of each part's last position (the only logits a decode step needs)."""
        ends = self.bounds[1:]
        last = Batch(self.parts, [s + n - 1 for s, n in zip(self.starts, self.sizes, strict=True)], [1] * len(ends))
        x = h.x[-1:] if len(ends) == 1 else h.x[[e - 1 for e in ends]]
        return last, Hidden(x, last.starts[0])

    def split(self, out: Logits | Hidden) -> list[Any]:
        """Each part's rows of a stacked output (logits, or the final hidden state)."""
        if len(self.parts) == 1:
            return [out]
        return [rows_of(out, a, b, s) for a, b, s in zip(self.bounds, self.bounds[1:], self.starts, strict=False)]


def forward(cfg: ModelConfig, w: ModelWeights, cache: Cache, ids: Sequence[int], all_logits: bool = False,
            call: StageCall = plain_call, hidden: bool = False) -> Logits | Hidden:
    """Run T = len(ids) new positions (prefill: T > 1 in one batched pass; decode: T = 1).

    Returns logits of the last position, or of every position when all_logits; with `hidden`, the final hidden
    state instead (after output_norm; the head is not run): what embeddings pool.
    """
    return forward_batch(cfg, w, [Part(cache, ids, call)], all_logits, hidden)[0]


def forward_batch(cfg: ModelConfig, w: ModelWeights, parts: Sequence[Part], all_logits: bool = False,
                  hidden: bool = False) -> list[Logits] | list[Hidden]:
    """One pass over several sequences (see the module docstring): the logits of each part, in order (with
    `hidden`, each part's final hidden state, after output_norm)."""
    ids = [np.asarray(p.ids, dtype=np.int64) for p in parts]
    batch = Batch(parts, [p.cache.n_past for p in parts], [len(i) for i in ids])
    r = route(w)
    per_layer = layer_tables(cfg, batch, r.spans)
    h = batch.call("embed", None, embed, w.token_embd, batch.stack(ids), batch.starts[0], cfg.embd_scale)
    tracer = layer_note(parts)
    if r is KERNELS and tracer is not None:
        h = Hidden(fused_layers(cfg, w, batch, per_layer, h.x.copy(), tracer or None), h.start)
    else:
        h = staged_layers(cfg, w, batch, per_layer, r, h)
    if not all_logits:
        batch, h = batch.last_rows(h)
    x = batch.call("output_norm", None, r.rms_norm, h, w.output_norm, cfg.rms_eps)
    out = x if hidden else batch.call("head", None, head, x, w.output)
    for p, i in zip(parts, ids, strict=True):
        p.cache.commit(i)
    return batch.split(out)


def layer_note(parts: Sequence[Part]) -> Tracer | bool | None:
    """Whether a pass on the kernels may run its layers fused: False, yes, untraced (every hook a plain call); a
    Tracer, yes, traced (one sequence whose hook is a Tracer's call: it reads each stage's output as the fused pass
    computes it, the same bits the stage gives); None, no: stage by stage (any other hook, or several traced
    sequences, whose tracers each get their own rows)."""
    if all(p.call is plain_call for p in parts):
        return False
    tracer = getattr(parts[0].call, "__self__", None)
    return tracer if len(parts) == 1 and isinstance(tracer, Tracer) else None


def staged_layers(cfg: ModelConfig, w: ModelWeights, batch: Batch, per_layer: list, r: Route, h: Hidden) -> Hidden:
    """The layers stage by stage, each call through its part's hook (a traced run sees every stage's output)."""
    scale, eps, act, call = cfg.scale, cfg.rms_eps, cfg.ffn_act, batch.call
    for i, lw in enumerate(w.layers):
        cos, sin, windows = per_layer[i]
        x = call("attn_norm", i, r.rms_norm, h, lw.attn_norm, eps)
        heads = call("qkv", i, qkv, x, lw.wqkv, lw.bqkv, cfg.n_head, cfg.n_head_kv, cfg.head_dim)
        if cfg.qk_norm:
            heads = call("qk_norm", i, r.qk_norm, heads, lw.q_norm, lw.k_norm, eps)
        heads = call("rope", i, r.rope, heads, cos, sin, cfg.rope_mode)
        a = attend_each(batch, i, heads, windows, scale, r)
        if cfg.post_norms:
            o = call("out_proj", i, out_proj, a, lw.wo, None)
            h = call("post_attn_norm", i, r.post_norm, o, lw.post_attn_norm, eps, h)
        else:
            h = call("out_proj", i, out_proj, a, lw.wo, h)
        x = call("ffn_norm", i, r.rms_norm, h, lw.ffn_norm, eps)
        if cfg.post_norms:
            f = call("ffn", i, r.ffn, x, lw.w_gate_up, lw.w_down, None, act)
            h = call("post_ffn_norm", i, r.post_norm, f, lw.post_ffn_norm, eps, h)
        else:
            h = call("ffn", i, r.ffn, x, lw.w_gate_up, lw.w_down, h, act)
    return h


# A long pass's FFN runs up to FFN_ROWS rows at a time, half that where its [rows, 2 n_ff] and [rows, n_ff] float32
# buffers, a prompt's largest, would pass FFN_BYTES (a 7B's 256-token prompt: 58 MB whole, 29 MB at 128 rows: within
# the bench's RSS budget of the file + KV + 150 MB so). Each row's products depend on that row alone, so the bits are
# the same. The kernels tile up to 128 rows (the amx path's K-quants; 64 on the others): Qwen2.5-7B's prefill-256 on
# the amx path, 2 threads (`tracelm bench --compare`), 1.42x llama.cpp at 128 rows, 1.30x at 64; 16 MB more at peak.
FFN_ROWS = 128
FFN_BYTES = 32 << 20


def ffn_rows(n_ff: int) -> int:
    """Rows of a long pass's FFN at a time (FFN_ROWS, or half where its buffers would pass FFN_BYTES)."""
    return FFN_ROWS if 12 * n_ff * FFN_ROWS <= FFN_BYTES else FFN_ROWS // 2


def fused_layers(cfg: ModelConfig, w: ModelWeights, batch: Batch, per_layer: list, h: np.ndarray,
                 tracer: Tracer | None = None) -> np.ndarray:
    """The layers of a pass on the kernels: the KERNELS route's kernel calls, in its order, on the same
    numbers -- so the same bits (a test holds it) -- straight into the Cache's reused buffers, with no stage
    records or hooks between them (a decode step of a small model is otherwise mostly Python). The residual
    stream h [T, d] is updated in place. `tracer` (a traced pass of one sequence) is given each stage's output arrays
    as the stage would return them, once (Tracer.bind: buffers rewritten in place, the same at every layer), and
    `note` holds a stage's event as soon as its output is complete."""
    cache, (T, d), start = batch.parts[0].cache, h.shape, batch.starts[0]
    eps, hd, H, Hkv = cfg.rms_eps, cfg.head_dim, cfg.n_head, cfg.n_head_kv
    q_dim, kv_dim, n_ff = H * hd, Hkv * hd, w.layers[0].w_down.shape[1]
    x, o = cache.buffer("x", (T, d)), cache.buffer("o", (T, d))
    qkv_out, a = cache.buffer("qkv", (T, q_dim + 2 * kv_dim)), cache.buffer("attend", (T, q_dim))
    c = min(T, ffn_rows(n_ff))
    gate_up, ff = cache.buffer("gate_up", (c, 2 * n_ff)), cache.buffer("ffn", (c, n_ff))
    scratch = cache.buffer("scratch", (max(*(kernel_scratch_bytes(T, m) for m in (w.layers[0].wqkv, w.layers[0].wo)),
                                           *(kernel_scratch_bytes(c, m) for m in (w.layers[0].w_gate_up,
                                                                                  w.layers[0].w_down))),), np.uint8)
    act, scale = compiled.ACTIVATIONS[cfg.ffn_act], cfg.scale
    q = qkv_out[:, :q_dim].reshape(T, H, hd)
    k, v = (qkv_out[:, q_dim + j * kv_dim : q_dim + (j + 1) * kv_dim].reshape(T, Hkv, hd) for j in (0, 1))
    post = cfg.post_norms
    note = tracer and tracer.bind(start, {"attn_norm": (x,), "qkv": (q, k, v), "qk_norm": (q, k, v),
                                          "rope": (q, k, v), "attend": (a,), "out_proj": (o,) if post else (h,),
                                          "post_attn_norm": (h,), "ffn_norm": (x,), "ffn": (o,) if post else (h,),
                                          "post_ffn_norm": (h,)})
    rows = part_rows(batch, q, k, v, a)
    # a layer every part keeps in place attends in one call per pass's parts (kernels.attend_layer); else per part
    whole = [(q_p, *c.in_place_layers(), end, a_p, k_p, v_p) for c, _first, end, q_p, k_p, v_p, a_p in rows]
    in_place = [not any(r) for r in zip(*(p.cache.rings for p in batch.parts), strict=True)]
    for i, lw in enumerate(w.layers):
        cos, sin, windows = per_layer[i]
        kernels.rms_norm(h, lw.attn_norm, eps, out=x)
        note and note("attn_norm", i)
        linear_into(x, lw.wqkv, qkv_out, scratch)
        if lw.bqkv is not None:
            qkv_out += lw.bqkv
        note and note("qkv", i)
        if cfg.qk_norm:
            kernels.rms_norm(q, lw.q_norm, eps, out=q)
            kernels.rms_norm(k, lw.k_norm, eps, out=k)
            note and note("qk_norm", i)
        kernels.rope(q, cos, sin, cfg.rope_mode, out=q)
        kernels.rope(k, cos, sin, cfg.rope_mode, out=k)
        note and note("rope", i)
        if in_place[i]:
            kernels.attend_layer(whole, i, windows, scale)
        else:
            kernels.attend_parts([attend_part(i, row, lo, spans) for row, (lo, spans) in zip(rows, windows,
                                                                                             strict=True)], scale)
        note and note("attend", i)
        linear_into(a, lw.wo, o, scratch)
        note and cfg.post_norms and note("out_proj", i)
        residual_add(o, h, lw.post_attn_norm if cfg.post_norms else None, eps)
        note and note("post_attn_norm" if cfg.post_norms else "out_proj", i)
        kernels.rms_norm(h, lw.ffn_norm, eps, out=x)
        note and note("ffn_norm", i)
        for r0 in range(0, T, c):  # the FFN c rows at a time (ffn_rows)
            n = min(c, T - r0)
            linear_into(x[r0 : r0 + n], lw.w_gate_up, gate_up[:n], scratch)
            linear_into(act(gate_up[:n], n_ff, out=ff[:n]), lw.w_down, o[r0 : r0 + n], scratch)
        note and cfg.post_norms and note("ffn", i)
        residual_add(o, h, lw.post_ffn_norm if cfg.post_norms else None, eps)
        note and note("post_ffn_norm" if cfg.post_norms else "ffn", i)
    tracer and tracer.unbind()
    return h


def part_rows(batch: Batch, q: np.ndarray, k: np.ndarray, v: np.ndarray, a: np.ndarray) -> list[tuple]:
    """Per part of a fused pass, what its attend step takes in every layer: its Cache, its first position, the
    position after its last, and its rows of q, k, v and of attend's output (views made once per pass)."""
    return [(p.cache, start, start + hi - lo, q[lo:hi], k[lo:hi], v[lo:hi], a[lo:hi])
            for p, lo, hi, start in zip(batch.parts, batch.bounds, batch.bounds[1:], batch.starts, strict=False)]


def attend_part(i: int, row: tuple, lo: int, spans: np.ndarray) -> tuple:
    """A part's attend of layer i for kernels.attend_parts: its new keys/values stored by the call itself where its
    Cache keeps positions in place, else written first (a window ring's bookkeeping)."""
    c, first, end, q_p, k_p, v_p, a_p = row
    in_place = c.in_place_views(i, lo, end)
    if in_place is not None:
        return (q_p, *in_place, spans, a_p, k_p, v_p)
    c.write(i, first, *stored(c, k_p, v_p, KERNELS))
    return (q_p, *c.keys_values(i, end, lo), spans, a_p)


def residual_add(y: np.ndarray, h: np.ndarray, post_norm: np.ndarray | None, eps: float) -> None:
    """h = y + h, or h = RMSNorm(y) * post_norm + h (gemma's post-norms): out_proj's and ffn's residual, in place."""
    if post_norm is None:
        np.add(y, h, out=h)
    else:
        kernels.rms_norm_add(y, post_norm, eps, h, out=h)


def layer_tables(cfg: ModelConfig, batch: Batch, spans: bool = False
                 ) -> list[tuple[np.ndarray, np.ndarray, list[tuple[int, Any]]]]:
    """Per layer: the RoPE cos/sin rows of every stacked row, and per part (first visible key, mask) -- or
    (first visible key, spans) when `spans` -- looked up once per layer kind (window, RoPE base)."""
    kinds: dict[tuple[int, float], tuple] = {}
    per_layer = []
    for i in range(cfg.n_layer):
        kind = (cfg.window(i), cfg.layer_rope_base(i))
        if kind not in kinds:
            caches = [(p.cache, s, n) for p, s, n in zip(batch.parts, batch.starts, batch.sizes, strict=True)]
            rows = [c.rope_rows(s, n, kind[1]) for c, s, n in caches]
            kinds[kind] = (batch.stack([r[0] for r in rows]), batch.stack([r[1] for r in rows]),
                           [(c.window_spans if spans else c.window_mask)(s, n, kind[0]) for c, s, n in caches])
        per_layer.append(kinds[kind])
    return per_layer


def stored(cache: Cache, k: np.ndarray, v: np.ndarray, r: Route) -> tuple[np.ndarray, np.ndarray]:
    """k, v as `cache.write` takes them: kv_cache q8_0's blocks made by the route (numpy's or the kernels' q8_0_blocks:
    the same bytes), the float dtypes as they are (the Cache rounds them as it stores them)."""
    return (r.q8_0_blocks(k), r.q8_0_blocks(v)) if cache.kv_cache == "q8_0" else (k, v)


def attend_each(batch: Batch, i: int, heads: Heads, windows: list[tuple[int, Any]], scale: float,
                r: Route = REFERENCE) -> Hidden:
    """Write each part's keys/values of layer i into its Cache and attend over that Cache alone (the route's attend)."""
    outs = []
    for p, a, b, start, (lo, mask) in zip(batch.parts, batch.bounds, batch.bounds[1:], batch.starts, windows,
                                          strict=False):
        q, k, v = (heads.q, heads.k, heads.v) if len(batch.parts) == 1 else (heads.q[a:b], heads.k[a:b], heads.v[a:b])
        p.cache.write(i, start, *stored(p.cache, k, v, r))
        keys, values = p.cache.keys_values(i, start + b - a, lo)
        outs.append(p.call("attend", i, r.attend, q, keys, values, mask, scale, start))
    return outs[0] if len(outs) == 1 else Hidden(np.concatenate([o.x for o in outs]), batch.starts[0])
