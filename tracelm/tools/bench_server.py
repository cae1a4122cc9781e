"""`tracelm bench server`: aggregate decode rate of N concurrent streams through the server's engine.

For each N, a fresh `Engine` gets N requests at once (greedy, the same prompt length, each its own prompt: the
bench text shifted by one token per stream), so they start together and decode in one batch. The decode rate
is all generated tokens over the wall time of the engine's decode steps (sampling every active sequence and
their shared forward pass; the prompts' prefills, one at a time before the batch decodes, are not counted).
Ratios are against one stream, measured in the same run; the order of N alternates between repeats and the
best rate of each N counts. `cpu_tok_s` divides by the worker thread's CPU time instead: with one BLAS
thread (`--threads 1`) that is what the wall time would be on an idle machine, so it says more than the wall
rate on a busy one (with more BLAS threads it leaves out their helpers' share). `products_ms_per_pass`: the
weight products of one pass over N rows alone, the head over all N (`product_pass_seconds`), the floor of
`ms_per_pass`; `ceiling_vs_1_stream`: the ratio N streams would reach if nothing but those products cost time (N x
one stream's `ms_per_pass` / `products_ms_per_pass`), what the weight products allow whatever the rest costs.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping
from typing import Any

import attrs

from tracelm.server.queue import Engine, Job
from tracelm.session import Session
from tracelm.state.records import SamplingParams
from tracelm.state.run_config import ServerOptions
from tracelm.tools.bench import bench_ids, open_session, product_pass_seconds


def to_the_end(eog_ids: frozenset[int], temperature: float = 0.0, filters: Mapping[str, float] | None = None
               ) -> SamplingParams:
    """Greedy, or at `temperature` > 0 the sampler's defaults (top-k 40, top-p 0.95, min-p 0.05, seed 0) with
    `filters` ({"top_k": 0, ...}) in their place, no repetition penalty, the end-of-generation tokens biased away, so
    that a bench's streams decode every token asked."""
    return SamplingParams(temperature=float(temperature), repeat_penalty=1.0, **(filters or {}),
                          logit_bias={int(t): -100.0 for t in sorted(eog_ids)})


def run_streams(engine: Engine, prompts: list[list[int]], n_decode: int, sampling: SamplingParams
                ) -> dict[str, float]:
    """Run one request per prompt through a not yet started engine; their summed counts and the wall time."""

    async def main() -> tuple[list[dict[str, Any]], float]:
        loop = asyncio.get_running_loop()
        jobs = [Job(request_id=f"bench-{i}", prompt_ids=ids, prompt_text="", max_tokens=n_decode, sampling=sampling,
                    stop=(), deadline=time.monotonic() + 3600, loop=loop) for i, ids in enumerate(prompts)]
        for job in jobs:
            engine.submit(job)
        t0 = time.perf_counter()
        engine.start()

        async def done(job: Job) -> dict[str, Any]:
            while True:
                event = await job.events.get()
                if event[0] == "done":
                    return event[1]
                if event[0] == "error":
                    raise event[1]

        results = await asyncio.gather(*(done(j) for j in jobs))
        return results, time.perf_counter() - t0

    try:
        results, wall = asyncio.run(main())
    finally:
        engine.stop()
    c = engine.counters
    return {"generated": sum(r["completion_tokens"] for r in results), "shortest": min(r["completion_tokens"]
            for r in results), "prefill_seconds": sum(r["prefill_seconds"] for r in results), "wall_seconds": wall,
            "step_seconds": c.step_seconds, "step_cpu_seconds": c.step_cpu_seconds, "passes": c.passes,
            "peak_batch": c.peak_batch}


def bench_server(model_name: str, streams: tuple[int, ...] = (1, 2, 4, 8), n_prompt: int = 64, n_decode: int = 128,
                 repeats: int = 2, temperature: float = 0.0, filters: Mapping[str, float] | None = None,
                 **engine: Any) -> dict[str, Any]:
    with open_session(model_name, **engine) as session:
        return _bench_server(session, streams, n_prompt, n_decode, repeats, temperature, filters)


def _bench_server(session: Session, streams: tuple[int, ...], n_prompt: int, n_decode: int, repeats: int,
                  temperature: float = 0.0, filters: Mapping[str, float] | None = None) -> dict[str, Any]:
    model = session.model
    most = max(streams)
    text = bench_ids(model.tokenizer, n_prompt + most)
    # every stream decodes all n_decode tokens: an end-of-generation token would shrink the batch part-way
    sampling = to_the_end(model.tokenizer.eog_ids, temperature, filters)
    cfg = attrs.evolve(session.cfg, context=n_prompt + n_decode + 1, sampling=sampling,
                       server=ServerOptions(queue_size=most, max_batch=min(most, 8)))
    best: dict[int, dict[str, float]] = {}
    best_cpu: dict[int, float] = {}
    load_before = os.getloadavg()
    for r in range(repeats):
        for n in streams if r % 2 == 0 else streams[::-1]:
            engine = Engine(Session(model, cfg))
            got = run_streams(engine, [text[k : k + n_prompt] for k in range(n)], n_decode, sampling)
            got |= {"tok_s": got["generated"] / got["step_seconds"], "cpu_tok_s": got["generated"] /
                    got["step_cpu_seconds"], "ms_per_pass": 1e3 * got["step_seconds"] / max(got["passes"], 1)}
            if n not in best or got["tok_s"] > best[n]["tok_s"]:
                best[n] = got
            best_cpu[n] = max(best_cpu.get(n, 0.0), got["cpu_tok_s"])
    report: dict[str, Any] = {"model": str(model.path.name), "prompt_tokens": n_prompt, "decode_tokens": n_decode,
                              "temperature": sampling.temperature, **({"filters": dict(filters)} if filters else {}),
                              "repeats": repeats,
                              "loadavg_before": [round(x, 2) for x in load_before],
                              "loadavg_after": [round(x, 2) for x in os.getloadavg()]}
    first = streams[0]
    one, cpu_one, one_ms = best[first]["tok_s"], best_cpu[first], best[first]["ms_per_pass"]
    for n in streams:
        b, cpu = best[n], best_cpu[n]
        products = 1e3 * product_pass_seconds(model.weights, model.cfg, n, 5, head_rows=n)
        report[f"streams_{n}"] = {"aggregate_tok_s": round(b["tok_s"], 2), f"vs_{first}_stream":
                                  round(b["tok_s"] / one, 3), "cpu_tok_s": round(cpu, 2),
                                  f"cpu_vs_{first}_stream": round(cpu / cpu_one, 3),
                                  "ms_per_pass": round(b["ms_per_pass"], 3), "products_ms_per_pass": round(products, 4),
                                  f"ceiling_vs_{first}_stream": round(n / first * one_ms / products, 3),
                                  "peak_batch": b["peak_batch"], "generated": int(b["generated"]),
                                  "shortest_stream": int(b["shortest"])}
    return report
