"""`tracelm bench profile`: where a decode step's time goes, kind of work by kind of work, and a prompt's prefill.

For each stream count N, N prompts are prefilled, then decoded together as the server decodes them (each stream
samples its token, then one shared pass computes all of them: `feed_together`). The kernel calls of the pass are
timed by kind: the weight products (`linear_into`: q/k/v, out, gate/up, down), the head, attention
(`kernels.attend_parts`, `attend_layer`), the norms (`kernels.rms_norm`, `rms_norm_add`), RoPE, the FFN's
activation; `sampling` is the streams' `Generation.step`; `rest` is the step's wall time outside all of those -- the
Python between the calls, the embedding lookup, the residual adds, the Cache's bookkeeping. What does not shrink as
threads are added is what stops decode from scaling (issue 32): `--thread-counts 1,8,16` profiles each thread count
in turn in one process and reports each kind's speed-up over the first count (`scaling`). `pool` is the kernels'
thread pool over the timed steps (kernels.pool_counts): its jobs a step, their wall ms a step, the share of the
threads' time in them spent inside tasks (`busy_share`), and the rest as ms a step (`waiting_ms_per_step`: waking the
workers, taking tasks, waiting for the slowest) -- what a finer or coarser split, or fewer jobs, could win back;
each kind whose calls ran jobs on the pool has its own `pool` too (where the waiting is: the products' tails, or
the wake-ups of many small jobs).

`prefill` is one stream's prompt of the same length prefilled from an empty Cache, timed by the same kinds (a
prefill samples nothing), its pool per prefill, and the path's integer dot at its peak on those threads
(`int8_dot_peak_g_s`); `scaling` has each thread count's prefill speed-up, each kind's, and the peak's own, which
grows with the threads only as far as they have cores of their own (a prefill's products are bound by it).
`cpu_steal_share`: the share of the machine's CPU time its host stole while a thread count was profiled (a virtual
machine's; well above 0, that count's figures are the host's).

The timers wrap the module functions the pass calls, for the timed steps only, and are removed after; each call
then costs about a microsecond more, so `ms_per_step` is given beside `ms_per_step_untimed`, the same steps without
timers (run first). End-of-generation tokens are biased by -100 so that every stream decodes every step.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import tracelm.kernels as kernels
import tracelm.pipeline.graph as graph
from tracelm.pipeline.runner import Generation, feed_together
from tracelm.session import Session
from tracelm.tools.bench import bench_ids, best_seconds, cpu_times, kernels_in_use, open_session, steal_share
from tracelm.tools.bench_server import to_the_end

# kind -> the (module-like object, attribute) pairs the fused pass calls for it
KINDS: dict[str, tuple[tuple[Any, str], ...]] = {
    "products": ((graph, "linear_into"),),
    "head": ((graph, "head"),),
    "attention": ((kernels, "attend_parts"), (kernels, "attend_layer")),
    "norms": ((kernels, "rms_norm"), (kernels, "rms_norm_add")),
    "rope": ((kernels, "rope"),),
    "activation": ((graph.compiled.ACTIVATIONS, "silu"), (graph.compiled.ACTIVATIONS, "gelu_tanh")),
    "sampling": ((Generation, "step"),),
}


def _timed(fn: Callable[..., Any], spent: dict[str, float], kind: str,
           pooled: dict[str, list[float]] | None) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        before = kernels.pool_counts() if pooled is not None else None
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[kind] += time.perf_counter() - t0
            if before is not None:
                into = pooled.setdefault(kind, [0, 0.0, 0.0])
                for i, (a, b) in enumerate(zip(before, kernels.pool_counts(), strict=True)):
                    into[i] += b - a

    return call


@contextlib.contextmanager
def timers(spent: dict[str, float], pooled: dict[str, list[float]] | None = None) -> Iterator[None]:
    """Every function of KINDS wrapped to add its calls' seconds to spent[kind] (and, with `pooled`, what the pool
    counted during them to pooled[kind], as kernels.pool_counts: jobs, offered s, busy s); put back on exit."""
    saved = []
    try:
        for kind, places in KINDS.items():
            spent.setdefault(kind, 0.0)
            for owner, name in places:
                is_map = isinstance(owner, dict)
                fn = owner[name] if is_map else getattr(owner, name)
                saved.append((owner, name, fn))
                if is_map:
                    owner[name] = _timed(fn, spent, kind, pooled)
                else:
                    setattr(owner, name, _timed(fn, spent, kind, pooled))
        yield
    finally:
        for owner, name, fn in reversed(saved):
            if isinstance(owner, dict):
                owner[name] = fn
            else:
                setattr(owner, name, fn)


@contextlib.contextmanager
def pool_counted(counts: list[Any]) -> Iterator[None]:
    """The kernels' pool counted while inside; counts gets kernels.pool_counts() (jobs, offered s, busy s)."""
    kernels.pool_counting(True)
    try:
        yield
    finally:
        kernels.pool_counting(False)
        counts[:] = kernels.pool_counts()


