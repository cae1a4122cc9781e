"""Batched decoding: several sequences in one forward pass, each with its own Cache, sampler and limits.

A sequence's logits in a batch must equal, bitwise, its logits run alone (graph); the server's engine must
return for each of several concurrent requests exactly what it returns for the request alone, let requests
join and leave, cancel one without disturbing the others, and still refuse work past its queue (429)."""

from __future__ import annotations

import asyncio
import gc
import io
import json
import threading
import time
import weakref
from pathlib import Path

import attrs
import numpy as np
import pytest

import tracelm.server.queue as engine_queue
from tracelm import TracelmError
from tracelm.io.loader import load_model
from tracelm.pipeline.graph import Part, forward, forward_batch, new_cache
from tracelm.pipeline.runner import Runner
from tracelm.pipeline.trace import Tracer, is_timing_field
from tracelm.server.queue import Engine, Job, QueueFull
from tracelm.session import Session
from tracelm.state.records import SamplingParams
from tracelm.state.run_config import RunConfig, ServerOptions

GREEDY = SamplingParams(temperature=0.0, repeat_penalty=1.0)
SAMPLED = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7)


@pytest.fixture(scope="module", params=["kernels", "reference"])
def tiny(tiny_gguf, request):
    """The tiny model on the kernels and on numpy's BLAS (whose row-invariance rests on the same calls)."""
    return load_model(str(tiny_gguf), progress=False, compute=request.param)


def lockstep(cfg, weights, prompts: list[list[int]], steps: int, n_ctx: int = 64):
    """Prefill each prompt alone, then decode all greedily `steps` times, once batched and once one by one:
    (batched logits, lone logits), each a list per step of a list per sequence."""
    batched, alone = [new_cache(cfg, n_ctx) for _ in prompts], [new_cache(cfg, n_ctx) for _ in prompts]
    last = []
    for b, a, ids in zip(batched, alone, prompts, strict=True):
        lb, la = forward(cfg, weights, b, ids), forward(cfg, weights, a, ids)
        np.testing.assert_array_equal(lb.values, la.values)
        last.append(int(np.argmax(lb.values[-1])))
    out_b, out_a = [], []
    for _ in range(steps):
        got = forward_batch(cfg, weights, [Part(c, [t]) for c, t in zip(batched, last, strict=True)])
        ref = [forward(cfg, weights, c, [t]) for c, t in zip(alone, last, strict=True)]
        out_b.append([g.values for g in got])
        out_a.append([r.values for r in ref])
        last = [int(np.argmax(g.values[-1])) for g in got]
    assert [c.tokens for c in batched] == [c.tokens for c in alone]
    return out_b, out_a


def assert_bitwise(out_b, out_a) -> None:
    for step_b, step_a in zip(out_b, out_a, strict=True):
        for b, a in zip(step_b, step_a, strict=True):
            assert b.shape == a.shape and b.tobytes() == a.tobytes()


@pytest.mark.parametrize("variant", ["plain", "windowed"])
def test_batched_logits_equal_lone_logits_bitwise(tiny, variant) -> None:
    cfg = tiny.cfg
    if variant == "windowed":  # windowed layers with their own RoPE base (gemma3's pattern) on the tiny weights
        cfg = attrs.evolve(cfg, sliding_window=4, swa_pattern=2, rope_base_swa=100.0)
    prompts = [[104, 101, 108, 108, 111], [119, 111], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [200], [33, 34, 35],
               [104, 104], [50, 60, 70, 80], [5]]  # 8 sequences, each at its own position
    assert_bitwise(*lockstep(cfg, tiny.weights, prompts, steps=6))


def test_batched_prefill_and_decode_mixed(tiny) -> None:
    """A pass mixing a 3-token chunk of one sequence with single tokens of others (all logits) equals the
    lone passes row for row."""
    cfg, w = tiny.cfg, tiny.weights
    caches = [new_cache(cfg, 32) for _ in range(3)]
    lone = [new_cache(cfg, 32) for _ in range(3)]
    for c, a, ids in zip(caches, lone, ([104, 101], [7, 8, 9, 10], [66]), strict=True):
        forward(cfg, w, c, ids)
        forward(cfg, w, a, ids)
    feeds = [[1, 2, 3], [4], [5]]
    got = forward_batch(cfg, w, [Part(c, f) for c, f in zip(caches, feeds, strict=True)], all_logits=True)
    for g, a, f in zip(got, lone, feeds, strict=True):
        ref = forward(cfg, w, a, f, all_logits=True)
        assert g.start == ref.start and g.values.tobytes() == ref.values.tobytes()
    assert [c.tokens for c in caches] == [c.tokens for c in lone]


