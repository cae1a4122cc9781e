"""`tracelm bench`: load time, prefill and decode rates, peak RSS, against limits measured in the same run.

The machine's limits are measured in a child process (so its 1 GiB probe buffer does not count in the
model's peak RSS): read bandwidth over 1 GiB, the better of a matrix-vector product (the access pattern of
decode) and the kernels' pool reading it at the bench's thread count (decode's threads), and the sgemm rate of a
large square product. From them:
- decode roofline: f32 weight bytes / bandwidth (each decoded token reads every weight once);
- prefill bound: sgemm rate / FLOPs per prompt token (matrix products + attention scores);
- on the kernels, the prompt's integer bound: the path's integer dot at its peak on the bench's threads
  (`kernels.dot_peak`) / the quantized weights' int8 products per prompt token (times the activations' halves).
It also times one pass's weight products alone (`product_pass_seconds`), to show how much of each limit the
numpy/OpenBLAS products themselves leave for the rest of the graph. Each decode step and each such pass is timed: the
report gives their median, min and max beside the mean rate and the best pass (a shared machine's slow moments).
"""

from __future__ import annotations

import os
import resource
import statistics
import time
import types
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from tracelm.session import Session
from tracelm.state.run_config import RunConfig
from tracelm.tools.child import run_child

BENCH_TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable type made books "
    "cheaper to produce and easier to copy. Within a few decades, presses spread across Europe, and "
    "the number of printed pages grew faster than anyone could read them. Scholars argued about what "
    "this meant for memory, for authority and for the slow work of learning. "
)


