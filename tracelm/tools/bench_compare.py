"""`tracelm bench --compare`: tracelm, llama-cpp-python and Hugging Face transformers on the same GGUF file.

Every engine runs in its own child process (`EngineChild`, kept by `tools.child.Child` in a fresh
interpreter), so its peak RSS (the child's own ru_maxrss) and its thread setting are its own. All get
the same prompt ids (`bench_ids`, 256 tokens by default) and the same thread count:
- tracelm: a Session with `threads: N` (the kernels' pool; OpenBLAS at one thread);
- llama.cpp: `Llama(n_threads=N, n_threads_batch=N, n_batch=512, flash_attn=...)`, measured with flash
  attention off and on, each with its extra weight buffer types (AMX, repacked layouts) and without
  (`VARIANTS`); per rate the best median is llama.cpp's figure, and the report names it;
- transformers: `torch.set_num_threads(N)`, the GGUF loaded in f32 as `tracelm validate` does; the report names
  its attention implementation (`model.config._attn_implementation`).

Every engine variant is loaded once, in a child of its own, and all stay loaded for the run (memory for each at
once: a variant whose estimate (`variant_bytes`) does not fit in what the machine has left when its turn to load
comes is reported not loaded, the others run). In each of `rounds` rounds (`run_rounds`, `measure_round`) the
engines take turns, so that load on the machine that comes and goes falls on all of them alike, within seconds
rather than between rounds: every engine prefills the prompt into an empty cache in turn, `repeats` times after
one untimed (the best counts), then every engine warms up and decodes greedily (argmax of the last logits) in
turns of `turn_steps` steps until each has taken `n_decode`, the order rotated each turn; decode tok/s is
n_decode over the sum of its turns. The parent waits `SETTLE_SECONDS` between turns, untimed, for the last
engine's idle threads to stop spinning. Load seconds (building the model from the file, after the library's
import) and peak RSS are each child's own. The report gives each rate's median, min and max over the rounds, and
for each ratio (tracelm / llama.cpp, tracelm / transformers) the median, min and max of the per-round ratios.

The greedy tokens come back too, and agreement is asserted (`agreement`): in every round each engine's first
`agree_tokens` greedy tokens must be tracelm's (llama.cpp and tracelm compute on the quantized blocks,
transformers with f32 weights, so near-ties may part them later), and tracelm's must be the same in every round;
a disagreement names the engine, the round and the token where they part, and the command exits 1.

`--llama-bench PATH` runs llama.cpp's own benchmark in every round too (`run_llama_bench`: `-p N -n N -t N -fa
0,1 -r 1 -o json`), its figures and ratios in the same report.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from tracelm.pipeline.bounds import available_memory, kv_cache_bytes, mib
from tracelm.pipeline.runner import common_prefix
from tracelm.state.errors import TracelmError
from tracelm.tools.child import Child, ChildKilled

ENGINES = ("tracelm", "llama.cpp", "transformers")
REQUIRES: dict[str, tuple[str, ...]] = {"tracelm": (), "llama.cpp": ("llama_cpp",),
                                        "transformers": ("transformers", "torch")}
DISTRIBUTIONS = {"tracelm": ("tracelm",), "llama.cpp": ("llama_cpp_python",), "transformers": ("transformers", "torch")}
IMPORTS = {"tracelm": ("tracelm.session",), "llama.cpp": ("llama_cpp",),
           "transformers": ("torch", "transformers", "transformers.modeling_utils", "tracelm.tools.validate")}
INSTALL = {"llama.cpp": "pip install 'tracelm[compare]'", "transformers": "pip install 'tracelm[reference]'"}
DEFAULT = "default"
# the settings each engine is measured with, every one in every round; per rate the best median counts
VARIANTS: dict[str, tuple[tuple[str, dict[str, Any]], ...]] = {
    "tracelm": ((DEFAULT, {}),),
    "llama.cpp": (("flash_attn off", {"flash_attn": False}), ("flash_attn on", {"flash_attn": True}),
                  # its generic layouts too: on an AMX machine they prefill faster than the repacked ones
                  ("flash_attn off, no extra buffers", {"flash_attn": False, "extra_buffers": False}),
                  ("flash_attn on, no extra buffers", {"flash_attn": True, "extra_buffers": False})),
    "transformers": ((DEFAULT, {}),),
}
LLAMA_BENCH = "llama-bench"
LLAMA_BENCH_VARIANTS = ("flash_attn off", "flash_attn on")  # its -fa 0,1
RATES = ("prefill_tok_s", "decode_tok_s")
# (key, what, tracelm's figure / the other engine's, the target: issue 32's for llama.cpp, issue 6's for transformers)
RATIOS = (
    ("decode_vs_llama_cpp", "tracelm decode / llama.cpp decode", "decode_tok_s", "llama.cpp", 1.3),
    ("prefill_vs_llama_cpp", "tracelm prefill / llama.cpp prefill", "prefill_tok_s", "llama.cpp", 1.5),
    ("prefill_vs_transformers", "tracelm prefill / transformers prefill", "prefill_tok_s", "transformers", 1.0),
    ("decode_vs_transformers", "tracelm decode / transformers decode", "decode_tok_s", "transformers", 2.0),
    ("decode_vs_llama_bench", "tracelm decode / llama-bench decode", "decode_tok_s", LLAMA_BENCH, 1.3),
    ("prefill_vs_llama_bench", "tracelm prefill / llama-bench prefill", "prefill_tok_s", LLAMA_BENCH, 1.5),
)
OPTIONAL_OTHERS = (LLAMA_BENCH,)  # their ratios appear only when they were run
WARMUP_STEPS = 8
TURN_STEPS = 8  # decode steps an engine takes in a turn before the next engine's
AGREE_TOKENS = 32
CTX_SLACK = 16  # positions each engine's context holds past the prompt and the decoded tokens


# --- engines (each runs inside its own child process) ---------------------------------------------------


class TracelmEngine:
    def __init__(self, path: str, threads: int, n_ctx: int, **options: Any):
        from tracelm.tools.bench import open_session

        self.options = options
        self.session = open_session(path, threads=threads, **options)  # options: RunConfig fields
        self.runner = self.session.new_runner(n_ctx)
        self.n_prompt = 0

    def describe(self) -> dict[str, Any]:
        """The path and its self-test; on the kernels, the prompt's integer bound (bench's `prefill_int8_bound`)."""
        from tracelm.tools.bench import kernels_in_use, prefill_int8_bound

        note = kernels_in_use()
        return {"kernels": note["kernels_path"], "selftest": note["selftest"][note["kernels_path"]],
                **(prefill_int8_bound(self.session, self.n_prompt) if self.n_prompt else {})}

    def reset(self) -> None:
        self.runner.cache.reset()

    def prefill(self, ids: Sequence[int]) -> int:
        self.n_prompt = len(ids)
        return int(np.argmax(self.runner.prefill(ids).values[-1]))

    def step(self, token: int) -> int:
        return int(np.argmax(self.runner.step(token).values[-1]))


def drop_amx_buffer_type(llama_cpp: Any) -> list[str]:
    """Take the AMX weight buffer type out of the CPU device's extra buffer types, in this process, before any
    model loads: the repacked layouts stay. The list is the nullptr-terminated array ggml's CPU device hands out
    (`ggml_backend_dev_get_extra_bufts`), the same array every later call returns; returns the names left."""
    import ctypes

    lib = Path(llama_cpp.__file__).parent / "lib"
    try:
        base, ggml = ctypes.CDLL(str(lib / "libggml-base.so")), ctypes.CDLL(str(lib / "libggml.so"))
    except OSError as e:
        raise TracelmError(f"llama.cpp's AMX buffer type cannot be turned off here: {e}") from e
    vp = ctypes.c_void_p
    ggml.ggml_backend_dev_by_type.restype, ggml.ggml_backend_dev_by_type.argtypes = vp, [ctypes.c_int]
    base.ggml_backend_dev_backend_reg.restype, base.ggml_backend_dev_backend_reg.argtypes = vp, [vp]
    base.ggml_backend_reg_get_proc_address.restype = vp
    base.ggml_backend_reg_get_proc_address.argtypes = [vp, ctypes.c_char_p]
    base.ggml_backend_buft_name.restype, base.ggml_backend_buft_name.argtypes = ctypes.c_char_p, [vp]
    llama_cpp.llama_backend_init()
    dev = ggml.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    proc = base.ggml_backend_reg_get_proc_address(base.ggml_backend_dev_backend_reg(dev),
                                                  b"ggml_backend_dev_get_extra_bufts") if dev else None
    if not proc:
        raise TracelmError("llama.cpp's CPU device lists no extra buffer types to take AMX out of")
    bufts = ctypes.CFUNCTYPE(ctypes.POINTER(vp), vp)(proc)(dev)
    n = 0
    while bufts[n]:
        n += 1
    kept = [bufts[i] for i in range(n) if base.ggml_backend_buft_name(bufts[i]) != b"AMX"]
    for i in range(n):  # in place, still nullptr-terminated
        bufts[i] = kept[i] if i < len(kept) else None
    return [base.ggml_backend_buft_name(b).decode() for b in kept]


class LlamaCppEngine:
    def __init__(self, path: str, threads: int, n_ctx: int, extra_buffers: bool = True, amx_buffers: bool = True,
                 flash_attn: bool = False, **options: Any):
        """`extra_buffers=False` turns off llama.cpp's extra weight buffer types (AMX tiles, repacked
        layouts; model parameter `use_extra_bufts`, which `Llama` does not take as an argument); `amx_buffers=False`
        the AMX one alone (`drop_amx_buffer_type`); `flash_attn` is llama-cpp-python's argument of that name."""
        import llama_cpp

        self.lib, self.flash_attn = llama_cpp, flash_attn
        if not amx_buffers:
            drop_amx_buffer_type(llama_cpp)
        if not extra_buffers:  # this child process only: every model it loads gets the parameter
            defaults = llama_cpp.llama_cpp.llama_model_default_params

            def without_extra_buffers() -> Any:
                params = defaults()
                params.use_extra_bufts = False
                return params

            llama_cpp.llama_cpp.llama_model_default_params = without_extra_buffers
        self.llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                   n_batch=512, flash_attn=flash_attn, logits_all=False, verbose=False)
        self.n_vocab = self.llm.n_vocab()
        in_effect = flash_attn_in_effect(getattr(self.llm, "context_params", None))
        if in_effect is not None and in_effect != flash_attn:  # Llama takes **kwargs: an argument it lost is dropped
            raise TracelmError(f"llama-cpp-python {_version('llama.cpp')} did not apply flash_attn={flash_attn} "
                               f"(its context has flash attention {'on' if in_effect else 'off or auto'})")

    def describe(self) -> dict[str, Any]:
        """The build as llama.cpp reports it: `llama_print_system_info()` (the CPU features compiled in and the
        backends) and the GGML_* settings of the installed ggml CMake package, when the install has one."""
        info = self.lib.llama_print_system_info()
        return {"flash_attn": self.flash_attn,
                "system_info": (info.decode() if isinstance(info, bytes) else str(info)).strip(),
                "build_flags": build_flags(Path(self.lib.__file__).parent)}

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

    def describe(self) -> dict[str, Any]:
        return {"attention": str(getattr(self.model.config, "_attn_implementation", None))}

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


