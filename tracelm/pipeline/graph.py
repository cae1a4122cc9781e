"""The graph: Embed -> [AttnNorm -> QKV -> RoPE -> Attend -> OutProj -> FFNNorm -> FFN] x L -> Norm -> Head.

`forward` sequences the stages for T new positions, writes their keys/values into the Cache and
returns logits. Every stage call goes through `call(stage, layer, fn, *args)`, which is either a
plain call or a Tracer's timed, logged call.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tracelm.stages.attention import attend, out_proj, qkv, rope, rope_tables
from tracelm.stages.embed import embed
from tracelm.stages.ffn import ffn
from tracelm.stages.head import head
from tracelm.stages.norm import rms_norm
from tracelm.state.cache import Cache
from tracelm.state.model_config import ModelConfig
from tracelm.state.records import Hidden, Logits, ModelWeights

StageCall = Callable[..., Any]


def plain_call(stage: str, layer: int | None, fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def new_cache(cfg: ModelConfig, n_ctx: int) -> Cache:
    cos, sin = rope_tables(n_ctx, cfg.rope_dim, cfg.rope_base, cfg.rope_mode)
    return Cache(cfg, n_ctx, cos, sin)


def forward(cfg: ModelConfig, w: ModelWeights, cache: Cache, ids: Sequence[int], all_logits: bool = False,
            call: StageCall = plain_call) -> Logits:
    """Run T = len(ids) new positions (prefill: T > 1 in one batched pass; decode: T = 1).

    Returns logits of the last position, or of every position when all_logits.
    """
    ids = np.asarray(ids, dtype=np.int64)
    start, T = cache.n_past, len(ids)
    cos, sin = cache.rope_rows(start, T)
    mask = cache.causal_mask(start, T)
    scale = 1.0 / math.sqrt(cfg.head_dim)
    eps = cfg.rms_eps
    h = call("embed", None, embed, w.token_embd, ids, start)
    for i, lw in enumerate(w.layers):
        x = call("attn_norm", i, rms_norm, h, lw.attn_norm, eps)
        heads = call("qkv", i, qkv, x, lw.wqkv, lw.bqkv, cfg.n_head, cfg.n_head_kv, cfg.head_dim)
        heads = call("rope", i, rope, heads, cos, sin, cfg.rope_mode)
        cache.write(i, start, heads.k, heads.v)
        keys, values = cache.keys_values(i, start + T)
        a = call("attend", i, attend, heads.q, keys, values, mask, scale, start)
        h = call("out_proj", i, out_proj, a, lw.wo, h)
        x = call("ffn_norm", i, rms_norm, h, lw.ffn_norm, eps)
        h = call("ffn", i, ffn, x, lw.w_gate_up, lw.w_down, h)
    if not all_logits:
        h = Hidden(h.x[-1:], start + T - 1)
    x = call("output_norm", None, rms_norm, h, w.output_norm, eps)
    logits = call("head", None, head, x, w.output)
    cache.commit(ids)
    return logits