def _seconds(fn: Any, repeat: int) -> list[float]:
    """The time of each of `repeat` calls of fn, after one call untimed (a warm-up)."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def best_seconds(fn: Any, repeat: int) -> float:
    """The best of `repeat` timed calls of fn, after one untimed."""
    return min(_seconds(fn, repeat))


def spread(values: list[float], digits: int = 2) -> dict[str, float]:
    """Median, min and max of some measurements."""
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits)}


def _read_bandwidth(nbytes: int, threads: int) -> dict[str, float]:
    """GB/s read from a buffer of nbytes two ways, each the best of 5: a matrix-vector product (numpy's BLAS, its
    own threads: decode's access pattern) and the kernels' pool at `threads` (0: all) reading it in 64 KiB chunks
    (all_finite: every byte loaded, nothing written), as decode's own threads read the weights."""
    import tracelm.kernels as kernels

    w = np.ones((nbytes // 4096, 1024), np.float32)
    x = np.ones(1024, np.float32)
    sgemv = w.nbytes / best_seconds(lambda: w @ x, 5) / 1e9
    if threads > 0:
        kernels.set_threads(threads)
    flat = w.reshape(-1)
    pool = w.nbytes / best_seconds(lambda: kernels.all_finite(flat), 5) / 1e9
    return {"sgemv_gb_s": round(sgemv, 2), "kernels_read_gb_s": round(pool, 2), "threads": kernels.threads()}


def machine_probe(threads: int = 0) -> dict[str, Any]:
    """Measured read bandwidth (GB/s: the better of the two reads, each reported) and sgemm rate (GFLOP/s) of this
    machine, now."""
    reads = _read_bandwidth(1 << 30, threads)
    n = 2048
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    sgemm = 2 * n**3 / best_seconds(lambda: a @ a, 5) / 1e9
    return {"bandwidth_gb_s": max(reads["sgemv_gb_s"], reads["kernels_read_gb_s"]), "bandwidth_reads": reads,
            "sgemm_gflop_s": round(sgemm, 1)}


def open_session(model_name: str, **fields: Any) -> Session:
    """The model opened for a bench as `tracelm run` opens it: a Session on the built-in defaults with `fields`
    (threads, compute, weights...) set."""
    return Session(model_name, attrs.evolve(RunConfig(), **fields))


def prefill_flops_per_token(cfg: Any, n_prompt: int) -> float:
    """FLOPs per prompt token: the block matrix products, causal attention (q k^T and p v over an
    average of n_prompt/2 keys), and the head for the last position only, spread over the prompt."""
    d, q, kv, ff = cfg.n_embd, cfg.q_dim, cfg.kv_dim, cfg.n_ff
    block = 2 * (d * (q + 2 * kv) + q * d + 3 * d * ff)
    attention = 2 * 2 * q * (n_prompt + 1) / 2
    return cfg.n_layer * (block + attention) + 2 * cfg.n_vocab * d / n_prompt


def int8_products_per_token(w: Any, n_prompt: int) -> float:
    """int8 products per prompt token of the quantized weights (the kernels' integer work): every block's four
    products at each position and the head at the last, each weight times the activations' halves (2 under int16,
    1 under int8); float weights count none."""
    import tracelm.kernels as kernels
    from tracelm.state.records import QMatrix

    def products(m: Any) -> int:
        if not isinstance(m, QMatrix):
            return 0
        return m.halves * m.shape[1] * sum(b.shape[0] for b, t in m.parts if t not in kernels.FLOATS)

    block = sum(products(lw.wqkv) + products(lw.wo) + products(lw.w_gate_up) + products(lw.w_down)
                for lw in w.layers)
    return block + products(w.output) / n_prompt


def prefill_int8_bound(session: Session, n_prompt: int) -> dict[str, Any]:
    """The prompt's integer work against the path's integer dot at its peak (`kernels.dot_peak`, on the run's
    threads, timed now): the peak, and the prefill rate no product of these quantized weights can pass on this path.
    Empty on the reference path or the portable one, or where no weight is quantized."""
    import tracelm.kernels as kernels

    per_token = int8_products_per_token(session.model.weights, n_prompt)  # 0 on the reference path's f32 weights
    peak = kernels.dot_peak() if per_token else None
    if not peak:
        return {}
    return {"int8_dot_peak": peak, "prefill_int8_bound_tok_s": round(peak["int8_products_g_s"] * 1e9 / per_token, 1)}


def int8_bound(session: Session, n_prompt: int, prefill_tok_s: float, prefill_products_tok_s: float | None
               ) -> dict[str, Any]:
    """`prefill_int8_bound` and the share of it the prefill (and its products alone) reach."""
    report = prefill_int8_bound(session, n_prompt)
    if not report:
        return {}
    bound = report["prefill_int8_bound_tok_s"]
    return {**report, "prefill_vs_int8_bound": round(prefill_tok_s / bound, 3),
            **({"prefill_products_vs_int8_bound": round(prefill_products_tok_s / bound, 3)}
               if prefill_products_tok_s else {})}


def bench_ids(tokenizer: Any, n: int) -> list[int]:
    ids = tokenizer.encode(BENCH_TEXT)
    return (ids * (n // len(ids) + 1))[:n]


def run_bench(model_name: str, n_prompt: int = 256, n_decode: int = 128, n_ctx: int = 1024,
              weights: str = "resident", **engine: Any) -> dict[str, Any]:
    """`weights="streamed"` on `compute="reference"`: prefill is timed once (each pass dequantizes every block),
    and the report adds the streamed mode's RSS bound and whether its logits equal resident mode's (see
    `streamed_report`). On the kernels the weights are the file's blocks: `weights_gb_s` is the rate decode
    reads them at, against the machine's bandwidth, and the RSS budget is the file + KV cache + 150 MB."""
    probe = run_child(machine_probe, int(engine.get("threads") or 0))
    with open_session(model_name, weights=weights, **engine) as session:
        return _model_bench(session, probe, n_prompt, n_decode, n_ctx)


def _model_bench(session: Session, probe: dict[str, float], n_prompt: int, n_decode: int, n_ctx: int
                 ) -> dict[str, Any]:
    model, weights, compute = session.model, session.cfg.weights, session.cfg.compute
    cfg = model.cfg
    cpu_before = cpu_times()
    runner = session.new_runner(max(n_ctx, n_prompt + n_decode))
    ids = bench_ids(model.tokenizer, n_prompt)

    def prefill() -> None:
        runner.cache.reset()
        runner.prefill(ids)

    dequantizing = weights == "streamed" and compute == "reference"
    prefill_s = best_seconds(prefill, 1 if dequantizing else 3)
    token = int(np.argmax(runner.prefill(ids).values[-1]))
    steps = []  # each step's seconds: a shared machine's slow moments show as a spread, not as a lower mean alone
    c0 = time.process_time()
    for _ in range(n_decode):
        t0 = time.perf_counter()
        token = int(np.argmax(runner.step(token).values[-1]))
        steps.append(time.perf_counter() - t0)
    decode_s, decode_cpu_s = sum(steps), time.process_time() - c0

    # the run's high-water mark, taken before the products-alone ceilings below, whose own inputs and outputs (a
    # 7B's 256 rows: ~100 MB of f32) are the bench's harness, not the model's run
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    weight_bytes = model.weights.nbytes
    roofline_tok_s = probe["bandwidth_gb_s"] * 1e9 / weight_bytes
    sgemm_bound_tok_s = probe["sgemm_gflop_s"] * 1e9 / prefill_flops_per_token(cfg, n_prompt)
    ceilings = {}
    prefill_products_tok_s = None
    if not dequantizing:  # the same limits for the weight products alone, every other stage free
        passes = product_pass_times(model.weights, cfg, 1, 10)
        decode_products_tok_s = 1 / min(passes)
        prefill_products_tok_s = n_prompt / product_pass_seconds(model.weights, cfg, n_prompt, 3)
        ceilings = {
            "decode_products_tok_s": round(decode_products_tok_s, 2),
            "decode_products_vs_roofline": round(decode_products_tok_s / roofline_tok_s, 3),
            "decode_products_ms": spread([1e3 * s for s in passes], 3),  # the best pass and the passes' median
            "prefill_products_tok_s": round(prefill_products_tok_s, 1),
            "prefill_products_vs_sgemm_bound": round(prefill_products_tok_s / sgemm_bound_tok_s, 3),
        }
    if compute == "kernels":
        rss_budget = model.path.stat().st_size + runner.cache.nbytes + 150 * 2**20
    else:
        rss_budget = weight_bytes + runner.cache.nbytes + 300 * 2**20
    streamed = streamed_report(session, runner.cache.nbytes, peak_rss, ids[:16]) if dequantizing else {}
    return {
        "compute": compute,
        "weights": weights,
        "model": str(model.path.name),
        "load_seconds": round(model.load_seconds, 3),
        "prefill_tokens": n_prompt,
        "prefill_tok_s": round(n_prompt / prefill_s, 1),
        "decode_tokens": n_decode,
        "decode_tok_s": round(n_decode / decode_s, 2),
        "decode_step_ms": spread([1e3 * s for s in steps], 3),
        "decode_cpu_ms_per_token": round(1e3 * decode_cpu_s / n_decode, 1),  # all threads; steadier under load
        "peak_rss_mb": round(peak_rss / 2**20, 1),
        **({"rss_budget_mb": round(rss_budget / 2**20, 1)} if not streamed else streamed),
        "weight_mb": round(weight_bytes / 2**20, 1),  # as held: f32 (reference) or the file's blocks (kernels)
        "huge_pages_mb": huge_pages_mb(),
        "cpu_steal_share": steal_share(cpu_before, cpu_times()),  # the host's share of this run's CPU time
        "weights_gb_s": round(weight_bytes * n_decode / decode_s / 1e9, 2),  # read by decode, per second
        "kv_cache": session.cfg.kv_cache,
        "kv_cache_mb": round(runner.cache.nbytes / 2**20, 1),
        **probe,
        "decode_roofline_tok_s": round(roofline_tok_s, 2),
        "decode_vs_roofline": round(n_decode / decode_s / roofline_tok_s, 3),
        "prefill_sgemm_bound_tok_s": round(sgemm_bound_tok_s, 1),
        "prefill_vs_sgemm_bound": round(n_prompt / prefill_s / sgemm_bound_tok_s, 3),
        **ceilings,
        **int8_bound(session, n_prompt, n_prompt / prefill_s, prefill_products_tok_s),
        **(kernels_in_use() if compute == "kernels" else {}),
    }


KERNELS_ENV = ("TRACELM_KERNELS", "TRACELM_K_AHEAD", "TRACELM_PREFETCH_HINT", "TRACELM_TASKS_PER_THREAD",
               "TRACELM_SPIN_US")


def cpu_times(stat: str = "/proc/stat") -> tuple[int, int] | None:
    """The machine's CPU time so far, every CPU, in clock ticks: (all of it, the part stolen -- time a virtual CPU
    was ready to run while its host ran something else). None where /proc/stat does not say (not Linux, or no steal
    column)."""
    try:
        fields = Path(stat).read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    ticks = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal (guest time is in user)
    return sum(ticks), ticks[7]


def steal_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of the machine's CPU time between two `cpu_times` that its host stole. On a shared virtual machine
    a run with a share well above 0 was given less CPU than its threads asked for (with 2 virtual CPUs, 0.5: one
    core's worth), so its rates are low by about that much and say nothing of the engine."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    return round((after[1] - before[1]) / (after[0] - before[0]), 3)


def huge_pages_mb(smaps: str = "/proc/self/smaps_rollup") -> float | None:
    """MB of this process's memory on transparent huge pages (Linux's AnonHugePages; None where it does not say):
    resident weights are one arena advised for them, and on 4 KB pages decode's streams lose the hardware's
    prefetch at every page end, so a roofline comparison wants to know."""
    try:
        text = Path(smaps).read_text()
    except OSError:
        return None
    kb = [int(line.split()[1]) for line in text.splitlines() if line.startswith("AnonHugePages:")]
    return round(kb[0] / 1024, 1) if kb else None


def kernels_in_use() -> dict[str, Any]:
    """The kernel path a bench runs on and each path's self-test against the portable path ("passed: N cases in
    T ms", "refused: ...", "untested", "unsupported"): a report names the path it measured and why it was trusted;
    the decode pairs' prefetch distance and the weights' prefetch hint in use (`k_ahead`, `prefetch_hint`); and the
    kernels' tuning variables set in the environment (read at import: TRACELM_KERNELS, TRACELM_K_AHEAD,
    TRACELM_PREFETCH_HINT, TRACELM_TASKS_PER_THREAD, TRACELM_SPIN_US), so a sweep's reports say what each ran with."""
    import tracelm.kernels as kernels

    tuning = {k: os.environ[k] for k in KERNELS_ENV if os.environ.get(k)}
    return {"kernels_path": kernels.path(), "selftest": {k: f"{s}: {d}" for k, (s, d) in kernels.selftest().items()},
            "k_ahead": kernels.k_ahead(), "prefetch_hint": kernels.prefetch_hint(),
            **({"kernels_env": tuning} if tuning else {})}


def product_pass_seconds(w: Any, cfg: Any, rows: int, repeat: int, head_rows: int = 1) -> float:
    """Best time of the weight products of one forward pass over `rows` positions, alone: a pass cannot beat it
    however cheap the norms, RoPE, attention and the Python between them become."""
    return min(product_pass_times(w, cfg, rows, repeat, head_rows))


def product_pass_times(w: Any, cfg: Any, rows: int, repeat: int, head_rows: int = 1) -> list[float]:
    """The time of each of `repeat` passes of the weight products of one forward pass over `rows` positions, alone
    (after one untimed): every block's four products through the stages' `linear`, in graph order, and the head for
    the last `head_rows` rows (a prompt's last; every sequence's in a server pass)."""
    from tracelm.stages.linear import linear

    rng = np.random.default_rng(0)
    x, attn, act = (rng.standard_normal((rows, n), dtype=np.float32) for n in (cfg.n_embd, cfg.q_dim, cfg.n_ff))

    def one_pass() -> None:
        for lw in w.layers:
            linear(x, lw.wqkv), linear(attn, lw.wo), linear(x, lw.w_gate_up), linear(act, lw.w_down)
        linear(x[-head_rows:], w.output)

    return _seconds(one_pass, repeat)


STREAMED_SLACK = 150 * 2**20  # the allowance over file + one block in f32 + KV cache


def streamed_report(session: Session, kv_bytes: int, peak_rss: int, check_ids: list[int], n_check_decode: int = 4
                    ) -> dict[str, Any]:
    """Streamed mode against its targets: peak RSS against the bound (GGUF file size + the largest block in
    f32 + KV cache + 150 MB), and logits against resident mode's, computed in a child process (whose memory
    does not count in this one's peak): every position of `check_ids` in one pass, then `n_check_decode`
    greedy steps, compared bit for bit."""
    model = session.model
    file_bytes = model.path.stat().st_size
    layer_bytes = model.weights.layers.layer_nbytes
    bound = file_bytes + layer_bytes + kv_bytes + STREAMED_SLACK
    from threadpoolctl import threadpool_info

    ids, streamed = logits_path(session, check_ids, n_check_decode)
    # the child uses this process's BLAS thread count: OpenBLAS's sums can differ between 1 and 2 threads
    threads = max((p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"), default=0)
    resident = run_child(compare_resident, str(model.path), ids, streamed, threads)
    return {
        "file_mb": round(file_bytes / 2**20, 1),
        "layer_f32_mb": round(layer_bytes / 2**20, 1),
        "rss_bound_mb": round(bound / 2**20, 1),
        "rss_vs_bound": round(peak_rss / bound, 3),
        **resident,
    }


def logits_path(model: Session | Any, prompt_ids: list[int], n_decode: int, feed: list[int] | None = None
                ) -> tuple[dict[str, list[int]], np.ndarray]:
    """Logits of every prompt position (one pass) and of `n_decode` decode steps after it, each feeding the
    greedy choice (or feed[i] when given), on a Session or a loaded model: the ids fed ({"prompt",
    "decode"}) and the logits [len(prompt) + n_decode, vocab]."""
    session = model if isinstance(model, Session) else Session(model)
    runner = session.new_runner(len(prompt_ids) + n_decode)
    rows = [runner.logits(prompt_ids)]
    fed: list[int] = []
    for i in range(n_decode):
        fed.append(int(np.argmax(rows[-1][-1])) if feed is None else int(feed[i]))
        rows.append(np.asarray(runner.step(fed[-1]).values))
    return {"prompt": list(prompt_ids), "decode": fed}, np.concatenate(rows)


def compare_resident(model_path: str, ids: dict[str, list[int]], streamed: np.ndarray, threads: int = 0
                     ) -> dict[str, Any]:
    """In a child of `streamed_report`: resident logits on numpy's route (with `threads` BLAS threads, 0: the
    default), fed the same ids, against the streamed ones."""
    with open_session(model_path, compute="reference", threads=threads) as session:
        _, resident = logits_path(session, ids["prompt"], len(ids["decode"]), ids["decode"])
    return {"logits_equal_resident": bool(np.array_equal(resident, streamed)),
            "logits_max_abs_diff": float(np.abs(resident - streamed).max()),
            "logits_checked": f"{len(ids['prompt'])} prompt positions + {len(ids['decode'])} decode steps"}


def trace_overhead(model_name: str, n_decode: int = 64, repeats: int = 7, n_prompt: int = 32,
                   **engine: Any) -> dict[str, Any]:
    """Decode tok/s untraced, at level summary and at level digest, measured in one process.

    Three runners (one per level; the traced ones write to /dev/null, rendering, chaining and writing as
    in a real run, with a token event per step) decode the same greedy tokens in lock step: every step
    runs the three levels back to back in a rotating order, so a change in machine load hits all three
    alike. That is one run; there are `repeats` runs, each on fresh runners. A level's time per token is the
    median of its step times over all runs' steps; the ratios (traced / untraced tok/s) and overheads are
    each run's, from its own medians, and their median over the runs (issue 13: "seven runs: median"), the
    runs' figures listed beside. `noise` is the untraced steps' 90th / 10th percentile.

    The same is measured in process CPU time (`cpu_*`): on a machine shared with other work the wall
    time of every step stretches with what the others do, the CPU time much less. With one BLAS thread
    (`--threads 1`) CPU time per token is what wall time per token would be on an idle machine."""
    from tracelm.session import Tracer

    with open_session(model_name, **engine) as session:
        return _trace_overhead(session, n_decode, repeats, n_prompt, Tracer)


def _trace_overhead(session: Session, n_decode: int, repeats: int, n_prompt: int, Tracer: Any) -> dict[str, Any]:
    model = session.model
    ids = bench_ids(model.tokenizer, n_prompt)
    levels = ("off", "summary", "digest")
    steps: dict[str, list[float]] = {lv: [] for lv in levels}
    cpu: dict[str, list[float]] = {lv: [] for lv in levels}
    runs: list[dict[str, float]] = []  # each run's median ms per token per level
    with open(os.devnull, "wb") as sink:  # as open_trace opens a trace file
        for _ in range(repeats):
            tracers = {lv: Tracer(sink, lv) if lv != "off" else None for lv in levels}
            runners = {lv: session.new_runner(n_prompt + n_decode + 1) for lv in levels}
            tokens = {lv: int(np.argmax(runners[lv].prefill(ids, tracer=tracers[lv]).values[-1])) for lv in levels}
            for i in range(n_decode):
                for lv in levels[i % 3:] + levels[: i % 3]:
                    runner, tracer, token = runners[lv], tracers[lv], tokens[lv]
                    c0, t0 = time.process_time(), time.perf_counter()
                    if tracer is not None:  # drains the previous pass's stage events, as generate does
                        tracer.event("token", id=token, piece=model.tokenizer.piece(token), prob=0.0)
                    tokens[lv] = int(np.argmax(runner.step(token, tracer).values[-1]))
                    steps[lv].append(time.perf_counter() - t0)
                    cpu[lv].append(time.process_time() - c0)
            for tracer in tracers.values():
                if tracer is not None:
                    tracer.flush()
            if len({tokens[lv] for lv in levels}) != 1:
                raise RuntimeError("traced and untraced decoding chose different tokens")
            runs.append({lv: float(np.median(steps[lv][-n_decode:])) for lv in levels})
    median = {lv: float(np.median(t)) for lv, t in steps.items()}
    rate = {lv: 1.0 / median[lv] for lv in levels}
    cpu_ms = {lv: 1e3 * float(np.median(t)) for lv, t in cpu.items()}
    off = np.asarray(steps["off"])
    ratio = {lv: [run["off"] / run[lv] for run in runs] for lv in levels[1:]}  # each run's traced / untraced tok/s
    return {
        "model": str(model.path.name),
        "decode_tokens": n_decode,
        "repeats": repeats,
        **{f"decode_tok_s_{lv}": round(rate[lv], 2) for lv in levels},
        **{f"ms_per_token_{lv}": round(1e3 * median[lv], 3) for lv in levels},
        **{f"{lv}_vs_off": round(float(np.median(ratio[lv])), 4) for lv in levels[1:]},
        **{f"{lv}_overhead_pct": round(100 * (1 - float(np.median(ratio[lv]))), 2) for lv in levels[1:]},
        **{f"{lv}_overhead_pct_runs": [round(100 * (1 - r), 2) for r in ratio[lv]] for lv in levels[1:]},
        "noise_off_p90_vs_p10": round(float(np.percentile(off, 90) / np.percentile(off, 10)), 3),
        **{f"cpu_ms_per_token_{lv}": round(cpu_ms[lv], 3) for lv in levels},
        "cpu_summary_overhead_pct": round(100 * (cpu_ms["summary"] / cpu_ms["off"] - 1), 2),
        "cpu_digest_overhead_pct": round(100 * (cpu_ms["digest"] / cpu_ms["off"] - 1), 2),
    }


# Byte offsets of the f16 scales in a block of the K-quants, which gguf cannot quantize: their test and bench
# matrices are random bytes with finite scales there.
K_SCALES = {12: (0, 2), 13: (0, 2), 14: (208,)}  # Q4_K: d, dmin; Q5_K: d, dmin; Q6_K: d


def synthetic_blocks(qtype: int, shape: tuple[int, int], seed: int = 0) -> np.ndarray:
    """A [rows, cols] matrix of GGML type `qtype` as GGUF rows (uint8 [rows, bytes per row]): gguf's
    quantization of Gaussian weights, or for the K-quants random bytes with scales of about 1e-2."""
    import gguf

    import tracelm.kernels as kernels

    rng = np.random.default_rng(seed)
    if qtype in K_SCALES:
        block, size = kernels.BLOCK[qtype]
        raw = rng.integers(0, 256, (shape[0] * shape[1] // block, size), dtype=np.uint8)
        for at in K_SCALES[qtype]:
            raw[:, at : at + 2] = np.float16(rng.uniform(0.002, 0.02, (len(raw), 1))).view(np.uint8)
        return raw.reshape(shape[0], -1)
    w = rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[1])
    return np.ascontiguousarray(gguf.quants.quantize(w, gguf.GGMLQuantizationType(qtype))).view(np.uint8)


def bench_kernel_types(shape: tuple[int, int] = (8192, 4096), rows: tuple[int, ...] = (1, 8, 256)) -> dict[str, Any]:
    """Every type's product x[M, K] W^T on the kernels at M = rows, on a `shape` [N, K] matrix larger than the
    caches, next to numpy's f32 product with the same (dequantized) matrix: ms, GB/s of the type's bytes
    (numpy: of the f32 bytes), GFLOP/s, and numpy's time over the kernels'; for the types `kernels.pack` takes,
    also the product on the packed matrix (what resident weights hold) and the file's rows over it."""
    import gguf

    import tracelm.kernels as kernels

    report: dict[str, Any] = {"shape": list(shape), "kernels_path": kernels.path(), "threads": kernels.threads()}
    for qtype in sorted(kernels.SUPPORTED):
        blocks = synthetic_blocks(qtype, shape)
        w32 = kernels.dequantize(blocks, qtype)
        packed = kernels.pack(blocks, qtype) if kernels.packable(qtype, shape[0]) else None
        for m in rows:
            x = np.random.default_rng(1).standard_normal((m, shape[1]), dtype=np.float32)
            out = np.empty((m, shape[0]), np.float32)
            scratch = np.empty(kernels.scratch_bytes(m, shape[1], qtype), np.uint8)
            ours = best_seconds(lambda: kernels.matmul(x, blocks, qtype, out, scratch), 3)  # noqa: B023
            theirs = best_seconds(lambda: x @ w32.T, 3)  # noqa: B023
            flops = 2 * m * shape[0] * shape[1]
            report[f"{gguf.GGMLQuantizationType(qtype).name}_M{m}"] = {
                "ms": round(ours * 1e3, 3), "gb_s": round(blocks.nbytes / ours / 1e9, 1),
                "gflop_s": round(flops / ours / 1e9, 1), "numpy_f32_ms": round(theirs * 1e3, 3),
                "numpy_f32_gb_s": round(w32.nbytes / theirs / 1e9, 1),
                "numpy_f32_gflop_s": round(flops / theirs / 1e9, 1), "numpy_over_kernels": round(theirs / ours, 2)}
            if packed is not None:
                p = best_seconds(lambda: kernels.matmul(x, packed, qtype, out, scratch, packed=True), 3)  # noqa: B023
                report[f"{gguf.GGMLQuantizationType(qtype).name}_M{m}"].update(
                    packed_ms=round(p * 1e3, 3), rows_over_packed=round(ours / p, 2))
    return report


def bench_kernels(model_name: str, rows: tuple[int, ...] = (1, 2, 4, 8, 256), compute: str = "kernels"
                  ) -> dict[str, Any]:
    """The products under the stages, at the shapes of a real model: dequantization throughput per tensor
    type in the file, and the weight products x[M, in] @ W[out, in]^T for M = rows, swept over every
    layer, as ms per sweep, GB/s of weights read and GFLOP/s. One kind's sweep (e.g. 30 layers of gate/up,
    212 MB for SmolLM2) can stay in a large last-level cache between repetitions: compare rows M against
    each other (the cost of M > 1 against a matrix-vector product), and take DRAM rates from `tracelm bench`."""
    from tracelm.io.dequant import dequantize
    from tracelm.io.gguf_file import GGUFFile
    from tracelm.io.loader import ModelFile

    source = ModelFile(model_name)
    report: dict[str, Any] = {"model": source.path.name}
    if isinstance(source.gguf, GGUFFile):
        by_type: dict[str, list[Any]] = {}
        for t in source.gguf.tensors.values():
            by_type.setdefault(t.qtype.name, []).append(t)
        for name, tensors in sorted(by_type.items()):
            raw = [(source.gguf.raw(t.name), t.qtype, t.shape) for t in tensors]
            seconds = best_seconds(lambda raw=raw: [dequantize(*r) for r in raw], 2)
            out_bytes = sum(4 * int(np.prod(r[2])) for r in raw)
            report[f"dequant_{name}_gb_s"] = round(out_bytes / seconds / 1e9, 2)
    weights = source.load(progress=False, compute=compute).weights
    report["compute"] = compute
    kinds = {"qkv": "wqkv", "attn_output": "wo", "ffn_gate_up": "w_gate_up", "ffn_down": "w_down"}
    for kind, field in kinds.items():
        mats = [getattr(lw, field) for lw in weights.layers]
        for m_rows in rows:
            x = np.random.default_rng(0).standard_normal((m_rows, mats[0].shape[1]), dtype=np.float32)
            report[f"{kind}_M{m_rows}"] = _product_rates(x, mats)
    for m_rows in rows:
        x = np.random.default_rng(0).standard_normal((m_rows, weights.output.shape[1]), dtype=np.float32)
        report[f"head_M{m_rows}"] = _product_rates(x, [weights.output])
    return report


def _product_rates(x: np.ndarray, mats: list[Any]) -> dict[str, float]:
    """x @ w.T over `mats` (f32 arrays or QMatrix) through the stages' `linear` (ms, GB/s of weights as held,
    GFLOP/s); on quantized blocks the part of it that quantizes x (`quantize_ms`); for a few rows of f32 also as
    one plain matrix-matrix product (`sgemm_ms`), the call `linear` avoids there."""
    import tracelm.kernels as kernels
    from tracelm.stages.linear import GEMV_ROWS, linear
    from tracelm.state.records import QMatrix

    seconds = best_seconds(lambda: [linear(x, w) for w in mats], 3)
    flops = sum(2 * x.shape[0] * w.shape[0] * w.shape[1] for w in mats)
    rates = {"ms": round(seconds * 1e3, 4), "gb_s": round(sum(w.nbytes for w in mats) / seconds / 1e9, 1),
             "gflop_s": round(flops / seconds / 1e9, 1)}
    quantized = [(qtype, w.halves) for w in mats if isinstance(w, QMatrix) for _b, qtype in w.parts
                 if qtype not in kernels.FLOATS]
    if quantized:  # the part of `ms` that quantizes x: each kernel call on a quantized part begins with it
        scratch = np.empty(max(kernels.scratch_bytes(*x.shape, q, h) for q, h in quantized), np.uint8)
        quantize = best_seconds(lambda: [kernels.quantize_rows(x, q, scratch, h) for q, h in quantized], 3)
        rates["quantize_ms"] = round(quantize * 1e3, 4)
    if 1 < x.shape[0] <= GEMV_ROWS and isinstance(mats[0], np.ndarray):
        rates["sgemm_ms"] = round(best_seconds(lambda: [x @ w.T for w in mats], 3) * 1e3, 4)
    return rates


def context_scaling(model_name: str, positions: tuple[int, ...] = (100, 500, 1000, 2000), n_decode: int = 32,
                    n_prompt: int = 2048, **engine: Any) -> dict[str, Any]:
    """Decode cost against position: ms per token decoding at each of `positions` (the Cache holding that
    many tokens of a prompt), and prefill tok/s of an `n_prompt`-token prompt.

    One runner per position, each prefilled to its position, decode `n_decode` greedy tokens in lock step
    (every step runs the positions back to back in a rotating order, so a change in machine load hits them
    alike); a position's cost is the median over its steps, in wall time and in process CPU time, with the
    attend stage's share. Ratios are against the first position (the issue's target: position 2,000 costs
    <= 1.5x position 100)."""
    with open_session(model_name, **engine) as session:
        return _context_scaling(session, positions, n_decode, n_prompt)


def _context_scaling(session: Session, positions: tuple[int, ...], n_decode: int, n_prompt: int) -> dict[str, Any]:
    model = session.model
    ids = bench_ids(model.tokenizer, max(n_prompt, *positions))
    top = max(positions)
    runners = {p: session.new_runner((max(top, n_prompt) if p == top else p) + n_decode + 1) for p in positions}
    c0, t0 = time.process_time(), time.perf_counter()
    runners[top].prefill(ids[:n_prompt])
    prefill_s, prefill_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    tokens = {p: int(np.argmax(runners[p].prefill(ids[:p]).values[-1])) for p in positions}
    wall: dict[int, list[float]] = {p: [] for p in positions}
    cpu: dict[int, list[float]] = {p: [] for p in positions}
    attend: dict[int, list[float]] = {p: [] for p in positions}
    spent = [0.0]

    def timed(stage: str, layer: int | None, fn: Any, *args: Any) -> Any:
        if stage != "attend":
            return fn(*args)
        t = time.perf_counter()
        out = fn(*args)
        spent[0] += time.perf_counter() - t
        return out

    hook = types.SimpleNamespace(call=timed)  # a tracer's face: every stage call goes through hook.call
    order = list(positions)
    for i in range(n_decode):
        for p in order[i % len(order):] + order[: i % len(order)]:
            spent[0] = 0.0
            c0, t0 = time.process_time(), time.perf_counter()
            logits = runners[p].step(tokens[p], tracer=hook)
            wall[p].append(time.perf_counter() - t0)
            cpu[p].append(time.process_time() - c0)
            attend[p].append(spent[0])
            tokens[p] = int(np.argmax(logits.values[-1]))
    ms = {p: 1e3 * float(np.median(wall[p])) for p in positions}
    cpu_ms = {p: 1e3 * float(np.median(cpu[p])) for p in positions}
    first = positions[0]
    report: dict[str, Any] = {"model": str(model.path.name), "kv_cache": session.cfg.kv_cache,
                              "positions": list(positions), "decode_tokens": n_decode,
                              "prefill_tokens": n_prompt, "prefill_tok_s": round(n_prompt / prefill_s, 1),
                              "prefill_cpu_seconds": round(prefill_cpu_s, 2)}
    for p in positions:
        report[f"decode_ms_at_{p}"] = round(ms[p], 2)
        report[f"attend_ms_at_{p}"] = round(1e3 * float(np.median(attend[p])), 2)
        report[f"cpu_ms_at_{p}"] = round(cpu_ms[p], 2)
    for p in positions[1:]:
        report[f"ratio_{p}_vs_{first}"] = round(ms[p] / ms[first], 3)
        report[f"cpu_ratio_{p}_vs_{first}"] = round(cpu_ms[p] / cpu_ms[first], 3)
    report["kv_cache_mb_at_max"] = round(runners[top].cache.nbytes / 2**20, 1)
    return report