def flash_attn_in_effect(params: Any) -> bool | None:
    """Whether llama.cpp's context parameters have flash attention on: its `flash_attn` flag, or in later
    versions `flash_attn_type` (1 enabled; 0 disabled, -1 auto count as not on); None when neither is there."""
    if params is None:
        return None
    if hasattr(params, "flash_attn"):
        return bool(params.flash_attn)
    if hasattr(params, "flash_attn_type"):
        return int(params.flash_attn_type) == 1
    return None


ENGINE_CLASSES = {"tracelm": TracelmEngine, "llama.cpp": LlamaCppEngine, "transformers": TransformersEngine}
_CMAKE_SET = re.compile(r'^\s*set\((GGML_[A-Z0-9_]+)\s+"?([^")]*)"?\s*\)', re.MULTILINE)


def cmake_settings(text: str) -> dict[str, str]:
    """The `set(GGML_NAME "value")` lines of a ggml-config.cmake (its build settings), the empty ones left out."""
    return {name: value for name, value in _CMAKE_SET.findall(text) if value}


def build_flags(package: Path) -> dict[str, str] | None:
    """The GGML_* build settings in the ggml-config.cmake under an installed package, or None without one."""
    for config in sorted(package.rglob("ggml-config.cmake")):
        try:
            return cmake_settings(config.read_text(errors="replace"))
        except OSError:
            continue
    return None


