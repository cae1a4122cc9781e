"""The graph: Embed -> [AttnNorm -> QKV -> (QKNorm) -> RoPE -> Attend -> OutProj -> (PostAttnNorm) -> FFNNorm
-> FFN -> (PostFFNNorm)] x L -> Norm -> Head.

`forward` sequences the stages for T new positions, writes their keys/values into the Cache and
returns logits. Every stage call goes through `call(stage, layer, fn, *args)`, which is either a
plain call or a Tracer's timed, logged call. Architecture variants are options of `ModelConfig`
(stages in parentheses run only when their option is on); a stage never sees the architecture name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tracelm.stages.attention import attend, out_proj, qk_norm, qkv, rope, rope_tables
from tracelm.stages.embed import embed
from tracelm.stages.ffn import ffn
from tracelm.stages.head import head
from tracelm.stages.norm import post_norm, rms_norm
from tracelm.state.cache import Cache
from tracelm.state.model_config import ModelConfig
from tracelm.state.records import Hidden, Logits, ModelWeights

StageCall = Callable[..., Any]


def plain_call(stage: str, layer: int | None, fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def new_cache(cfg: ModelConfig, n_ctx: int) -> Cache:
    tables = lambda base: rope_tables(n_ctx, cfg.rope_dim, base, cfg.rope_mode, cfg.rope_freq_factors)  # noqa: E731
    cos, sin = tables(cfg.rope_base)
    bases = {cfg.layer_rope_base(i) for i in range(cfg.n_layer)} - {cfg.rope_base}
    return Cache(cfg, n_ctx, cos, sin, {b: tables(b) for b in bases})


def forward(cfg: ModelConfig, w: ModelWeights, cache: Cache, ids: Sequence[int], all_logits: bool = False,
            call: StageCall = plain_call) -> Logits:
    """Run T = len(ids) new positions (prefill: T > 1 in one batched pass; decode: T = 1).

    Returns logits of the last position, or of every position when all_logits.
    """
    ids = np.asarray(ids, dtype=np.int64)
    start, T = cache.n_past, len(ids)
    # per layer kind (window, rope base): the RoPE rows, the first visible key and the mask
    kinds: dict[tuple[int, float], tuple] = {}
    per_layer = []
    for i in range(cfg.n_layer):
        kind = (cfg.window(i), cfg.layer_rope_base(i))
        if kind not in kinds:
            kinds[kind] = (*cache.rope_rows(start, T, kind[1]), *cache.window_mask(start, T, kind[0]))
        per_layer.append(kinds[kind])
    scale, eps, act = cfg.scale, cfg.rms_eps, cfg.ffn_act
    h = call("embed", None, embed, w.token_embd, ids, start, cfg.embd_scale)
    for i, lw in enumerate(w.layers):
        cos, sin, lo, mask = per_layer[i]
        x = call("attn_norm", i, rms_norm, h, lw.attn_norm, eps)
        heads = call("qkv", i, qkv, x, lw.wqkv, lw.bqkv, cfg.n_head, cfg.n_head_kv, cfg.head_dim)
        if cfg.qk_norm:
            heads = call("qk_norm", i, qk_norm, heads, lw.q_norm, lw.k_norm, eps)
        heads = call("rope", i, rope, heads, cos, sin, cfg.rope_mode)
        cache.write(i, start, heads.k, heads.v)
        keys, values = cache.keys_values(i, start + T, lo)
        a = call("attend", i, attend, heads.q, keys, values, mask, scale, start)
        if cfg.post_norms:
            o = call("out_proj", i, out_proj, a, lw.wo, None)
            h = call("post_attn_norm", i, post_norm, o, lw.post_attn_norm, eps, h)
        else:
            h = call("out_proj", i, out_proj, a, lw.wo, h)
        x = call("ffn_norm", i, rms_norm, h, lw.ffn_norm, eps)
        if cfg.post_norms:
            f = call("ffn", i, ffn, x, lw.w_gate_up, lw.w_down, None, act)
            h = call("post_ffn_norm", i, post_norm, f, lw.post_ffn_norm, eps, h)
        else:
            h = call("ffn", i, ffn, x, lw.w_gate_up, lw.w_down, h, act)
    if not all_logits:
        h = Hidden(h.x[-1:], start + T - 1)
    x = call("output_norm", None, rms_norm, h, w.output_norm, eps)
    logits = call("head", None, head, x, w.output)
    cache.commit(ids)
    return logits
