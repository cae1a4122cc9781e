"""`tracelm bench --compare`: tracelm, llama-cpp-python and Hugging Face transformers on the same GGUF file.

Every engine runs in its own child process (`child_main`, started by `tools.child.run_child` in a fresh
interpreter), so its peak RSS (the child's own ru_maxrss) and its thread setting are its own. All get
the same prompt ids (`bench_ids`, 256 tokens by default) and the same thread count:
- tracelm: a Session with `threads: N` (the kernels' pool; OpenBLAS at one thread);
- llama.cpp: `Llama(n_threads=N, n_threads_batch=N, n_batch=512)`;
- transformers: `torch.set_num_threads(N)`, the GGUF loaded in f32 as `tracelm validate` does.

Each child measures the same way (`measure`): load seconds (building the model from the file, after the
library's import), prefill tok/s as the best of `repeats` prefills of the prompt into an empty cache (after
one untimed), and decode tok/s over one timed run of `n_decode` greedy steps (argmax of the last logits)
after a warm-up. The greedy tokens come back too, so the report says how far each engine's tokens agree
with tracelm's (llama.cpp and tracelm compute on the quantized blocks, transformers with f32 weights).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import resource
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tracelm.pipeline.runner import common_prefix
from tracelm.state.errors import TracelmError
from tracelm.tools.child import ChildKilled, run_child

ENGINES = ("tracelm", "llama.cpp", "transformers")
REQUIRES: dict[str, tuple[str, ...]] = {"tracelm": (), "llama.cpp": ("llama_cpp",),
                                        "transformers": ("transformers", "torch")}
DISTRIBUTIONS = {"tracelm": ("tracelm",), "llama.cpp": ("llama_cpp_python",), "transformers": ("transformers", "torch")}
IMPORTS = {"tracelm": ("tracelm.session",), "llama.cpp": ("llama_cpp",),
           "transformers": ("torch", "transformers", "transformers.modeling_utils", "tracelm.tools.validate")}
INSTALL = {"llama.cpp": "pip install 'tracelm[compare]'", "transformers": "pip install 'tracelm[reference]'"}
# (key, what, tracelm's figure / the other engine's, the target)
RATIOS = (
    ("decode_vs_llama_cpp", "tracelm decode / llama.cpp decode", "decode_tok_s", "llama.cpp", 1.2),
    ("prefill_vs_llama_cpp", "tracelm prefill / llama.cpp prefill", "prefill_tok_s", "llama.cpp", 1.5),
    ("prefill_vs_transformers", "tracelm prefill / transformers prefill", "prefill_tok_s", "transformers", 1.0),
    ("decode_vs_transformers", "tracelm decode / transformers decode", "decode_tok_s", "transformers", 2.0),
)
WARMUP_STEPS = 8


# --- engines (each runs inside its own child process) ---------------------------------------------------


class TracelmEngine:
    def __init__(self, path: str, threads: int, n_ctx: int, **options: Any):
        from tracelm.tools.bench import open_session

        self.runner = open_session(path, threads=threads, **options).new_runner(n_ctx)  # options: RunConfig fields

    def reset(self) -> None:
        self.runner.cache.reset()

    def prefill(self, ids: Sequence[int]) -> int:
        return int(np.argmax(self.runner.prefill(ids).values[-1]))

    def step(self, token: int) -> int:
        return int(np.argmax(self.runner.step(token).values[-1]))


class LlamaCppEngine:
    def __init__(self, path: str, threads: int, n_ctx: int, extra_buffers: bool = True, **options: Any):
        """`extra_buffers=False` turns off llama.cpp's extra weight buffer types (AMX tiles, repacked
        layouts; model parameter `use_extra_bufts`, which `Llama` does not take as an argument)."""
        import llama_cpp

        self.lib = llama_cpp
        if not extra_buffers:  # this child process only: every model it loads gets the parameter
            defaults = llama_cpp.llama_cpp.llama_model_default_params

            def without_extra_buffers() -> Any:
                params = defaults()
                params.use_extra_bufts = False
                return params

            llama_cpp.llama_cpp.llama_model_default_params = without_extra_buffers
        self.llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                   n_batch=512, logits_all=False, verbose=False)
        self.n_vocab = self.llm.n_vocab()

    def reset(self) -> None:
        self.llm.reset()  # n_tokens = 0: the next eval drops the KV cache from position 0 on

    def _last(self) -> int:
        # without logits_all, eval keeps no scores: read the last position's logits from the context
        row = self.lib.llama_get_logits_ith(self.llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(row, shape=(self.n_vocab,))))

    def prefill(self, ids: Sequence[int]) -> int:
        self.llm.eval(list(ids))
        return self._last()

    def step(self, token: int) -> int:
        self.llm.eval([token])
        return self._last()


class TransformersEngine:
    def __init__(self, path: str, threads: int, n_ctx: int, **options: Any):
        import torch

        from tracelm.tools.validate import TransformersReference

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = TransformersReference(path).model
        self.past: Any = None

    def reset(self) -> None:
        self.past = None

    def _run(self, ids: Sequence[int]) -> int:
        with self.torch.inference_mode():
            out = self.model(input_ids=self.torch.tensor([list(ids)]), past_key_values=self.past, use_cache=True,
                             logits_to_keep=1)
        self.past = out.past_key_values
        return int(out.logits[0, -1].argmax())

    def prefill(self, ids: Sequence[int]) -> int:
        return self._run(ids)

    def step(self, token: int) -> int:
        return self._run([token])


ENGINE_CLASSES = {"tracelm": TracelmEngine, "llama.cpp": LlamaCppEngine, "transformers": TransformersEngine}


def measure(engine: Any, ids: Sequence[int], n_decode: int, repeats: int) -> dict[str, Any]:
    """Prefill tok/s (best of `repeats` into an empty cache, after one untimed) and decode tok/s (one timed
    run of `n_decode` greedy steps after a warm-up), with the greedy tokens: the first from the prefill."""
    from tracelm.tools.bench import _best_seconds

    def prefill() -> int:
        engine.reset()
        return engine.prefill(ids)

    prefill_s = _best_seconds(prefill, repeats)
    token = prefill()
    for _ in range(min(WARMUP_STEPS, n_decode)):
        token = engine.step(token)
    tokens = [prefill()]
    t0 = time.perf_counter()
    for _ in range(n_decode):
        tokens.append(engine.step(tokens[-1]))
    decode_s = time.perf_counter() - t0
    return {"prefill_tok_s": round(len(ids) / prefill_s, 1), "decode_tok_s": round(n_decode / decode_s, 2),
            "tokens": tokens}


def _version(engine: str) -> str:
    out = []
    for dist in DISTRIBUTIONS[engine]:
        try:
            out.append(importlib.metadata.version(dist))
        except importlib.metadata.PackageNotFoundError:
            out.append("?")
    return "+".join(out)


def child_main(engine: str, request: dict[str, Any]) -> dict[str, Any]:
    """Load `engine` on the request's GGUF and measure it; runs in the child process."""
    from tracelm.session import ThreadLimits

    threads, ids, n_decode = int(request["threads"]), [int(i) for i in request["ids"]], int(request["n_decode"])
    with ThreadLimits(threads):
        t0 = time.perf_counter()
        for module in IMPORTS[engine]:
            importlib.import_module(module)
        t1 = time.perf_counter()
        model = ENGINE_CLASSES[engine](request["path"], threads, len(ids) + n_decode + 16,
                                       **request.get("options", {}))
        load_s = time.perf_counter() - t1
        result = measure(model, ids, n_decode, int(request["repeats"]))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return {"engine": engine, "status": "ok", "version": _version(engine), "threads": threads,
            "options": request.get("options", {}),
            "load_seconds": round(load_s, 3), "import_seconds": round(t1 - t0, 3),
            **{k: result[k] for k in ("prefill_tok_s", "decode_tok_s")},
            "peak_rss_mb": round(peak / 2**20, 1), "tokens": result["tokens"]}