class EngineChild:
    """One engine variant in its own child process (`tools.child.Child`): loaded once, then measured a turn at a
    time as the parent calls, so that every engine's turns fall in the same seconds of the machine."""

    def __init__(self, engine: str, request: dict[str, Any]):
        from tracelm.session import ThreadLimits

        self.engine, self.options = engine, dict(request.get("options", {}))
        self.threads, self.ids = int(request["threads"]), [int(i) for i in request["ids"]]
        self.n_decode = int(request["n_decode"])
        ThreadLimits(self.threads)  # for the child's life
        t0 = time.perf_counter()
        for module in IMPORTS[engine]:
            importlib.import_module(module)
        t1 = time.perf_counter()
        self.model = ENGINE_CLASSES[engine](request["path"], self.threads, len(self.ids) + self.n_decode + CTX_SLACK,
                                            **self.options)
        self.load_s, self.import_s = time.perf_counter() - t1, t1 - t0
        self.tokens: list[int] = []

    def _prefill(self) -> int:
        self.model.reset()
        return self.model.prefill(self.ids)

    def prefill(self) -> float:
        """Seconds of one prefill of the prompt into an empty cache."""
        t0 = time.perf_counter()
        self._prefill()
        return time.perf_counter() - t0

    def begin_decode(self) -> None:
        """Warm-up steps, then the prompt again: its greedy token is the decode's first."""
        token = self._prefill()
        for _ in range(min(WARMUP_STEPS, self.n_decode)):
            token = self.model.step(token)
        self.tokens = [self._prefill()]

    def decode(self, n: int) -> float:
        """Seconds of the next n greedy steps (argmax of the last logits)."""
        t0 = time.perf_counter()
        for _ in range(n):
            self.tokens.append(self.model.step(self.tokens[-1]))
        return time.perf_counter() - t0

    def greedy_tokens(self) -> list[int]:
        return self.tokens

    def finish(self) -> dict[str, Any]:
        """What the engine is (version, threads, options, its own details) and what it cost: load seconds, peak RSS."""
        details = self.model.describe()  # at the run's threads (tracelm's integer bound is timed on them)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        return {"version": _version(self.engine), "threads": self.threads, "options": self.options,
                "load_seconds": round(self.load_s, 3), "import_seconds": round(self.import_s, 3),
                "peak_rss_mb": round(peak / 2**20, 1), "details": details}


def _version(engine: str) -> str:
    out = []
    for dist in DISTRIBUTIONS[engine]:
        try:
            out.append(importlib.metadata.version(dist))
        except importlib.metadata.PackageNotFoundError:
            out.append("?")
    return "+".join(out)


# --- the parent: every engine variant's child, the rounds in turns, then the report -------------------------


def missing_modules(engine: str) -> list[str]:
    return [m for m in REQUIRES[engine] if importlib.util.find_spec(m) is None]


def _not_installed(engine: str, missing: list[str]) -> dict[str, Any]:
    return {"engine": engine, "status": "not installed",
            "error": f"no module {', '.join(missing)} ({INSTALL.get(engine, 'pip install it')})"}


# An engine whose child crashed (killed by a signal) is run again with the first of these options not yet in
# effect, then the next, and the report says why: llama.cpp's AMX weight buffers crash on some machines with AMX
# (SIGSEGV in ggml_backend_amx_mul_mat, llama.cpp issue 20824; this one included), so it is then measured
# without them, its repacked layouts kept (its best that runs), and failing that without any extra buffer type.
RETRY_AFTER_CRASH: dict[str, list[tuple[dict[str, Any], str]]] = {
    "llama.cpp": [({"amx_buffers": False}, "AMX weight buffer type off (repacked layouts kept): with it the "
                   "child crashed"),
                  ({"extra_buffers": False}, "extra weight buffer types (AMX, repacking) off: with them the "
                   "child crashed")],
}


def next_fallback(engine: str, options: dict[str, Any]) -> tuple[dict[str, Any], str] | None:
    """The engine's first crash fallback whose options are not all in effect yet."""
    for fallback, note in RETRY_AFTER_CRASH.get(engine, []):
        if {**options, **fallback} != options:
            return fallback, note
    return None


def fallback_in_effect(engine: str, options: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The crash fallbacks' options among `options` (what an engine's other variants start with), and the note of
    the last of them in effect."""
    chain = RETRY_AFTER_CRASH.get(engine, [])
    notes = [note for fallback, note in chain if {**options, **fallback} == options]
    return {k: v for k, v in options.items() if any(k in f for f, _ in chain)}, notes[-1] if notes else ""


def _failed(engine: str, error: str) -> dict[str, Any]:
    return {"engine": engine, "status": "failed", "error": error}


# --- memory: every variant stays loaded for the whole run ----------------------------------------------------

TORCH_BYTES = 512 << 20  # torch's and transformers' own, beside the weights
LLAMA_CPP_BYTES = 256 << 20  # llama.cpp's compute buffers and logits, beside its KV cache


@attrs.frozen
class Footprint:
    """What the model costs the engines, from its file: the file's bytes (its pages, read or mapped by every
    engine, shared through the page cache), an f16 KV cache of the run's positions, the weights in f32."""

    file: int
    kv: int
    f32: int


def footprint(source: Any, n_ctx: int) -> Footprint:
    """The Footprint of an opened ModelFile at n_ctx positions."""
    return Footprint(file=source.path.stat().st_size, kv=kv_cache_bytes(source.cfg, n_ctx),
                     f32=source.weights_bytes(compute="reference"))


