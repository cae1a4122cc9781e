"""`tracelm bench batch`: N short prompts as one `tracelm batch` against N separate `tracelm run` calls, and the
Ray engine against the local one.

Every figure is a whole command's wall time, as a user meets it: a new process each (interpreter, imports,
model load), the local batch loading the model once and decoding up to 8 sequences per pass, each `tracelm
run` loading it again for its one prompt, the Ray batch starting a local Ray cluster and `--actors` actors
(one model load each). All greedy, the same prompts and max tokens, so the texts must agree across the three
(`texts_equal`). Rates are items and generated tokens over those wall times; `speedup` is the local batch's
items/s over the separate runs' (issue 17's target: >= 5x); `ray_overhead` the Ray batch's wall time over the
local batch's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tracelm.state.errors import TracelmError

TOPICS = ("the sea", "a city at night", "bread", "the first snow", "an old map", "bees", "a train station",
          "the moon")
_GENERATED = re.compile(r"(\d+) generated")
PROMPT_ROOM = 64  # context positions for a prompt (each is under 32 tokens); the rest is for decode_tokens


def bench_prompts(n: int) -> list[str]:
    """n short prompts, each different."""
    return [f"Write one sentence about {TOPICS[i % len(TOPICS)]} (note {i + 1})." for i in range(n)]


def _tracelm(args: list[str]) -> tuple[subprocess.CompletedProcess[str], float]:
    """A `tracelm` command in a new process, and its wall time; a TracelmError with its last words if it fails."""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "tracelm.cli", *args], capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise TracelmError(f"bench batch: `tracelm {args[0]}` exited with {done.returncode}: {last}")
    return done, seconds


def _rates(n_items: int, tokens: int, seconds: float) -> dict[str, float]:
    return {"wall_seconds": round(seconds, 2), "items_s": round(n_items / seconds, 3),
            "tok_s": round(tokens / seconds, 2), "generated": tokens}


def _batch(model: str, inp: Path, out: Path, common: list[str], extra: list[str]) -> tuple[dict[str, str], float]:
    """One `tracelm batch` over the input: its texts by id and its wall time."""
    _, seconds = _tracelm(["batch", "--model", model, "--input", str(inp), "--output", str(out), *common, *extra])
    lines = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    return {r["id"]: r for r in lines}, seconds


def _separate_runs(model: str, prompts: list[str], common: list[str]) -> tuple[list[str], int, float]:
    """One `tracelm run` per prompt: their texts, generated tokens and total wall time."""
    texts, tokens, total = [], 0, 0.0
    for p in prompts:
        done, seconds = _tracelm(["run", "--model", model, "--prompt", p, *common])
        texts.append(done.stdout.removesuffix("\n"))
        found = _GENERATED.search(done.stderr)
        tokens += int(found.group(1)) if found else 0
        total += seconds
    return texts, tokens, total


def has_ray() -> bool:
    try:
        import ray.data  # noqa: F401
    except ImportError:
        return False
    return True


def bench_batch(model: str, n_items: int = 64, n_decode: int = 128, actors: int = 2, threads: int = 0,
                compute: str = "kernels", activations: str = "int16") -> dict[str, Any]:
    if n_items < 1 or actors < 1:
        raise TracelmError("bench batch: --items and --actors must be positive")
    prompts = bench_prompts(n_items)
    common = ["--max-tokens", str(n_decode), "--temperature", "0", "--context", str(PROMPT_ROOM + n_decode),
              "--set", f"compute={compute}",
              "--set", f"activations={activations}", "--set", f"threads={threads}"]
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="tracelm-bench-batch-") as tmp:
        inp = Path(tmp) / "prompts.jsonl"
        inp.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(prompts)),
                       encoding="utf-8")
        local, local_s = _batch(model, inp, Path(tmp) / "local.jsonl", common, [])
        texts, run_tokens, runs_s = _separate_runs(model, prompts, common)
        ray = None
        if has_ray():
            ray = _batch(model, inp, Path(tmp) / "ray.jsonl", common, ["--engine", "ray", "--actors", str(actors)])
    local_tokens = sum(r["completion_tokens"] for r in local.values())
    report: dict[str, Any] = {
        "model": model, "items": n_items, "decode_tokens": n_decode, "compute": compute, "threads": threads,
        "loadavg_before": [round(x, 2) for x in load_before],
        "local_batch": _rates(n_items, local_tokens, local_s),
        "separate_runs": _rates(n_items, run_tokens, runs_s),
        "speedup": round(runs_s / local_s, 2),
        "texts_equal": f"{sum(local[i]['text'] == t for i, t in enumerate(texts))}/{n_items} (batch vs runs)",
    }
    if ray is None:
        report["ray"] = "not installed (pip install 'tracelm[ray]')"
    else:
        results, ray_s = ray
        report["ray_batch"] = {"actors": actors, **_rates(n_items, sum(r["completion_tokens"] for r in
                                                                       results.values()), ray_s)}
        report["ray_overhead"] = round(ray_s / local_s, 2)
        same = sum(results.get(i, {}).get("text") == r["text"] for i, r in local.items())
        report["ray_texts_equal"] = f"{same}/{n_items}"
    report["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    return report