# --- the parent: one child per engine, then the report --------------------------------------------------


def missing_modules(engine: str) -> list[str]:
    return [m for m in REQUIRES[engine] if importlib.util.find_spec(m) is None]


# An engine whose child crashed (killed by a signal) is run once more with these options, and the report says
# why: llama.cpp's AMX weight buffers crash on some machines with AMX (SIGSEGV in ggml_backend_amx_mul_mat,
# llama.cpp issue 20824; this one included), so it is then measured without its extra buffer types.
RETRY_AFTER_CRASH: dict[str, tuple[dict[str, Any], str]] = {
    "llama.cpp": ({"extra_buffers": False}, "extra weight buffer types (AMX, repacking) off: with them the "
                  "child crashed"),
}


def run_engine(engine: str, path: str, ids: Sequence[int], n_decode: int, threads: int, repeats: int = 3,
               timeout: float = 1800.0, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """One engine measured in a child process: its result, or {"status": "not installed" | "failed", ...}."""
    missing = missing_modules(engine)
    if missing:
        return {"engine": engine, "status": "not installed",
                "error": f"no module {', '.join(missing)} ({INSTALL.get(engine, 'pip install it')})"}
    request = {"path": str(path), "ids": [int(i) for i in ids], "n_decode": n_decode, "threads": threads,
               "repeats": repeats, "options": options or {}}
    result, crashed = _run_child(engine, request, timeout)
    if crashed and options is None and engine in RETRY_AFTER_CRASH:
        retry_options, note = RETRY_AFTER_CRASH[engine]
        retried = run_engine(engine, path, ids, n_decode, threads, repeats, timeout, retry_options)
        return {**retried, "note": f"{note} ({result['error']})"}
    return result


def _run_child(engine: str, request: dict[str, Any], timeout: float) -> tuple[dict[str, Any], bool]:
    """The child's result, or a failure with its one-line reason; True when a signal killed it."""
    try:
        return run_child(child_main, engine, request, timeout=timeout), False
    except ChildKilled as e:
        return {"engine": engine, "status": "failed", "error": str(e)}, True
    except TracelmError as e:
        return {"engine": engine, "status": "failed", "error": str(e)}, False


def build_report(model: str, threads: int, n_prompt: int, n_decode: int,
                 results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The JSON report: per engine its figures (and how many greedy tokens agree with tracelm's), then the
    ratios the issue asks for, each with its target; a ratio is null when an engine has no figure."""
    ours = results.get("tracelm", {})
    engines = {}
    for name, r in results.items():
        r = dict(r)
        tokens = r.pop("tokens", None)
        if tokens is not None and ours.get("tokens") is not None:
            r["greedy_same_as_tracelm"] = common_prefix(tokens, ours["tokens"])
            r["greedy_tokens"] = len(tokens)
        engines[name] = r
    ratios = {}
    for key, what, field, other, target in RATIOS:
        a, b = ours.get(field), results.get(other, {}).get(field)
        value = round(a / b, 3) if a and b else None
        ratios[key] = {"what": what, "value": value, "target": target,
                       "met": None if value is None else bool(value >= target)}
    return {"model": model, "threads": threads, "prompt_tokens": n_prompt, "decode_tokens": n_decode,
            "engines": engines, "ratios": ratios}


def run_compare(model_name: str, threads: int = 0, n_prompt: int = 256, n_decode: int = 128, repeats: int = 3,
                engines: Sequence[str] = ENGINES, timeout: float = 1800.0, activations: str = "int16"
                ) -> dict[str, Any]:
    """`tracelm bench --compare`: every engine (each when installed) on the same GGUF, ids and threads
    (tracelm's activations as given)."""
    from tracelm.io.loader import ModelFile
    from tracelm.tools.bench import bench_ids

    source = ModelFile(model_name)
    if source.kind != "gguf":
        raise TracelmError(f"{source.path}: bench --compare needs a GGUF file (the one file all engines read)")
    if n_prompt < 1 or n_decode < 1:
        raise TracelmError(f"bench --compare: prompt tokens ({n_prompt}) and decode tokens ({n_decode}) must be >= 1")
    unknown = [e for e in engines if e not in ENGINE_CLASSES]
    if unknown:
        raise TracelmError(f"bench --compare: unknown engine {unknown[0]!r} (known: {', '.join(ENGINES)})")
    threads = threads if threads > 0 else (os.cpu_count() or 1)
    ids = bench_ids(source.tokenizer, n_prompt)
    load_before = os.getloadavg()[0]
    options = {"tracelm": {"activations": activations}}
    results = {e: run_engine(e, str(source.path), ids, n_decode, threads, repeats, timeout, options.get(e))
               for e in engines}
    report = build_report(Path(source.path).name, threads, n_prompt, n_decode, results)
    # other work on the machine slows the engines unequally (they run one after another): say how busy it was
    report["load_average_1m"] = {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2),
                                 "cores": os.cpu_count()}
    return report


def format_table(report: dict[str, Any]) -> str:
    threads = f"{report['threads']} thread{'s' if report['threads'] != 1 else ''}"
    lines = [f"{report['model']}: {threads}, {report['prompt_tokens']}-token prompt, "
             f"{report['decode_tokens']} greedy decode tokens"]
    load = report.get("load_average_1m")
    if load:
        lines.append(f"load average (1 min) {load['before']:.2f} before, {load['after']:.2f} after, on {load['cores']} "
                     "cores (other work slows the engines unequally)")
    lines.append(f"{'engine':14s} {'version':16s} {'load s':>8s} {'prefill tok/s':>14s} {'decode tok/s':>13s} "
                 f"{'peak RSS MB':>12s}  greedy = tracelm")
    for name, r in report["engines"].items():
        if r["status"] != "ok":
            lines.append(f"{name:14s} {r['status']}: {r.get('error', '')}")
            continue
        same = f"{r['greedy_same_as_tracelm']}/{r['greedy_tokens']}" if "greedy_same_as_tracelm" in r else "-"
        lines.append(f"{name:14s} {r['version']:16s} {r['load_seconds']:8.2f} {r['prefill_tok_s']:14.1f} "
                     f"{r['decode_tok_s']:13.2f} {r['peak_rss_mb']:12.1f}  {same}")
        if r.get("note"):
            lines.append(f"{'':14s} note: {r['note']}")
    lines.append("")
    for ratio in report["ratios"].values():
        value = "n/a" if ratio["value"] is None else f"{ratio['value']:.2f}x"
        met = {None: "", True: "met", False: "not met"}[ratio["met"]]
        lines.append(f"{ratio['what']:40s} {value:>7s}   target >= {ratio['target']}x {met}".rstrip())
    return "\n".join(lines)