def variant_bytes(fp: Footprint, engine: str, options: dict[str, Any]) -> tuple[int, str]:
    """About the memory an engine variant adds beside those loaded, and of what: llama.cpp its KV cache, its
    buffers and, with its extra buffer types, repacked copies of the weights (at most the file); transformers the
    weights in f32 and torch. tracelm: none here (its load checks weights and KV against MemAvailable itself)."""
    if engine == "llama.cpp":
        repacked = fp.file if options.get("extra_buffers", True) else 0
        return (fp.kv + LLAMA_CPP_BYTES + repacked,
                f"KV {mib(fp.kv)} + buffers {mib(LLAMA_CPP_BYTES)}" + (f" + repacked weights {mib(repacked)}"
                                                                      if repacked else ""))
    if engine == "transformers":
        return fp.f32 + TORCH_BYTES, f"f32 weights {mib(fp.f32)} + torch {mib(TORCH_BYTES)}"
    return 0, ""


def memory_shortfall(fp: Footprint, engine: str, options: dict[str, Any], free: int | None) -> str | None:
    """Why the variant is not loaded (its estimate past `free`, MemAvailable now, less the model file's pages, which
    MemAvailable counts as reclaimable but the loaded engines keep using), or None: it fits, or nothing is known."""
    need, what = variant_bytes(fp, engine, options)
    if free is None or need == 0:
        return None
    room = max(free - fp.file, 0)
    if need <= room:
        return None
    return (f"not loaded: needs about {mib(need)} ({what}) beside the variants loaded before it; {mib(room)} "
            f"available (MemAvailable {mib(free)} less the model file's {mib(fp.file)}, which the engines map)")


def start_engine(engine: str, request: dict[str, Any], timeout: float = 1800.0) -> tuple[Child | None, dict[str, Any]]:
    """The engine variant's child, loaded and through one prefill (where llama.cpp's AMX buffers crash): (child,
    {"options", "note"?}), or (None, the failure). A child killed by a signal is started again with the engine's
    crash fallbacks in turn, and the note says why."""
    options = dict(request.get("options", {}))
    try:
        child = Child(EngineChild, engine, {**request, "options": options}, timeout=timeout)
        child.call("prefill", timeout=timeout)
        return child, {"options": options}
    except ChildKilled as e:
        error, fallback = str(e), next_fallback(engine, options)
    except TracelmError as e:
        return None, _failed(engine, str(e))
    if fallback is None:
        return None, _failed(engine, error)
    child, info = start_engine(engine, {**request, "options": {**options, **fallback[0]}}, timeout)
    note = f"{fallback[1]} ({error})"
    return child, {**info, "note": f"{note}; {info['note']}" if info.get("note") else note}


# Between two turns the parent waits this long, untimed: the idle threads of the engine just measured (llama.cpp's
# OpenMP workers spin for milliseconds after a graph, tracelm's pool for 200 us) give the cores back first.
SETTLE_SECONDS = 0.02


def measure_round(children: dict[tuple[str, str], Child], n_prompt: int, n_decode: int, repeats: int,
                  turn_steps: int, timeout: float) -> dict[tuple[str, str], dict[str, Any]]:
    """One round, the engines taking turns: each prefill repeat by every engine in turn (the first untimed; the
    best counts), then decode in turns of `turn_steps` greedy steps, the order rotated by one each time. A child
    that fails is left out from then on; its entry is the failure."""
    keys, failed = list(children), {}

    def turn(key: tuple[str, str], method: str, **kwargs: Any) -> Any:
        if key in failed:
            return None
        time.sleep(SETTLE_SECONDS)
        try:
            return children[key].call(method, timeout=timeout, **kwargs)
        except TracelmError as e:
            failed[key] = _failed(key[0], str(e))
            return None

    def order(i: int) -> list[tuple[str, str]]:
        i %= len(keys)
        return keys[i:] + keys[:i]

    best: dict[tuple[str, str], float] = {}
    for rep in range(repeats + 1):
        for key in order(rep):
            seconds = turn(key, "prefill")
            if seconds is not None and rep:
                best[key] = min(best.get(key, seconds), seconds)
    for key in keys:
        turn(key, "begin_decode")
    spent = dict.fromkeys(keys, 0.0)
    for i, start in enumerate(range(0, n_decode, turn_steps)):
        for key in order(i):
            spent[key] += turn(key, "decode", n=min(turn_steps, n_decode - start)) or 0.0
    tokens = {key: turn(key, "greedy_tokens") for key in keys}
    return {key: failed.get(key) or {"engine": key[0], "status": "ok", "prefill_tok_s": round(n_prompt / best[key], 1),
                                     "decode_tok_s": round(n_decode / spent[key], 2), "tokens": tokens[key]}
            for key in keys}


# --- llama.cpp's own llama-bench, run in every round beside the engines -------------------------------------


def llama_bench_command(exe: str, model: str, n_prompt: int, n_decode: int, threads: int) -> list[str]:
    """One prefill test of n_prompt tokens and one decode test of n_decode, flash attention off and on, once each
    (the rounds repeat it), as JSON."""
    return [exe, "-m", model, "-p", str(n_prompt), "-n", str(n_decode), "-t", str(threads), "-fa", "0,1",
            "-r", "1", "-o", "json"]


def _flash_label(value: Any) -> str:
    on = value in (True, 1) or str(value).lower() in ("1", "true", "on", "enabled")
    return f"flash_attn {'on' if on else 'off'}"


def _number(entry: dict[str, Any], key: str) -> float:
    value = entry.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"a test's {key!r} is {value!r}, not a number")
    return float(value)


