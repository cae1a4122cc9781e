"""Validate tracelm against a reference implementation (Hugging Face transformers) on the same weights.

For each prompt: tracelm decodes 32 greedy tokens; then both implementations run the prompt plus
those tokens (but the last) in one pass, and every layer's hidden state is compared (MSE, the lowest
cosine similarity over positions, max |diff|), then the final logits. The greedy tokens match when
the reference's argmax at every generated position is tracelm's token (teacher forcing gives exactly
the reference's own greedy continuation when they agree).

Rows: `embed` (the scaled embedding), `layer i` (the residual stream after block i) for every block
but the last, whose output is compared after the final norm (`layer L-1 + output_norm`), as
transformers reports it, then `logits`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from tracelm.pipeline.graph import forward, new_cache
from tracelm.state.errors import TracelmError
from tracelm.state.records import Hidden

COSINE_MIN = 0.9999  # every layer, every position
KV = "f32"  # the math against the reference's: keys and values kept as computed (kv_cache f16 rounds them)
# --compute kernels: positions whose argmax is the numpy reference's, at least (int16 activations, the default).
# With int8 activations (llama.cpp's precision) the bar is llama.cpp's own on DEFAULT_PROMPTS, 32 greedy tokens
# each (llama-cpp-python 0.3.36: SmolLM2-135M Q4_1 117 of 123 = 0.951, Gemma 3 270M 125 of 128).
KERNELS_ARGMAX_MIN = 0.98
KERNELS_ARGMAX_MIN_INT8 = 0.95
DEFAULT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, there was a",
)


@attrs.frozen
class Row:
    name: str
    mse: float
    cosine: float  # the lowest over positions
    max_abs: float
    ok: bool


@attrs.frozen
class PromptReport:
    prompt: str
    n_prompt: int
    rows: tuple[Row, ...]
    argmax_match: bool  # logits argmax identical at every position
    greedy_ours: tuple[int, ...]
    greedy_ref: tuple[int, ...]  # the reference's argmax at each generated position
    # --compute kernels: the kernels' logits against tracelm's numpy reference (`compute: reference`) on the
    # same positions: the share of positions with the same argmax, and max |diff|
    kernels_argmax: float | None = None
    kernels_max_abs: float | None = None

    @property
    def greedy_match(self) -> bool:
        return self.greedy_ours == self.greedy_ref

    @property
    def first_divergent(self) -> str | None:
        return next((r.name for r in self.rows if not r.ok), None)

    @property
    def ok(self) -> bool:
        kernels_ok = self.kernels_argmax is None or self.kernels_argmax >= KERNELS_ARGMAX_MIN
        return all(r.ok for r in self.rows) and self.argmax_match and self.greedy_match and kernels_ok


def compare(name: str, ours: np.ndarray, ref: np.ndarray, cos_min: float = COSINE_MIN) -> Row:
    a, b = ours.astype(np.float64), ref.astype(np.float64)
    if a.shape != b.shape:
        raise TracelmError(f"validate: {name}: tracelm shape {list(a.shape)} vs reference {list(b.shape)}")
    diff = a - b
    na, nb = np.linalg.norm(a, axis=-1), np.linalg.norm(b, axis=-1)
    cos = np.einsum("ti,ti->t", a, b) / np.maximum(na * nb, 1e-300)
    cos = np.where((na == 0) & (nb == 0), 1.0, cos)
    mse, cmin, mabs = float(np.mean(diff**2)), float(cos.min()), float(np.abs(diff).max())
    return Row(name, mse, cmin, mabs, bool(cmin >= cos_min and np.isfinite(mse)))


def tracelm_states(model: Any, ids: Sequence[int]) -> tuple[list[np.ndarray], np.ndarray]:
    """The hidden states tracelm computes for `ids` (rows as in the module docstring) and the logits."""
    cfg = model.cfg
    last = "post_ffn_norm" if cfg.post_norms else "ffn"
    states: list[np.ndarray] = []

    def call(stage: str, layer: int | None, fn: Any, *args: Any) -> Any:
        out = fn(*args)
        if stage in ("embed", last, "output_norm") and isinstance(out, Hidden):
            states.append(np.array(out.x))
        return out

    logits = forward(cfg, model.weights, new_cache(cfg, len(ids), kv_dtype=KV), ids, True, call)
    del states[-2]  # the last block's raw output: transformers reports it after the final norm
    return states, np.asarray(logits.values)


def greedy(model: Any, ids: Sequence[int], n: int) -> list[int]:
    """n greedy tokens (argmax, no stop on end-of-generation ids)."""
    cfg = model.cfg
    cache = new_cache(cfg, len(ids) + n, kv_dtype=KV)
    logits = forward(cfg, model.weights, cache, ids)
    out = []
    for step in range(n):
        out.append(int(np.argmax(logits.values[-1])))
        if step + 1 < n:
            logits = forward(cfg, model.weights, cache, [out[-1]])
    return out


class TransformersReference:
    """transformers' AutoModelForCausalLM in f32 on the same file: a GGUF (dequantized by transformers)
    or a Hugging Face folder."""

    def __init__(self, path: str | os.PathLike):
        try:
            import torch
            from transformers import AutoModelForCausalLM
        except ImportError:
            raise TracelmError("validate: --reference transformers needs transformers and torch "
                               "(pip install 'tracelm[reference]')") from None
        self.torch = torch
        path = Path(path)
        if path.is_dir():
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        elif path.suffix == ".gguf":
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                         dtype=torch.float32)
        else:
            raise TracelmError(f"validate: {path.name}: transformers reads GGUF files and Hugging Face folders only")
        self.model = model.eval()

    def states(self, ids: Sequence[int]) -> tuple[list[np.ndarray], np.ndarray]:
        with self.torch.no_grad():
            out = self.model(self.torch.tensor([list(ids)]), output_hidden_states=True)
        return [h[0].float().numpy() for h in out.hidden_states], out.logits[0].float().numpy()


def validate_prompt(model: Any, ref: Any, prompt: str, ids: Sequence[int], n_tokens: int = 32,
                    numpy_model: Any = None) -> PromptReport:
    """`numpy_model`: the same model on `compute: reference`, which `model` (on the kernels) is compared with."""
    ids = [int(i) for i in ids]
    if not ids:
        raise TracelmError(f"validate: prompt {prompt!r} encodes to no tokens")
    gen = greedy(model, ids, n_tokens)
    seq = ids + gen[:-1]
    ours, our_logits = tracelm_states(model, seq)
    theirs, ref_logits = ref.states(seq)
    if len(ours) != len(theirs):
        raise TracelmError(f"validate: tracelm has {len(ours)} hidden states, the reference {len(theirs)}")
    L = model.cfg.n_layer
    names = ["embed", *(f"layer {i}" for i in range(L - 1)), f"layer {L - 1} + output_norm"]
    rows = [compare(n, a, b) for n, a, b in zip(names, ours, theirs, strict=True)]
    rows.append(compare("logits", our_logits, ref_logits))
    kernels = {}
    if numpy_model is not None:
        _, numpy_logits = tracelm_states(numpy_model, seq)
        kernels = {"kernels_argmax": float(np.mean(our_logits.argmax(-1) == numpy_logits.argmax(-1))),
                   "kernels_max_abs": float(np.abs(our_logits - numpy_logits).max())}
    return PromptReport(
        prompt=prompt,
        n_prompt=len(ids),
        rows=tuple(rows),
        argmax_match=bool((our_logits.argmax(-1) == ref_logits.argmax(-1)).all()),
        greedy_ours=tuple(gen),
        greedy_ref=tuple(int(t) for t in ref_logits[len(ids) - 1 :].argmax(-1)),
        **kernels,
    )


def format_report(rep: PromptReport) -> str:
    lines = [f"prompt {rep.prompt!r} ({rep.n_prompt} tokens + {len(rep.greedy_ours) - 1} generated)",
             f"  {'':28s} {'mse':>11s} {'min cosine':>12s} {'max |diff|':>11s}"]
    for r in rep.rows:
        lines.append(f"  {r.name:28s} {r.mse:11.3e} {r.cosine:12.8f} {r.max_abs:11.3e}{'' if r.ok else '  DIVERGES'}")
    lines.append(f"  logits argmax identical at every position: {'yes' if rep.argmax_match else 'NO'}")
    n_same = next((i for i, (a, b) in enumerate(zip(rep.greedy_ours, rep.greedy_ref, strict=True)) if a != b),
                  len(rep.greedy_ours))
    lines.append(f"  {len(rep.greedy_ours)} greedy tokens identical: "
                 f"{'yes' if rep.greedy_match else f'NO (first difference at token {n_same})'}")
    if rep.kernels_argmax is not None:
        lines.append(f"  kernels vs numpy reference: argmax equal at {rep.kernels_argmax:.1%} of positions "
                     f"(>= {KERNELS_ARGMAX_MIN:.0%} needed), logits max |diff| {rep.kernels_max_abs:.3e}")
    if rep.first_divergent:
        lines.append(f"  first divergent: {rep.first_divergent}")
    lines.append(f"  {'OK' if rep.ok else 'FAIL'}")
    return "\n".join(lines)


def report_json(rep: PromptReport) -> dict[str, Any]:
    return {"prompt": rep.prompt, "n_prompt": rep.n_prompt, "ok": rep.ok,
            "rows": [attrs.asdict(r) for r in rep.rows], "argmax_match": rep.argmax_match,
            "greedy_match": rep.greedy_match, "greedy_ours": list(rep.greedy_ours),
            "greedy_ref": list(rep.greedy_ref), "first_divergent": rep.first_divergent,
            "kernels_argmax": rep.kernels_argmax, "kernels_max_abs": rep.kernels_max_abs}


def run_validate(model_name: str, reference: str, prompts: Sequence[str], n_tokens: int = 32,
                 as_json: bool = False, compute: str = "reference", out: Any = None) -> int:
    """`tracelm validate`: 0 when every prompt is within tolerance, 1 when not. `compute="kernels"` validates
    the kernels and also compares their logits with tracelm's numpy reference."""
    import json
    import sys

    from tracelm.io.loader import ModelFile

    out = out or sys.stdout
    if reference != "transformers":
        raise TracelmError(f"validate: unknown reference {reference!r} (supported: transformers)")
    source = ModelFile(model_name)
    ids = [source.tokenizer.encode(p) for p in prompts]
    model = source.load(progress=False, compute=compute)
    numpy_model = source.load(progress=False, compute="reference") if compute == "kernels" else None
    ref = TransformersReference(source.path)
    reports = [validate_prompt(model, ref, p, i, n_tokens, numpy_model) for p, i in zip(prompts, ids, strict=True)]
    ok = all(r.ok for r in reports)
    if as_json:
        out.write(json.dumps({"model": str(source.path), "reference": reference, "compute": compute, "ok": ok,
                              "cosine_min": COSINE_MIN, "prompts": [report_json(r) for r in reports]}, indent=2) + "\n")
    else:
        out.write(f"{source.path.name} ({compute}) vs {reference}: {model.cfg.n_layer} layers, tolerance cosine >= "
                  f"{COSINE_MIN}\n")
        for r in reports:
            out.write(format_report(r) + "\n")
        out.write(("all within tolerance" if ok else "NOT within tolerance") + "\n")
    return 0 if ok else 1