@pytest.mark.model
@pytest.mark.parametrize("loaded", ["smollm2", "smollm2_reference"])
def test_batched_logits_equal_lone_logits_bitwise_smollm2(loaded, request) -> None:
    smollm2 = request.getfixturevalue(loaded)
    tok = smollm2.tokenizer
    prompts = [tok.encode(p) for p in ("The capital of France is", "def add(a, b):", "Once upon a time",
                                       "1, 2, 3,")]
    assert_bitwise(*lockstep(smollm2.cfg, smollm2.weights, prompts, steps=3))


def _events(text: str) -> list[dict]:
    """Trace lines without the timing fields and the chain that covers them."""
    keep = []
    for line in text.splitlines():
        e = json.loads(line)
        keep.append({k: v for k, v in e.items() if not is_timing_field(k) and k not in ("hash", "prev", "mac")})
    return keep


def test_a_traced_sequence_in_a_batch_logs_what_it_logs_alone(tiny) -> None:
    """Its hook gets its own rows of every stacked stage: the same events, shapes, statistics and digests."""
    cfg, w = tiny.cfg, tiny.weights
    alone_out, batch_out = io.StringIO(), io.StringIO()
    alone, traced = new_cache(cfg, 32), new_cache(cfg, 32)
    others = [new_cache(cfg, 32) for _ in range(3)]
    for c in (alone, traced):
        forward(cfg, w, c, [104, 101, 108])
    for i, c in enumerate(others):
        forward(cfg, w, c, [40 + i] * (i + 1))
    ta, tb = Tracer(alone_out, "digest"), Tracer(batch_out, "digest")
    for token in (111, 32, 119):
        forward(cfg, w, alone, [token], call=ta.call)
        parts = [Part(others[0], [1]), Part(traced, [token], tb.call), *(Part(c, [2]) for c in others[1:])]
        forward_batch(cfg, w, parts)
    ta.flush()
    tb.flush()
    a, b = _events(alone_out.getvalue()), _events(batch_out.getvalue())
    assert len(a) == len(b) == 3 * (3 + 7 * cfg.n_layer) and a == b  # embed, 7 per layer, norm, head
    assert {e["stage"] for e in b} >= {"embed", "qkv", "rope", "attend", "ffn", "head"}


# --- the engine: requests decoded together ------------------------------------------------------------------


def engine_config(model_path: Path, **server) -> RunConfig:
    return RunConfig(model=str(model_path), context=128, sampling=GREEDY,
                     server=ServerOptions(**{"queue_size": 8, "max_batch": 8, **server}))


def run_jobs(engine: Engine, specs: list[dict]) -> list[dict]:
    """Submit every job before the worker starts (so they start together), run them, and collect for each
    its text, pieces, logprob entries and done (or error) event."""

    async def main() -> list[dict]:
        loop = asyncio.get_running_loop()
        jobs = [Job(request_id=f"r{i}", prompt_ids=s["ids"], prompt_text="", max_tokens=s.get("max_tokens", 24),
                    sampling=s.get("sampling", GREEDY), stop=tuple(s.get("stop", ())), deadline=time.monotonic() + 60,
                    loop=loop, session_id=s.get("session"), logprobs=s.get("logprobs"), gone=s.get("gone") or
                    threading.Event()) for i, s in enumerate(specs)]
        for job in jobs:
            engine.submit(job)
        engine.start()

        async def collect(job: Job) -> dict:
            out: dict = {"pieces": [], "entries": []}
            while True:
                event = await job.events.get()
                if event[0] == "piece":
                    out["pieces"].append(event[1])
                    out["entries"].extend(event[2])
                elif event[0] in ("done", "error"):
                    out[event[0]] = event[1]
                    out["text"] = "".join(out["pieces"])
                    return out

        return await asyncio.gather(*(collect(j) for j in jobs))

    try:
        return asyncio.run(main())
    finally:
        engine.stop()