def parse_llama_bench(text: str, n_prompt: int, n_decode: int) -> dict[str, dict[str, Any]]:
    """llama-bench's JSON (a list of tests: n_prompt, n_gen, flash_attn, avg_ts, ...) as one result per flash
    attention setting: the `-p n_prompt` test's tok/s as prefill, the `-n n_decode` test's as decode."""
    try:
        tests = json.loads(text)
    except ValueError as e:
        raise ValueError(f"its output is not JSON ({e})") from None
    if not isinstance(tests, list) or not all(isinstance(t, dict) for t in tests):
        raise ValueError("its output is not a JSON list of tests")
    out: dict[str, dict[str, Any]] = {}
    for t in tests:
        n_p, n_g = _number(t, "n_prompt"), _number(t, "n_gen")
        rate = ("prefill_tok_s" if (n_p, n_g) == (n_prompt, 0) else "decode_tok_s" if (n_p, n_g) == (0, n_decode)
                else None)
        if rate is None:
            continue
        label = _flash_label(t.get("flash_attn"))
        version = f"{t.get('build_commit', '?')} (build {t.get('build_number', '?')})"
        r = out.setdefault(label, {
            "engine": LLAMA_BENCH, "status": "ok", "version": version, "threads": t.get("n_threads"),
            "options": {"flash_attn": label.endswith("on")},
            "details": {k: t[k] for k in ("cpu_info", "backends", "model_type") if k in t}})
        r[rate] = round(_number(t, "avg_ts"), 2)
        r["details"][f"{rate.split('_')[0]}_depth"] = t.get("n_depth", 0)
    if not out:
        raise ValueError(f"its output has no -p {n_prompt} or -n {n_decode} test")
    for label, r in out.items():
        for rate in RATES:
            if rate not in r:
                raise ValueError(f"its output has no {rate.split('_')[0]} test with {label}")
    return out


def run_llama_bench(exe: str, model: str, n_prompt: int, n_decode: int, threads: int,
                    timeout: float = 1800.0) -> dict[str, dict[str, Any]]:
    """One llama-bench run: a result per flash attention setting, or one failure (the reason in a line)."""
    cmd = llama_bench_command(exe, model, n_prompt, n_decode, threads)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return _llama_bench_failed(f"{exe}: timed out after {timeout:.0f} s")
    except OSError as e:
        return _llama_bench_failed(f"{exe}: cannot run: {e.strerror or e}")
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [""])[-1]
        return _llama_bench_failed(f"{exe} exited with code {proc.returncode}" + (f": {last}" if last else ""))
    try:
        return parse_llama_bench(proc.stdout, n_prompt, n_decode)
    except ValueError as e:
        return _llama_bench_failed(f"{exe}: {e}")


def _llama_bench_failed(error: str) -> dict[str, dict[str, Any]]:
    return {label: _failed(LLAMA_BENCH, error) for label in LLAMA_BENCH_VARIANTS}


# --- the rounds ---------------------------------------------------------------------------------------------


Runs = dict[str, dict[str, list[dict[str, Any]]]]  # engine -> variant -> one result per round


def run_rounds(path: str, ids: Sequence[int], n_decode: int, threads: int, repeats: int, rounds: int,
               engines: Sequence[str], timeout: float, options: dict[str, dict[str, Any]],
               llama_bench: str | None = None, log: Callable[[str], None] = lambda line: None,
               turn_steps: int = TURN_STEPS, fp: Footprint | None = None) -> Runs:
    """Every engine variant loaded once, each in a child of its own (all alive at once: memory for each), then
    measured in every round with the engines taking turns (`measure_round`); llama-bench after them. An engine
    that is not installed is reported once; a variant that failed, or whose estimate does not fit in the memory
    left when it is its turn to load (`memory_shortfall`, given the model's Footprint; llama-bench's too, before
    each run: it loads the model again beside them), is not run; a crash's fallback options carry to the engine's
    variants started after it (llama.cpp's AMX buffers crash with flash attention on or off)."""
    runs: Runs = {}
    settings: dict[tuple[str, str], dict[str, Any]] = {}
    for engine in engines:
        missing = missing_modules(engine)
        if missing:
            runs[engine] = {DEFAULT: [_not_installed(engine, missing)]}
            continue
        runs[engine] = {name: [] for name, _ in VARIANTS[engine]}
        settings |= {(engine, name): {**options.get(engine, {}), **o} for name, o in VARIANTS[engine]}
    if llama_bench:
        runs[LLAMA_BENCH] = {name: [] for name in LLAMA_BENCH_VARIANTS}
    children: dict[tuple[str, str], Child] = {}
    notes: dict[tuple[str, str], str] = {}
    try:
        for i, (engine, name) in enumerate(keys := list(settings)):
            request = {"path": str(path), "ids": [int(t) for t in ids], "n_decode": n_decode, "threads": threads,
                       "options": settings[(engine, name)]}
            short = fp and memory_shortfall(fp, engine, settings[(engine, name)], available_memory())
            child, info = (None, _failed(engine, short)) if short else start_engine(engine, request, timeout)
            if child is None:
                runs[engine][name].append(info)
                log(f"{_label(engine, name)}: {_result_line(info)}")
                continue
            children[(engine, name)], settings[(engine, name)] = child, info["options"]
            if info.get("note"):
                notes[(engine, name)] = info["note"]
            if info.get("note") and engine in RETRY_AFTER_CRASH:  # the crash is the engine's, not the variant's:
                fallback, why = fallback_in_effect(engine, info["options"])  # its variants after this one start with
                for key in [k for k in keys[i + 1:] if k[0] == engine]:  # it (no crash to pay), but not those that
                    if not fallback_in_effect(engine, settings[key])[0]:  # set such options of their own
                        settings[key] = {**settings[key], **fallback}
                        notes[key] = f"{why} (in {_label(engine, name)})"
            log(f"{_label(engine, name)}: loaded" + (f" ({notes[(engine, name)]})" if (engine, name) in notes else ""))
        for r in range(rounds):
            measured = measure_round(children, len(ids), n_decode, repeats, turn_steps, timeout) if children else {}
            for key, result in measured.items():
                if result["status"] != "ok":
                    children.pop(key).close()
                runs[key[0]][key[1]].append({**result, **({"note": notes[key]} if key in notes else {})})
                log(f"round {r + 1}/{rounds}: {_label(*key)}: {_result_line(result)}")
            if llama_bench and all(not d or d[-1]["status"] == "ok" for d in runs[LLAMA_BENCH].values()):
                short = fp and memory_shortfall(fp, "llama.cpp", {}, available_memory())  # its default buffers
                results = (_llama_bench_failed(short) if short else
                           run_llama_bench(llama_bench, path, len(ids), n_decode, threads, timeout))
                for name, result in results.items():
                    runs[LLAMA_BENCH].setdefault(name, []).append(result)
                    log(f"round {r + 1}/{rounds}: {_label(LLAMA_BENCH, name)}: {_result_line(result)}")
        for (engine, name), child in children.items():  # what each engine is, its load time and peak RSS
            try:
                info = child.call("finish", timeout=timeout)
            except TracelmError as e:
                runs[engine][name].append(_failed(engine, str(e)))
                continue
            runs[engine][name] = [{**r, **info} if r["status"] == "ok" else r for r in runs[engine][name]]
    finally:
        for child in children.values():
            child.close()
    return runs


