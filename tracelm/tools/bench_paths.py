"""`tracelm bench paths`: the kernel paths this CPU runs (amx, avx512vnni, avxvnni, avx2, portable), side by side on one
model in one process, alternated round by round so that the machine's drift falls on every path alike.

After a round that warms every path up, each round, for each path: prefill of a prompt, then decode of a few
tokens, and the weight products of one prefill pass alone. Reported per path: the median with min and max over
the rounds, and each median's ratio to the avx2 path's. The paths must agree bit for bit (their contract,
kernels.h): the prompt's last logits and the decoded tokens are compared, and a difference fails the bench.

With `k_ahead` (`--k-ahead 1,2,4`) each path runs at each of those prefetch distances of the K-quants' decode pairs
in turn (`kernels.set_k_ahead`), a variant each ("avx512vnni k_ahead=2"), the ratios then to the first distance of
the base path: a sweep in one process, the model loaded once and the machine's drift on every variant alike. With
`hints` (`--prefetch-hints t0,nta`) likewise for the weights' software prefetch hint (`kernels.set_prefetch_hint`:
into every cache level, or non-temporal), "avx512vnni hint=nta"; with both, every distance at every hint."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from tracelm.state.errors import TracelmError
from tracelm.tools.bench import bench_ids, kernels_in_use, open_session, product_pass_seconds, spread


def variant_name(path: str, ahead: int | None, hint: str | None = None) -> str:
    """A variant's key in the report: the path, and the prefetch distance and hint it ran at when the bench sweeps
    them."""
    return " ".join([path, *([f"k_ahead={ahead}"] if ahead is not None else []), *([f"hint={hint}"] if hint else [])])


def bench_paths(model_name: str, n_prompt: int = 128, n_decode: int = 32, rounds: int = 5,
                paths: tuple[str, ...] | None = None, k_ahead: tuple[int, ...] = (), hints: tuple[str, ...] = (),
                **engine: Any) -> dict[str, Any]:
    import tracelm.kernels as kernels

    names = tuple(paths) if paths else tuple(p for p in kernels.paths() if p != "portable") or ("portable",)
    unknown = [p for p in names if p not in kernels.paths()]
    if unknown:
        raise TracelmError(f"bench paths: {', '.join(unknown)} cannot run here (self-tested paths: "
                           f"{', '.join(kernels.paths())})")
    far = [a for a in k_ahead if not 0 <= a <= kernels.MAX_K_AHEAD]
    if far:
        raise TracelmError(f"bench paths: prefetch distance {far[0]} is not 0..{kernels.MAX_K_AHEAD} super-blocks")
    odd = [h for h in hints if h not in kernels.PREFETCH_HINTS]
    if odd:
        raise TracelmError(f"bench paths: prefetch hint {odd[0]!r} is not one of {', '.join(kernels.PREFETCH_HINTS)}")
    before, ahead_before, hint_before = kernels.path(), kernels.k_ahead(), kernels.prefetch_hint()
    variants = [(p, a, h) for p in names for a in (k_ahead or (None,)) for h in (hints or (None,))]
    labels = [variant_name(*v) for v in variants]
    rates: dict[str, dict[str, list[float]]] = {v: {"prefill": [], "decode": [], "products": []} for v in labels}
    outputs: dict[str, tuple[bytes, list[int]]] = {}
    try:
        with open_session(model_name, **engine) as session:
            model = session.model
            runner = session.new_runner(n_prompt + n_decode + 1)
            ids = bench_ids(model.tokenizer, n_prompt)
            for r in range(rounds + 1):   # round 0 warms every path up and is not counted
                for (p, a, h), v in zip(variants, labels, strict=True):
                    kernels.use_path(p)
                    kernels.set_k_ahead(ahead_before if a is None else a)
                    kernels.set_prefetch_hint(h or hint_before)
                    runner.cache.reset()
                    t0 = time.perf_counter()
                    logits = runner.prefill(ids).values[-1]
                    t1 = time.perf_counter()
                    tokens = [int(np.argmax(logits))]
                    for _ in range(n_decode):
                        tokens.append(int(np.argmax(runner.step(tokens[-1]).values[-1])))
                    t2 = time.perf_counter()
                    seen = (np.ascontiguousarray(logits, np.float32).tobytes(), tokens)
                    if outputs.setdefault(v, seen) != seen or outputs[labels[0]] != seen:
                        raise TracelmError(f"bench paths: the {v} path's logits or tokens differ from the "
                                           f"{labels[0]} path's: the kernels' contract is broken on this CPU")
                    if r == 0:
                        continue
                    rates[v]["prefill"].append(n_prompt / (t1 - t0))
                    rates[v]["decode"].append(n_decode / (t2 - t1))
                    rates[v]["products"].append(n_prompt / product_pass_seconds(model.weights, model.cfg, n_prompt, 1))
    finally:
        kernels.use_path(before)
        kernels.set_k_ahead(ahead_before)
        kernels.set_prefetch_hint(hint_before)
    report: dict[str, Any] = {"model": model_name, "threads": kernels.threads(), "rounds": rounds,
                              "prompt_tokens": n_prompt, "decode_tokens": n_decode,
                              "selftest": kernels_in_use()["selftest"], "k_ahead": ahead_before,
                              "prefetch_hint": hint_before,
                              "same_bits": True}
    base = variant_name("avx2" if "avx2" in names else names[0], k_ahead[0] if k_ahead else None,
                        hints[0] if hints else None)
    for v in labels:
        entry: dict[str, Any] = {}
        for what, values in rates[v].items():
            entry[f"{what}_tok_s"] = spread(values)
            if v != base:
                ratios = [a / b for a, b in zip(values, rates[base][what], strict=True)]
                entry[f"{what}_vs_{base}"] = spread(ratios)
        report[v] = entry
    return report