def lone_text(model, spec: dict) -> tuple[str, list[int]]:
    runner = Runner(model, 128)
    text = "".join(runner.generate(spec["ids"], spec.get("max_tokens", 24), spec.get("sampling", GREEDY),
                                   spec.get("stop", ())))
    return text, runner.stats.tokens


SPECS = [
    {"ids": [104, 101, 108, 108, 111]},
    {"ids": [119, 111, 114], "sampling": SAMPLED, "max_tokens": 30},
    {"ids": [1, 2, 3, 4, 5, 6], "max_tokens": 9, "logprobs": 2},
    {"ids": [104, 101], "sampling": attrs.evolve(SAMPLED, seed=99, temperature=0.7)},
]


def test_concurrent_requests_get_their_lone_text(tiny_gguf, tiny) -> None:
    engine = Engine(Session(tiny, engine_config(tiny_gguf)))
    results = run_jobs(engine, SPECS)
    for spec, got in zip(SPECS, results, strict=True):
        want, tokens = lone_text(tiny, spec)
        assert got["text"] == want and got["done"]["completion_tokens"] == len(tokens)
    assert len(results[2]["entries"]) == results[2]["done"]["completion_tokens"]  # logprobs per token
    c = engine.counters
    assert c.served == 4 and c.failed == 0
    assert c.peak_batch == 4 and c.passes < sum(r["done"]["completion_tokens"] for r in results)  # they shared


def test_a_step_posts_its_events_together_in_order(tiny_gguf, tiny, monkeypatch) -> None:
    """Every piece and end of a step reaches its request through one post_all per step (one wake-up of the event
    loop, not one per token), each request's events still in order: its lone text, then done."""
    batches: list[list] = []
    post_all = engine_queue.post_all
    monkeypatch.setattr(engine_queue, "post_all", lambda events: (batches.append(list(events)), post_all(events)))
    engine = Engine(Session(tiny, engine_config(tiny_gguf)))
    results = run_jobs(engine, SPECS)
    for spec, got in zip(SPECS, results, strict=True):
        assert got["text"] == lone_text(tiny, spec)[0]
    kinds = [event[0] for events in batches for _job, event in events]
    assert kinds.count("done") == len(SPECS) and kinds.count("piece") == sum(len(r["pieces"]) for r in results)
    assert max(len({job.request_id for job, _event in events}) for events in batches) > 1  # several in one post
    assert len(batches) <= engine.counters.passes + len(SPECS)


def test_stop_strings_and_joining_later(tiny_gguf, tiny) -> None:
    """With max_batch 2, two start and the others wait for a place, joining as earlier ones leave; each still
    gets its lone text, stop strings included."""
    text, _ = lone_text(tiny, SPECS[0])
    stop = text[5:8]
    specs = [{**SPECS[0], "stop": [stop]}, *SPECS[1:]]
    engine = Engine(Session(tiny, engine_config(tiny_gguf, max_batch=2)))
    results = run_jobs(engine, specs)
    for spec, got in zip(specs, results, strict=True):
        assert got["text"] == lone_text(tiny, spec)[0]
    assert results[0]["text"] == text[: text.index(stop)] and results[0]["done"]["finish_reason"] == "stop"
    assert engine.counters.peak_batch == 2