def _result_line(result: dict[str, Any]) -> str:
    """One child's figures as the progress line gives them, so that a run cut short still said what it measured."""
    if result["status"] != "ok":
        return f"{result['status']}: {result.get('error', '')}".rstrip(": ")
    line = f"prefill {result.get('prefill_tok_s', '-')} tok/s, decode {result.get('decode_tok_s', '-')} tok/s"
    line += f", load {result['load_seconds']} s" if "load_seconds" in result else ""
    return line + (f" ({result['note']})" if result.get("note") else "")


def _label(engine: str, variant: str) -> str:
    return engine if variant == DEFAULT else f"{engine} ({variant})"


# --- the report ---------------------------------------------------------------------------------------------


def spread(values: Sequence[float], digits: int = 2) -> dict[str, Any]:
    """Median, min and max of per-round values, and the values in round order."""
    return {"median": round(statistics.median(values), digits), "min": min(values), "max": max(values),
            "rounds": list(values)}


# the details a child reports that differ between an engine's variants; the others are the engine's
VARIANT_DETAILS = ("flash_attn",)


def summarize_variant(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One variant over its rounds: each rate's spread, load seconds' spread, the highest peak RSS; or the
    failure that stopped it (and how many rounds went well before)."""
    ok = [r for r in results if r["status"] == "ok"]
    notes = [r["note"] for r in results if r.get("note")]
    if not ok or results[-1]["status"] != "ok":
        failed = {k: v for k, v in results[-1].items() if k != "note"}
        return {**failed, **({"rounds_ok": len(ok)} if ok else {}), **({"note": notes[0]} if notes else {})}
    last = ok[-1]  # its options are those the later rounds ran with (a crash's fallback kept)
    out: dict[str, Any] = {"status": "ok", "options": last.get("options", {}), "rounds": len(ok)}
    for key, digits in (("load_seconds", 3), ("prefill_tok_s", 1), ("decode_tok_s", 2)):
        if all(key in r for r in ok):
            out[key] = spread([r[key] for r in ok], digits)
    if all("peak_rss_mb" in r for r in ok):
        out["peak_rss_mb"] = max(r["peak_rss_mb"] for r in ok)
    details = dict(last.get("details", {}))
    out |= {k: details.pop(k) for k in VARIANT_DETAILS if k in details}
    out["shared"] = {"version": last.get("version"), "threads": last.get("threads"), **details}
    if notes:
        out["note"] = notes[0]
    return out


def summarize_engine(variants: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """An engine's entry: its one variant's figures, or with several, per rate the variant with the best median
    (named in `best`) and every variant's own figures under `variants`."""
    ok = {name: v for name, v in variants.items() if v["status"] == "ok"}
    if not ok:
        return next(iter(variants.values()))
    shared = next(iter(ok.values())).pop("shared")
    for v in ok.values():
        v.pop("shared", None)
    if len(variants) == 1:
        return {"status": "ok", **shared, **next(iter(ok.values()))}
    best = {rate: max(ok, key=lambda name, rate=rate: ok[name][rate]["median"]) for rate in RATES}
    entry = {"status": "ok", **shared, "best": best, **{rate: ok[best[rate]][rate] for rate in RATES}}
    if all("peak_rss_mb" in v for v in ok.values()):
        entry["peak_rss_mb"] = max(v["peak_rss_mb"] for v in ok.values())
    return {**entry, "variants": variants}


def _tokens(runs: Runs) -> dict[str, list[list[int]]]:
    """Each engine variant's greedy tokens, one list per round that gave them."""
    return {_label(e, name): [r["tokens"] for r in results if r.get("tokens") is not None]
            for e, vs in runs.items() for name, results in vs.items()}


def agreement(tokens: dict[str, list[list[int]]], required: int) -> dict[str, Any]:
    """Greedy agreement asserted: in each round every engine's first `required` tokens (all of them when fewer)
    equal tracelm's of that round, and tracelm's equal its own of round 1. Each disagreement says where the two
    part (`parts_at`: the index of the first token that differs) and the two tokens there."""
    ours = tokens.get("tracelm") or []
    found = []
    for label, rounds in tokens.items():
        for r, toks in enumerate(rounds):
            ref = ours[0] if label == "tracelm" else ours[r] if r < len(ours) else None
            if ref is None or (label == "tracelm" and r == 0):
                continue
            same, n = common_prefix(toks, ref), min(len(toks), len(ref))
            if same < min(required, n):
                found.append({"engine": label, "round": r + 1, "parts_at": same,
                              "tracelm_token": ref[same], "engine_token": toks[same],
                              "against": "tracelm round 1" if label == "tracelm" else "tracelm"})
    return {"required_tokens": required, "ok": not found, "disagreements": found}


def _same_as_tracelm(runs: Runs, engines: dict[str, Any]) -> None:
    """Each variant's greedy tokens against tracelm's of the same round: the fewest that agree over the rounds."""
    tokens = _tokens(runs)
    ours = tokens.get("tracelm") or []
    for engine, vs in runs.items():
        for name in vs:
            entry = engines.get(engine, {})
            target = entry.get("variants", {}).get(name, {}) if "variants" in entry else entry
            toks = tokens[_label(engine, name)]
            if not toks or not ours or target.get("status") != "ok":
                continue
            refs = [ours[0]] * len(toks) if engine == "tracelm" else ours
            target["greedy_same_as_tracelm"] = min(common_prefix(t, ref) for t, ref in zip(toks, refs, strict=False))
            target["greedy_tokens"] = len(toks[0])


def _ratio(ours: dict[str, Any], other: dict[str, Any], field: str) -> tuple[list[float], str | None]:
    """The per-round ratios tracelm / other of one rate (rounds paired in order), and the variant of `other`."""
    if ours.get("status") != "ok" or other.get("status") != "ok":
        return [], None
    a, b = ours[field]["rounds"], other[field]["rounds"]
    return [round(x / y, 3) for x, y in zip(a, b, strict=False) if x and y], other.get("best", {}).get(field)


def _target_vs_bound(ours: dict[str, Any], other: dict[str, Any], field: str, target: float) -> dict[str, Any]:
    """For a prefill ratio, what its target asks of tracelm's prefill (target x the other's median) over tracelm's
    integer bound (bench's `prefill_int8_bound_tok_s`): above 1, no kernel on this path and precision meets it."""
    bound = ours.get("prefill_int8_bound_tok_s")
    if field != "prefill_tok_s" or not bound or other.get("status") != "ok" or field not in other:
        return {}
    return {"target_vs_int8_bound": round(target * other[field]["median"] / bound, 3)}


def build_report(model: str, threads: int, n_prompt: int, n_decode: int, runs: Runs,
                 agree_tokens: int = AGREE_TOKENS) -> dict[str, Any]:
    """The JSON report: per engine its figures over the rounds (and how many greedy tokens agree with tracelm's),
    the ratios with their per-round spread and target (a ratio is null when an engine has no figure), and the
    greedy agreement check."""
    engines = {e: summarize_engine({name: summarize_variant(results) for name, results in vs.items() if results})
               for e, vs in runs.items() if any(vs.values())}
    _same_as_tracelm(runs, engines)
    ours = engines.get("tracelm", {})
    ratios = {}
    for key, what, field, other, target in RATIOS:
        if other in OPTIONAL_OTHERS and other not in engines:
            continue
        values, variant = _ratio(ours, engines.get(other, {}), field)
        value = round(statistics.median(values), 3) if values else None
        ratios[key] = {"what": what, "value": value, "min": min(values, default=None),
                       "max": max(values, default=None), "rounds": values, "against": variant, "target": target,
                       "met": None if value is None else bool(value >= target),
                       **_target_vs_bound(ours, engines.get(other, {}), field, target)}
    n_rounds = max((len(r) for vs in runs.values() for r in vs.values()), default=0)
    return {"model": model, "threads": threads, "prompt_tokens": n_prompt, "decode_tokens": n_decode,
            "rounds": n_rounds, "engines": engines, "ratios": ratios,
            "agreement": agreement(_tokens(runs), agree_tokens)}


def run_compare(model_name: str, threads: int = 0, n_prompt: int = 256, n_decode: int = 128, repeats: int = 3,
                engines: Sequence[str] = ENGINES, timeout: float = 1800.0, activations: str = "int16",
                rounds: int = 5, agree_tokens: int = AGREE_TOKENS, llama_bench: str | None = None,
                progress: bool = False, turn_steps: int = TURN_STEPS) -> dict[str, Any]:
    """`tracelm bench --compare`: every engine (each when installed) on the same GGUF, ids and threads
    (tracelm's activations as given), taking turns over `rounds` rounds (decode in turns of `turn_steps` steps);
    llama-bench too when given its path."""
    from tracelm.io.loader import ModelFile
    from tracelm.tools.bench import bench_ids, cpu_times, steal_share

    if n_prompt < 1 or n_decode < 1:
        raise TracelmError(f"bench --compare: prompt tokens ({n_prompt}) and decode tokens ({n_decode}) must be >= 1")
    if rounds < 1 or repeats < 1 or turn_steps < 1 or agree_tokens < 0:
        raise TracelmError(f"bench --compare: rounds ({rounds}), repeats ({repeats}) and turn steps ({turn_steps}) "
                           f"must be >= 1, agree tokens ({agree_tokens}) >= 0")
    unknown = [e for e in engines if e not in ENGINE_CLASSES]
    if unknown:
        raise TracelmError(f"bench --compare: unknown engine {unknown[0]!r} (known: {', '.join(ENGINES)})")
    if "tracelm" not in engines:  # every ratio and the greedy agreement are against tracelm
        raise TracelmError(f"bench --compare: the engines ({', '.join(engines) or 'none'}) must include tracelm")
    if llama_bench is not None and not (os.path.isfile(llama_bench) and os.access(llama_bench, os.X_OK)):
        raise TracelmError(f"--llama-bench {llama_bench}: not an executable file")
    source = ModelFile(model_name)
    if source.kind != "gguf":
        raise TracelmError(f"{source.path}: bench --compare needs a GGUF file (the one file all engines read)")
    threads = threads if threads > 0 else (os.cpu_count() or 1)
    ids = bench_ids(source.tokenizer, n_prompt)
    load_before, cpu_before = os.getloadavg()[0], cpu_times()
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if progress else (lambda line: None)
    runs = run_rounds(str(source.path), ids, n_decode, threads, repeats, rounds, engines, timeout,
                      {"tracelm": {"activations": activations}}, llama_bench, log, turn_steps,
                      footprint(source, n_prompt + n_decode + CTX_SLACK))
    report = build_report(Path(source.path).name, threads, n_prompt, n_decode, runs, agree_tokens)
    report["turn_steps"] = turn_steps
    if llama_bench:
        report["llama_bench_command"] = " ".join(llama_bench_command(llama_bench, str(source.path), n_prompt,
                                                                     n_decode, threads))
    # other work on the machine slows the engines unequally: say how busy it was
    report["load_average_1m"] = {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2),
                                 "cores": os.cpu_count()}
    report["cpu_steal_share"] = steal_share(cpu_before, cpu_times())  # and how much of it its host kept
    report["cpu"] = cpu_name()
    return report