def pool_report(counts: Sequence[float], steps: int, threads: int, per: str = "step") -> dict[str, float]:
    """Per step (or per `per`): the pool's jobs and their wall ms; the share of the threads' time in them spent
    inside tasks; and that wall less the tasks' time spread evenly over the threads (waking, taking tasks, the
    slowest one's tail)."""
    jobs, offered, busy = counts
    if not jobs or offered <= 0:
        return {f"jobs_per_{per}": 0.0}
    return {f"jobs_per_{per}": round(jobs / steps, 1), f"ms_per_{per}": round(1e3 * offered / threads / steps, 3),
            "busy_share": round(busy / offered, 3),
            f"waiting_ms_per_{per}": round(1e3 * (offered - busy) / threads / steps, 3)}


def kinds_report(spent: Mapping[str, float], pooled: Mapping[str, list[float]], wall: float, steps: int,
                 per: str = "step") -> dict[str, Any]:
    """Each kind's ms per step (or per `per`) and share of the wall time, `rest` the wall outside them all; with
    its own `pool` where its calls ran jobs on the pool."""
    threads = kernels.threads()
    return {k: {f"ms_per_{per}": round(1e3 * s / steps, 3), "share": round(s / wall, 3),
                **({"pool": pool_report(pooled[k], steps, threads, per)} if pooled.get(k, [0])[0] else {})}
            for k, s in (*spent.items(), ("rest", wall - sum(spent.values())))}


def _decode(gens: list[Generation], n: int) -> float:
    """n steps of every stream as the server runs them; their wall seconds."""
    t0 = time.perf_counter()
    for _ in range(n):
        for g in gens:
            g.step()
        feed_together(gens)
    return time.perf_counter() - t0


def _streams(session: Session, n: int, n_prompt: int, n_decode: int, temperature: float = 0.0,
             filters: Mapping[str, float] | None = None) -> list[Generation]:
    """n streams prefilled on prompts shifted by a token each, ready to decode n_decode steps and more (greedy, or
    sampled at `temperature` with the sampler's defaults, `filters` in their place)."""
    tok = session.model.tokenizer
    ids = bench_ids(tok, n_prompt + n)
    sampling = to_the_end(tok.eog_ids, temperature, filters)
    runners = [session.new_runner(n_prompt + n_decode + 8) for _ in range(n)]
    return [r.start(ids[k : k + n_prompt], n_decode + 4, sampling) for k, r in enumerate(runners)]


def bench_profile(model_name: str, streams: tuple[int, ...] = (1,), n_prompt: int = 64, n_decode: int = 32,
                  thread_counts: tuple[int, ...] = (), temperature: float = 0.0,
                  filters: Mapping[str, float] | None = None, **engine: Any) -> dict[str, Any]:
    """The profile of each stream count and of the prompt's prefill; with `thread_counts`, the profile at each thread
    count in turn (`threads_T`) and `scaling`: per stream count and for the prefill, each kind's ms at the first count
    over its ms at each. The
    streams decode greedily, or sample at `temperature` with the sampler's defaults, `filters` ({"top_k": 0, ...})
    in their place."""
    with open_session(model_name, **engine) as session:
        in_use = kernels_in_use()
        report: dict[str, Any] = {"model": session.model.path.name,
                                  "threads": list(thread_counts) if thread_counts else kernels.threads(),
                                  "kernels": in_use["kernels_path"], "selftest": in_use["selftest"],
                                  "prompt_tokens": n_prompt, "steps": n_decode, "temperature": float(temperature),
                                  **({"filters": dict(filters)} if filters else {})}
        if not thread_counts:
            return report | _profile(session, streams, n_prompt, n_decode, temperature, filters)
        before = kernels.threads()
        try:
            for t in thread_counts:
                kernels.set_threads(t)
                report[f"threads_{t}"] = _profile(session, streams, n_prompt, n_decode, temperature, filters)
        finally:
            kernels.set_threads(before)
        report["scaling"] = scaling(report, thread_counts, streams)
        return report


