"""llama2.c checkpoints (Karpathy's `run.c` format, the legacy version 0 header) -> ModelConfig, weights.

Header: 7 little-endian int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len); a
negative vocab_size means the classifier is a separate matrix at the end, a positive one that it is the
embedding table. Then f32 arrays, each stacked over the layers and [out, in] row-major:
token_embedding [vocab, dim], rms_att [L, dim], wq [L, dim, dim], wk [L, kv_dim, dim], wv [L, kv_dim, dim],
wo [L, dim, dim], rms_ffn [L, dim], w1 (gate) [L, hidden, dim], w2 (down) [L, dim, hidden],
w3 (up) [L, hidden, dim], rms_final [dim], two unused RoPE tables [seq_len, head_size / 2] each, and
wcls [vocab, dim] when not shared. run.c's RoPE rotates adjacent pairs with base 10000, RMSNorm eps 1e-5.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from tracelm.io.weights import aligned_f32, packed, packed_values
from tracelm.state.errors import TracelmError
from tracelm.state.model_config import ModelConfig
from tracelm.state.records import LayerWeights, ModelWeights

HEADER = struct.Struct("<7i")
FIELDS = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len")


class Llama2cFile:
    """An opened llama2.c checkpoint: its header as a ModelConfig and its f32 arrays memory-mapped."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.name = self.path.name
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(HEADER.size)
        except OSError as e:
            raise TracelmError(f"{self.path}: cannot open model file: {e.strerror}") from None
        if len(head) < HEADER.size:
            raise TracelmError(f"{self.name}: not a llama2.c checkpoint (only {size} bytes, the header needs 28)")
        h = dict(zip(FIELDS, HEADER.unpack(head), strict=True))
        self.header = h
        self.shared = h["vocab_size"] > 0
        vocab = abs(h["vocab_size"])
        for k in FIELDS:
            if (abs(h[k]) if k == "vocab_size" else h[k]) <= 0:
                raise TracelmError(f"{self.name}: llama2.c header field {k} is {h[k]}, not a positive size")
        dim, hidden, L, nh, nkv, seq = (h[k] for k in ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads",
                                                        "seq_len"))
        if dim % nh or nh % nkv:
            raise TracelmError(f"{self.name}: llama2.c header: dim {dim}, n_heads {nh}, n_kv_heads {nkv} do not divide")
        hs = dim // nh
        kv = nkv * hs
        self.layout = [("token_embd", (vocab, dim)), ("rms_att", (L, dim)), ("wq", (L, dim, dim)),
                       ("wk", (L, kv, dim)), ("wv", (L, kv, dim)), ("wo", (L, dim, dim)), ("rms_ffn", (L, dim)),
                       ("w1", (L, hidden, dim)), ("w2", (L, dim, hidden)), ("w3", (L, hidden, dim)),
                       ("rms_final", (dim,)), ("freq_cis", (2, seq, hs // 2))]
        if not self.shared:
            self.layout.append(("wcls", (vocab, dim)))
        expected = HEADER.size + 4 * sum(int(np.prod(s)) for _, s in self.layout)
        if size != expected:
            fields = ", ".join(f"{k} {h[k]}" for k in FIELDS)
            raise TracelmError(f"{self.name}: file has {size} bytes, its llama2.c header ({fields}) needs {expected}")
        try:
            self.cfg = ModelConfig(
                arch="llama2c", n_vocab=vocab, n_embd=dim, n_layer=L, n_head=nh, n_head_kv=nkv, head_dim=hs,
                n_ff=hidden, rope_base=10000.0, rope_dim=hs, rope_mode="adjacent", rms_eps=1e-5, n_ctx_train=seq,
                tied_head=self.shared)
        except ValueError as e:
            raise TracelmError(f"{self.name}: {e}") from None
        self.metadata = {"general.architecture": "llama2c", **{f"llama2c.{k}": v for k, v in h.items()}}

    def arrays(self) -> dict[str, np.ndarray]:
        """Every array of the file by its llama2.c name, memory-mapped read-only."""
        mm = np.memmap(self.path, np.dtype("<f4"), mode="r", offset=HEADER.size)
        out, pos = {}, 0
        for name, shape in self.layout:
            n = int(np.prod(shape))
            out[name] = mm[pos : pos + n].reshape(shape)
            pos += n
        return out


# LayerWeights fields -> the checkpoint arrays stacked row after row into them
FUSED = {"attn_norm": ("rms_att",), "wqkv": ("wq", "wk", "wv"), "wo": ("wo",), "ffn_norm": ("rms_ffn",),
         "w_gate_up": ("w1", "w3"), "w_down": ("w2",)}


def load_weights(lf: Llama2cFile) -> ModelWeights:
    """The checkpoint's arrays as resident f32 ModelWeights (q/k/v and gate/up fused per block), every block
    in one aligned arena (as the GGUF loader lays them out)."""
    a = lf.arrays()
    f32 = lambda x: np.array(x, np.float32)  # noqa: E731 - a resident copy
    shapes = {f: (sum(a[n].shape[1] for n in names), *a[names[0]].shape[2:]) for f, names in FUSED.items()}
    block = packed_values(list(shapes.values()))
    arena, layers = aligned_f32(lf.cfg.n_layer * block), []
    for i in range(lf.cfg.n_layer):
        views = packed(arena[i * block : (i + 1) * block], shapes)
        layers.append(LayerWeights(**{f: np.concatenate([a[n][i] for n in names], out=views[f])
                                      for f, names in FUSED.items()}))
    embd = f32(a["token_embd"])
    output = embd if lf.shared else f32(a["wcls"])
    return ModelWeights(token_embd=embd, layers=tuple(layers), output_norm=f32(a["rms_final"]), output=output)