def cpu_name(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The processor's name as the OS gives it (Linux: /proc/cpuinfo's first `model name`), so that a report says
    which machine its figures are from; None where there is none."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    return value.strip() or None
    except OSError:
        pass
    return None


# --- the table ----------------------------------------------------------------------------------------------


def _range(s: dict[str, Any] | None, fmt: str) -> str:
    if not s:
        return "-"
    return f"{s['median']:{fmt}} ({s['min']:{fmt}}-{s['max']:{fmt}})"


LABEL = 45  # the engine column: "llama.cpp (flash_attn off, no extra buffers)"


def _engine_line(label: str, r: dict[str, Any], version: str) -> str:
    if r["status"] != "ok":
        return f"{label:14s} {r['status']}: {r.get('error', '')}"
    same = f"{r['greedy_same_as_tracelm']}/{r['greedy_tokens']}" if "greedy_same_as_tracelm" in r else "-"
    load = f"{r['load_seconds']['median']:8.2f}" if "load_seconds" in r else f"{'-':>8s}"
    rss = f"{r['peak_rss_mb']:12.1f}" if "peak_rss_mb" in r else f"{'-':>12s}"
    return (f"{label:{LABEL}s} {version:16s} {load} {_range(r.get('prefill_tok_s'), '.1f'):>26s} "
            f"{_range(r.get('decode_tok_s'), '.2f'):>26s} {rss}  {same}")