def _profile(session: Session, streams: tuple[int, ...], n_prompt: int, n_decode: int, temperature: float,
             filters: Mapping[str, float] | None) -> dict[str, Any]:
    """`streams_N` for each stream count N: the untimed and timed ms per step, and each kind's ms and share; then
    `prefill`, the prompt's; and the share of the machine's CPU time its host stole meanwhile (`cpu_steal_share`)."""
    report: dict[str, Any] = {}
    cpu_before = cpu_times()
    for n in streams:
        untimed = _decode(_streams(session, n, n_prompt, n_decode + 1, temperature, filters), n_decode + 1)
        gens = _streams(session, n, n_prompt, n_decode + 1, temperature, filters)
        _decode(gens, 1)  # a warm step
        spent: dict[str, float] = {}
        counts: list[Any] = []
        pooled: dict[str, list[float]] = {}
        with timers(spent, pooled), pool_counted(counts):
            wall = _decode(gens, n_decode)
        report[f"streams_{n}"] = {"ms_per_step_untimed": round(1e3 * untimed / (n_decode + 1), 3),
                                  "ms_per_step": round(1e3 * wall / n_decode, 3),
                                  "kinds": kinds_report(spent, pooled, wall, n_decode),
                                  "pool": pool_report(counts, n_decode, kernels.threads())}
    report["prefill"] = _prefill(session, n_prompt)
    report["cpu_steal_share"] = steal_share(cpu_before, cpu_times())
    return report


def _prefill(session: Session, n_prompt: int) -> dict[str, Any]:
    """The prompt's prefill by kind (one stream, `runner.prefill` into an empty Cache): the untimed ms (the better
    of two after a warm one), one timed prefill's kinds and pool, and the path's integer dot at its peak on these
    threads (`kernels.dot_peak`, G int8 products/s): as threads are added, a peak that grows less than they do says
    they share cores."""
    runner = session.new_runner(n_prompt + 1)
    ids = bench_ids(session.model.tokenizer, n_prompt)

    def prefill() -> None:
        runner.cache.reset()
        runner.prefill(ids)

    untimed = best_seconds(prefill, 2)
    spent: dict[str, float] = {}
    counts: list[Any] = []
    pooled: dict[str, list[float]] = {}
    with timers(spent, pooled), pool_counted(counts):
        t0 = time.perf_counter()
        prefill()
        wall = time.perf_counter() - t0
    spent.pop("sampling")  # a prefill samples nothing
    peak = kernels.dot_peak()
    return {"tokens": n_prompt, "ms_untimed": round(1e3 * untimed, 3), "tok_s_untimed": round(n_prompt / untimed, 1),
            "ms": round(1e3 * wall, 3), "kinds": kinds_report(spent, pooled, wall, 1, "prefill"),
            "pool": pool_report(counts, 1, kernels.threads(), "prefill"),
            "int8_dot_peak_g_s": peak["int8_products_g_s"] if peak else None}


def scaling(report: dict[str, Any], thread_counts: tuple[int, ...], streams: tuple[int, ...]) -> dict[str, Any]:
    """Per stream count and thread count: the untimed step's speed-up over the first thread count, and each kind's
    (its ms there over its ms here): a kind near 1.0 is one that does not shrink as threads are added. `prefill`:
    the untimed prefill's speed-up, each kind's, and the integer peak's (its rate here over its rate there)."""
    first = report[f"threads_{thread_counts[0]}"]
    out: dict[str, Any] = {}
    for n in streams:
        base = first[f"streams_{n}"]
        per: dict[str, Any] = {}
        for t in thread_counts[1:]:
            here = report[f"threads_{t}"][f"streams_{n}"]
            per[f"threads_{t}"] = {"step": _ratio(base["ms_per_step_untimed"], here["ms_per_step_untimed"]),
                                   **{k: _ratio(base["kinds"][k]["ms_per_step"], v["ms_per_step"])
                                      for k, v in here["kinds"].items()}}
        out[f"streams_{n}"] = per
    base = first["prefill"]
    out["prefill"] = {}
    for t in thread_counts[1:]:
        here = report[f"threads_{t}"]["prefill"]
        peaks = (here["int8_dot_peak_g_s"], base["int8_dot_peak_g_s"])
        out["prefill"][f"threads_{t}"] = {
            "prefill": _ratio(base["ms_untimed"], here["ms_untimed"]),
            **{k: _ratio(base["kinds"][k]["ms_per_prefill"], v["ms_per_prefill"]) for k, v in here["kinds"].items()},
            "int8_dot_peak": _ratio(*peaks) if None not in peaks else None}
    return out


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 2) if a > 0 and b > 0 else None
