"""Bounds decided before allocating: a context within the model's trained one (or what an explicit RoPE scale
stretches it to), and a KV cache plus weights within the memory the machine has available."""

from __future__ import annotations

from tracelm.state.cache import RING_SLACK, kv_row_bytes
from tracelm.state.errors import ResourceError
from tracelm.state.model_config import ModelConfig

MEMINFO = "/proc/meminfo"


def kv_cache_bytes(cfg: ModelConfig, n_ctx: int, slack: int = RING_SLACK, kv_dtype: str = "f16") -> int:
    """The bytes a Cache of n_ctx positions allocates up front: keys and values of every layer (a windowed layer's
    ring of 2 x (window - 1 + slack) slots when that is smaller) in `kv_dtype` (q8_0: 34 bytes per 32 values), plus
    the RoPE tables of each base."""
    width = kv_row_bytes(kv_dtype, cfg.head_dim)
    total = 0
    for layer in range(cfg.n_layer):
        window = cfg.window(layer)
        ring = window - 1 + max(1, slack) if window else 0
        slots = 2 * ring if 0 < 2 * ring < n_ctx else n_ctx
        total += 2 * cfg.n_head_kv * slots * width
    bases = {cfg.layer_rope_base(i) for i in range(cfg.n_layer)}
    return total + len(bases) * 2 * n_ctx * cfg.rope_dim * 4


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is no such file)."""
    try:
        with open(MEMINFO, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def mib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def check_context(cfg: ModelConfig, n_ctx: int, rope_scale: float = 1.0, model: str = "the model") -> None:
    """A ResourceError unless n_ctx fits the trained context, stretched by `rope_scale` (linear RoPE scaling)."""
    limit = int(cfg.n_ctx_train * rope_scale)
    if n_ctx > limit:
        need = n_ctx / cfg.n_ctx_train
        raise ResourceError(f"context {n_ctx} exceeds {model}'s trained context of {cfg.n_ctx_train} positions"
                            + (f" x rope_scale {rope_scale:g}" if rope_scale != 1.0 else "")
                            + f"; use a context <= {limit}, or set rope_scale >= {need:.4g} to stretch RoPE "
                            "linearly (the model then runs beyond what it was trained on)")


def check_memory(cfg: ModelConfig, n_ctx: int, weights_bytes: int = 0, slack: int = RING_SLACK,
                 kv_dtype: str = "f16") -> None:
    """A ResourceError, with the estimate, unless the KV cache of n_ctx positions plus `weights_bytes` still to be
    allocated fit in MemAvailable (no check where the machine does not say)."""
    free = available_memory()
    if free is None:
        return
    kv = kv_cache_bytes(cfg, n_ctx, slack, kv_dtype)
    if kv + weights_bytes > free:
        weights = f" + {mib(weights_bytes)} of weights" if weights_bytes else ""
        raise ResourceError(f"context {n_ctx} needs about {mib(kv)} of KV cache{weights}, more than the "
                            f"{mib(free)} of memory available (MemAvailable); use a smaller context")


def check_run(cfg: ModelConfig, context: int, rope_scale: float, weights_bytes: int, model: str,
              kv_dtype: str = "f16") -> None:
    """Before a model's weights load: its context against the trained one and, with the weights, against memory."""
    check_context(cfg, context, rope_scale, model)
    check_memory(cfg, context, weights_bytes, kv_dtype=kv_dtype)