class HangsUpAfter(threading.Event):
    """A client that goes away after the engine has asked `n` times whether it is still there."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def is_set(self) -> bool:
        self.n -= 1
        return self.n < 0 or super().is_set()


def test_a_request_cancelled_mid_batch_leaves_the_others_running(tiny_gguf, tiny) -> None:
    specs = [{**s, "max_tokens": 60} for s in SPECS[:3]]
    specs[1]["gone"] = HangsUpAfter(6)  # asked once before it starts, then before every token
    engine = Engine(Session(tiny, engine_config(tiny_gguf)))
    results = run_jobs(engine, specs)
    assert results[1]["done"]["finish_reason"] == "cancelled" and results[1]["done"]["completion_tokens"] == 5
    for i in (0, 2):
        assert results[i]["text"] == lone_text(tiny, specs[i])[0]
        assert results[i]["done"]["finish_reason"] != "cancelled" and results[i]["done"]["completion_tokens"] > 5
    assert engine.counters.cancelled == 1 and engine.counters.served == 3


def test_sessions_in_a_batch_keep_their_own_cache(tiny_gguf, tiny) -> None:
    """Two requests on one session wait for each other (one Cache); the second reuses the first's prefix."""
    a1 = [104, 101, 108, 108, 111, 32]
    specs = [{"ids": a1, "session": "A", "max_tokens": 6}, {"ids": [119, 111], "session": "B"},
             {"ids": a1 + [97, 98], "session": "A", "max_tokens": 6}, {"ids": [5, 6, 7]}]
    engine = Engine(Session(tiny, engine_config(tiny_gguf)))
    results = run_jobs(engine, specs)
    for spec, got in zip(specs, results, strict=True):
        assert got["text"] == lone_text(tiny, spec)[0]
    assert results[2]["done"]["cached_tokens"] >= len(a1)


def test_queue_full_still_refuses(tiny_gguf, tiny) -> None:
    engine = Engine(Session(tiny, engine_config(tiny_gguf, queue_size=2)))
    loop = asyncio.new_event_loop()
    try:
        jobs = [Job(request_id=f"r{i}", prompt_ids=[1, 2], prompt_text="", max_tokens=4, sampling=GREEDY, stop=(),
                    deadline=time.monotonic() + 60, loop=loop) for i in range(4)]
        for job in jobs[:3]:
            engine.submit(job)
        with pytest.raises(QueueFull) as e:
            engine.submit(jobs[3])
        assert e.value.retry_after >= 1 and engine.counters.rejected == 1
    finally:
        loop.close()


def test_max_batch_is_checked() -> None:
    from tracelm.io.run_config import run_config_from_dict

    for bad in (0, 9, "x"):
        with pytest.raises(TracelmError, match="server.max_batch"):
            run_config_from_dict({"server": {"max_batch": bad}}, "cfg")


# --- through HTTP ---------------------------------------------------------------------------------------------


def test_server_streams_concurrent_requests_with_their_lone_text_and_traces(tmp_path, tiny_gguf, tiny) -> None:
    from tests.test_server_helpers import ServerProcess
    from tracelm.audit.replay import REPRODUCED, replay

    traces = tmp_path / "traces"
    config = {"model": str(tiny_gguf), "context": 128, "max_tokens": 16, "threads": 1,
              "sampling": {"temperature": 0.0, "repeat_penalty": 1.0},
              "server": {"queue_size": 8, "trace_dir": str(traces)}}
    server = ServerProcess(tmp_path, config)
    bodies = [{"prompt": [104, 101, 108, 108, 111], "max_tokens": 90},
              {"prompt": [119, 111, 114], "max_tokens": 90, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
               "min_p": 0.0, "seed": 3},
              {"prompt": [1, 2, 3, 4, 5, 6], "max_tokens": 90},
              {"prompt": [104, 101], "max_tokens": 90, "temperature": 0.7, "seed": 11}]
    try:
        model_id = tiny_gguf.stem
        results: list = [None] * 4

        def stream(i: int) -> None:
            r = server.request("POST", "/v1/completions", {"model": model_id, "stream": True, **bodies[i]})
            chunks = [json.loads(e.removeprefix("data: ")) for e in r.text.split("\n\n") if e and e != "data: [DONE]"]
            results[i] = (r.status, r.headers["x-request-id"], "".join(c["choices"][0]["text"] for c in chunks))

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        alone = [server.request("POST", "/v1/completions", {"model": model_id, **b}).json() for b in bodies]
        health = server.wait_idle()
    finally:
        server.stop()
    for (status, _, text), single in zip(results, alone, strict=True):
        assert status == 200 and text == single["choices"][0]["text"]
    assert health["counters"]["failed"] == 0
    assert health["counters"]["peak_batch"] >= 2, health  # some of them shared passes
    for _, rid, _ in results:  # each request's trace, recorded in a batch, replays exactly
        assert replay(traces / f"{rid}.jsonl").status == REPRODUCED