def _engine_lines(name: str, r: dict[str, Any]) -> list[str]:
    if r["status"] != "ok":
        return [_engine_line(name, r, "")]
    version = str(r.get("version", ""))
    variants = r.get("variants")
    lines = [_engine_line(_label(name, v), vr, version) for v, vr in variants.items()] if variants else \
        [_engine_line(name, r, version)]
    for v, vr in (variants or {DEFAULT: r}).items():
        if vr.get("note"):
            lines.append(f"{'':14s} note{f' ({v})' if variants else ''}: {vr['note']}")
    if variants:
        lines.append(f"{'':14s} {name}'s figure: prefill {r['best']['prefill_tok_s']}, decode "
                     f"{r['best']['decode_tok_s']} (the best median)")
    if r.get("attention"):
        lines.append(f"{'':14s} attention implementation: {r['attention']}")
    if r.get("kernels"):
        lines.append(f"{'':14s} kernels path: {r['kernels']} (self-test: {r.get('selftest', 'not recorded')})")
    if r.get("system_info"):
        lines.append(f"{'':14s} system info: {r['system_info']}")
    if name == "llama.cpp":
        flags = r.get("build_flags")
        shown = " ".join(f"{k}={v}" for k, v in sorted(flags.items())) if flags else \
            "not recorded (no ggml-config.cmake in the install)"
        lines.append(f"{'':14s} build flags: {shown}")
    for key in ("cpu_info", "backends"):
        if r.get(key):
            lines.append(f"{'':14s} {key.replace('_', ' ')}: {r[key]}")
    return lines


def _rounds_text(n: int) -> str:
    return f"{n} round{'s' if n != 1 else ''}"


def _turns_text(steps: int | None) -> str:
    return f", {steps} decode step{'s' if steps != 1 else ''} a turn" if steps else ""


def format_table(report: dict[str, Any]) -> str:
    threads = f"{report['threads']} thread{'s' if report['threads'] != 1 else ''}"
    lines = [f"{report['model']}: {threads}, {report['prompt_tokens']}-token prompt, "
             f"{report['decode_tokens']} greedy decode tokens, {_rounds_text(report.get('rounds', 1))} (engines "
             f"taking turns{_turns_text(report.get('turn_steps'))}; median (min-max) over the rounds)"]
    load = report.get("load_average_1m")
    if load:
        cpu = f" {report['cpu']}" if report.get("cpu") else ""
        lines.append(f"load average (1 min) {load['before']:.2f} before, {load['after']:.2f} after, on {load['cores']} "
                     f"cores{cpu} (other work slows the engines unequally)")
    if report.get("cpu_steal_share"):
        lines.append(f"the host took {100 * report['cpu_steal_share']:.1f} % of the machine's CPU time (steal): the "
                     "rates are low by about that much, in the rounds it fell in")
    if report.get("llama_bench_command"):
        lines.append(f"llama-bench, each round: {report['llama_bench_command']}")
    lines.append(f"{'engine':{LABEL}s} {'version':16s} {'load s':>8s} {'prefill tok/s':>26s} {'decode tok/s':>26s} "
                 f"{'peak RSS MB':>12s}  greedy = tracelm")
    for name, r in report["engines"].items():
        lines += _engine_lines(name, r)
    lines.append("")
    for ratio in report["ratios"].values():
        value = "n/a" if ratio["value"] is None else f"{ratio['value']:.2f}x"
        spread_ = "" if ratio["value"] is None else f"({ratio['min']:.2f}-{ratio['max']:.2f})"
        met = {None: "", True: "met", False: "not met"}[ratio["met"]]
        against = f" vs {ratio['against']}" if ratio.get("against") else ""
        asks = ratio.get("target_vs_int8_bound", 0)
        beyond = f" (the target is {asks:.2f}x tracelm's integer bound)" if asks > 1 else ""
        lines.append(f"{ratio['what'] + against:58s} {value:>7s} {spread_:15s} target >= {ratio['target']}x "
                     f"{met}{beyond}".rstrip())
    lines.append("")
    lines.append(agreement_line(report["agreement"]))
    return "\n".join(lines)


def agreement_line(check: dict[str, Any]) -> str:
    if check["ok"]:
        return (f"greedy agreement: ok (every engine's first {check['required_tokens']} greedy tokens are tracelm's, "
                "in every round)")
    parts = [f"{d['engine']} parts from {d['against']} at token {d['parts_at']} in round {d['round']} "
             f"({d['engine_token']} where tracelm has {d['tracelm_token']})" for d in check["disagreements"]]
    return f"greedy agreement: FAILED (the first {check['required_tokens']} tokens must agree): " + "; ".join(parts)