def test_a_failed_pass_fails_its_sequences_and_the_engine_serves_on(tiny_gguf, tiny, monkeypatch) -> None:
    real, calls = Session.feed, []

    def fails_once(gens):
        calls.append(len([g for g in gens if g.feed]))
        if len(calls) == 1:
            raise RuntimeError("boom")
        return real(gens)

    monkeypatch.setattr(Session, "feed", staticmethod(fails_once))
    engine = Engine(Session(tiny, engine_config(tiny_gguf, max_batch=2)))
    results = run_jobs(engine, SPECS[:3])
    assert calls[0] == 2 and [r["error"].status for r in results[:2]] == [500, 500]
    assert results[2]["text"] == lone_text(tiny, SPECS[2])[0]
    assert engine.counters.failed == 2 and engine.counters.served == 1


def test_bench_server_reports_each_stream_count(tiny_gguf) -> None:
    from tracelm.tools.bench_server import bench_server

    report = bench_server(str(tiny_gguf), (1, 3), n_prompt=8, n_decode=6, repeats=1)
    one, three = report["streams_1"], report["streams_3"]
    assert one["vs_1_stream"] == 1.0 and one["peak_batch"] == 1 and three["peak_batch"] == 3
    assert three["generated"] <= 18 and three["aggregate_tok_s"] > 0 and three["cpu_tok_s"] > 0
    assert 0 < one["products_ms_per_pass"] < one["ms_per_pass"] and three["products_ms_per_pass"] > 0
    ceiling = 3 * one["ms_per_pass"] / three["products_ms_per_pass"]  # what the products alone allow (ms rounded)
    assert three["ceiling_vs_1_stream"] == pytest.approx(ceiling, rel=0.15) and one["ceiling_vs_1_stream"] > 1


def test_bench_server_streams_decode_every_token_asked(tiny_gguf) -> None:
    """An end-of-generation token must not end a bench stream early (the batch would shrink part-way): with every
    token but one counted as an end, each stream still decodes all its tokens."""
    from tracelm.tools.bench import open_session
    from tracelm.tools.bench_server import _bench_server

    with open_session(str(tiny_gguf), threads=1) as session:
        tok = session.model.tokenizer
        tok.eog_ids = frozenset(range(tok.n_vocab - 1))
        report = _bench_server(session, (1, 3), n_prompt=8, n_decode=5, repeats=1)
    assert report["streams_3"]["generated"] == 15 and report["streams_3"]["shortest_stream"] == 5
    assert report["streams_1"]["generated"] == 5


def test_bench_server_cli_checks_streams(tiny_gguf) -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "tracelm.cli", "bench", "server", "--model", str(tiny_gguf),
                          "--streams", "1,9"], capture_output=True, text=True)
    assert out.returncode == 2 and "--streams '1,9'" in out.stderr and "Traceback" not in out.stderr


def test_an_evicted_session_frees_its_cache_at_once(tmp_path, tiny_gguf, tiny) -> None:
    """A session's runner leaves memory when the store evicts it, and a request's Tracer when the request ends,
    not at the next run of Python's cycle collector: nothing of a finished request is left in a reference cycle.
    (The soak's RSS bound depends on it: the collector's oldest generation runs rarely in a server.)"""
    cfg = engine_config(tiny_gguf, max_batch=1, max_sessions=1, trace_dir=str(tmp_path / "traces"))
    engine = Engine(Session(tiny, cfg))
    made: list[weakref.ref] = []
    new = engine.sessions._new
    engine.sessions._new = lambda: made.append(weakref.ref(r := new())) or r
    specs = [{"ids": [104, 101, 108], "session": s, "max_tokens": 4, "logprobs": 1} for s in "ABC"]
    gc.collect()
    gc.disable()
    try:
        results = run_jobs(engine, specs)
        alive = [r() is not None for r in made]
        tracers = sum(type(o) is Tracer for o in gc.get_objects())
    finally:
        gc.enable()
    assert all("done" in r for r in results) and engine.sessions.evicted == 2
    assert alive == [False, False, True], alive
    assert tracers == 0 and len(list((tmp_path / "traces").iterdir())) == 3  # each request's trace (4 MiB held)
