"""The trace kernels (tracelm/kernels/trace_stats.c, sha256.c) against trace.py's Python statement of each piece:
SHA-256 and HMAC against hashlib, the numbers against `_num` and "%.1f", the statistics against `_batch_stats`
(numpy's reduceat) bit for bit, the lines against `_stage_head` + `Tracer._chain` byte for byte; and a traced pass
through the fused layers writes the lines a stage-by-stage pass writes."""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import os
import struct

import numpy as np
import pytest

import tracelm.kernels as kernels
from tests.conftest import _pull, write_tiny_gguf
from tracelm.kernels import _core
from tracelm.pipeline import graph
from tracelm.pipeline import trace as tm
from tracelm.pipeline.trace import LINE_FIELDS, Tracer, _batch_stats, _num, _stage_head

PATHS = kernels.paths()


@pytest.fixture(params=PATHS)
def path(request, kernels_restored) -> str:
    kernels.use_path(request.param)
    return request.param


def test_sha256_and_hmac_are_hashlibs() -> None:
    rng = np.random.default_rng(0)
    for n in [*range(0, 200), 447, 448, 511, 512, 4095, 100_003]:
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        for ni in (False, True):
            assert _core.trace_sha256(data, ni) == hashlib.sha256(data).digest(), (n, ni)
        key = rng.integers(0, 256, int(rng.choice([0, 7, 64, 65, 200])), dtype=np.uint8).tobytes()
        assert _core.trace_hmac(key, data, True) == hmac.new(key, data, "sha256").digest()
        assert _core.trace_hmac(key, data, False) == hmac.new(key, data, "sha256").digest()


def _awkward_doubles(rng: np.random.Generator) -> list[float]:
    vals = list(rng.standard_normal(5000) * 10.0 ** rng.integers(-30, 36, 5000))
    with np.errstate(over="ignore"):  # float32 overflows to infinity: welcome
        vals += [float(np.float32(v)) for v in rng.standard_normal(5000) * 10.0 ** rng.integers(-45, 39, 5000)]
    vals += [struct.unpack("d", rng.bytes(8))[0] for _ in range(5000)]  # any bits: NaNs, huge, denormal
    vals += [float(struct.unpack("f", rng.bytes(4))[0]) for _ in range(5000)]
    vals += [0.0, -0.0, float("nan"), float("-nan"), float("inf"), float("-inf"), 5e-324, -1e-310, 1e-45,
             1.7976931348623157e308, 1234567.5, 1234566.5, 9999999.5, 9999998.5, 99999995.0, 0.00012345675, 1e-5,
             9.9999995e-5, 1e7, 9999999.0, 1e16, 0.1, 0.5, 1.0, -2.5e-7, 3.4028234663852886e38]
    return vals


def test_numbers_are_written_as_python_writes_them() -> None:
    """_num's "%.7g" (NaN and infinities as JSON strings) and dur_us's "%.1f" % (ns / 1000), character for character."""
    rng = np.random.default_rng(1)
    for x in _awkward_doubles(rng):
        assert _core.trace_format(x, 0)[0] == _num(x), repr(x)
    ns_values = [*range(0, 2000), *rng.integers(0, 10**15, 5000).tolist(), 2**53 + 1, 2**62, 2**63 - 1]
    for ns in ns_values:
        assert _core.trace_format(0.0, ns)[1] == "%.1f" % (ns / 1000), ns


def _holder(n: int, arena_bytes: int, keep: bool = True) -> tuple[_core.TraceHolder, bytearray, np.ndarray,
                                                                     np.ndarray, list]:
    """A TraceHolder as the Tracer makes one (the events it refuses listed), with its arena, meta and stats."""
    arena, meta, stats, refused = bytearray(arena_bytes), np.zeros((n, 24), np.int64), np.zeros((n, 3)), []
    holder = _core.TraceHolder(arena, meta, stats, {}, lambda *a: refused.append(a), keep)
    return holder, arena, meta, stats, refused


def _hold(arrays_per_event: list[tuple[np.ndarray, ...]], keep: bool = True
          ) -> tuple[bytearray, np.ndarray, np.ndarray, list]:
    """The events' arrays held as the Tracer holds them: the arena, the offsets, the statistics computed as each was
    held, the events refused."""
    holder, arena, meta, stats, refused = _holder(len(arrays_per_event),
                                                  sum(a.nbytes for arrs in arrays_per_event for a in arrs) + 64, keep)
    for i, arrs in enumerate(arrays_per_event):
        holder.note("stage", i, 0, arrs, 0)
    return arena, np.array([0, *meta[:, 0]], np.int64), stats, refused


def _random_events(rng: np.random.Generator, n: int) -> list[tuple[np.ndarray, ...]]:
    events = []
    for _ in range(n):
        k = int(rng.choice([1, 1, 1, 3]))
        sizes = rng.integers(0, 700, k) if rng.random() < 0.9 else rng.integers(1, 150_000, k)
        arrs = tuple((rng.standard_normal(int(s)) * 10.0 ** rng.integers(-20, 20)).astype(np.float32) for s in sizes)
        for a in arrs:
            if a.size and rng.random() < 0.2:
                a[rng.integers(a.size)] = rng.choice([np.nan, np.inf, -np.inf, -0.0, 1e-42, 3e38])
        events.append(arrs)
    return events


def test_statistics_and_digests_are_the_python_ones_bit_for_bit(path: str) -> None:
    """Random batches (multi-array events, empty ones, NaN, infinities, denormals, a few large): each event's mean,
    rms and max |x|, as the holder computes them when it holds the event (keeping its bytes or not) and as trace_stats
    computes them from the arena, are `_batch_stats`'s over the same groups, bit for bit, on either path; each digest
    is sha256's."""
    rng = np.random.default_rng(2)
    for trial in range(60):
        events = _random_events(rng, int(rng.integers(1, 40)))
        arena, offsets, held_stats, refused = _hold(events)
        assert not refused
        stats, digests = np.empty((len(events), 3)), np.empty((len(events), 16), np.uint8)
        _core.trace_stats(arena, offsets, stats, digests)
        unkept = _hold(events, keep=False)
        assert not unkept[3] and not unkept[1].any()  # nothing kept in the arena
        for other in held_stats, unkept[2]:
            assert other.tobytes() == stats.tobytes()
        flat = [np.concatenate([a.ravel() for a in arrs]) if arrs else np.empty(0, np.float32) for arrs in events]
        with np.errstate(all="ignore"):
            ref = np.array(_batch_stats(np.concatenate(flat), [f.size for f in flat])).T
        assert stats.tobytes() == ref.tobytes() or np.array_equal(stats, ref, equal_nan=True), trial
        assert np.array_equal(np.isnan(stats), np.isnan(ref))
        for f, d in zip(flat, digests, strict=True):
            assert d.tobytes() == hashlib.sha256(f.tobytes()).digest()[:16]


def test_hold_takes_views_in_c_order_and_refuses_what_it_cannot_hold() -> None:
    x = np.random.default_rng(3).standard_normal((5, 30)).astype(np.float32)
    q, k = x[:, :18].reshape(5, 3, 6), x[:, 18:].reshape(5, 2, 6)  # a prompt's q and k: strided views
    holder, arena, meta, stats, refused = _holder(2, 2000)
    holder.note("qkv", None, 7, (q, k, x.T), 123)
    end = holder.used
    held = np.frombuffer(arena, np.float32, count=end // 4)
    assert np.array_equal(held, np.concatenate([q.ravel(), k.ravel(), x.T.ravel()]))
    assert meta[0, :5].tolist() == [end, 7, 123, 0, -1] and holder.n == 1
    assert tm._shapes_of(meta[0, 5:].tolist()) == ((5, 3, 6), (5, 2, 6), (30, 5))
    holder.note("norm", 2, 0, (np.zeros(3),), 5)  # float64: held, its statistics left to the refused hook
    assert holder.n == 2 and holder.used == end and meta[1, :5].tolist() == [end, 0, 5, 1, 2]
    assert refused[-1][4:] == (5, -1) and np.isnan(stats[1]).all()
    holder.note("qkv", 0, 0, (x,), 0)  # no row left
    assert holder.n == 2 and refused[-1][-1] == -2
    holder.reset()
    holder.note("qkv", 0, 0, (x, x, x, x), 0)  # no room
    assert holder.n == 0 and refused[-1][-1] == -2
    holder.reset(bytearray(4000))
    holder.note("qkv", 0, 0, (x, x), 0)
    assert holder.n == 1 and holder.used == 2 * x.nbytes


@pytest.mark.parametrize("keep", [False, True])
def test_bound_stages_are_held_as_noted(path: str, keep: bool) -> None:
    """A fused pass binds its stages' buffers once (bind) and marks each stage as its output is complete: the rows,
    statistics and arena bytes are note's, whatever the buffers hold at each mark; the holder says whether a batch's
    rows repeat the last one's, and totals the durations."""
    rng = np.random.default_rng(6)
    buf, x = np.zeros((2, 40), np.float32), np.zeros((2, 16), np.float32)
    q, k = buf[:, :24].reshape(2, 3, 8), buf[:, 24:].reshape(2, 2, 8)
    noted, bound = _holder(64, 1 << 16, keep), _holder(64, 1 << 16, keep)
    bound[0].bind(5, {"norm": (x,), "qk": (q, k), "f64": (np.zeros(3),)})
    total = 0
    for batch in range(3):
        for layer in range(4 if batch < 2 else 3):
            for stage, arrays in (("norm", (x,)), ("qk", (q, k))):
                for a in (x, buf):
                    a[...] = rng.standard_normal(a.shape) * 10.0 ** rng.integers(-3, 3)
                noted[0].note(stage, layer, 5, arrays, 0)
                bound[0].mark(stage, layer)
        bound[0].mark("f64", None)  # not float32: its statistics left to the refused hook
        noted[0].note("f64", None, 5, (np.zeros(3),), 0)
        n = noted[0].n
        assert bound[0].n == n and bound[0].used == noted[0].used
        assert np.array_equal(bound[2][:n, [0, 1, 3, 4]], noted[2][:n, [0, 1, 3, 4]])
        assert np.array_equal(bound[2][:n, 5:], noted[2][:n, 5:])
        assert np.array_equal(bound[3][:n], noted[3][:n], equal_nan=True)
        assert bound[1][: bound[0].used] == noted[1][: noted[0].used]
        assert bound[4][-1][0] == "f64" and bound[4][-1][2] == 5 and bound[4][-1][5] == -1
        total += int(bound[2][:n, 2].sum())
        assert bound[0].repeats == (batch == 1) and bound[0].held_ns == total
        noted[0].reset()
        bound[0].reset()
    with pytest.raises(KeyError, match="not bound"):
        bound[0].mark("ffn", 0)
    bound[0].unbind()
    with pytest.raises(KeyError):
        bound[0].mark("norm", 0)


def _reference_lines(tracer: Tracer, events: list[tuple], stats: np.ndarray, digests: np.ndarray | None) -> str:
    """The lines as trace.py states them: `_stage_head` with Python's numbers, closed by Tracer._chain."""
    lines = []
    for i, (stage, layer, start, shapes, dur) in enumerate(events):
        dig = None if digests is None else digests[i].tobytes().hex()
        fields = (str(tracer.seq), str(tracer.n_tokens), str(start), *(_num(v) for v in stats[i]), dig,
                  "%.1f" % (dur / 1000))
        lines.append(tracer._chain(_stage_head(stage, layer, shapes, "float32", fields) + tracer.prev + '"'))
    return "".join(line + "\n" for line in lines)


@pytest.mark.parametrize("key", [None, b"k" * 70])
@pytest.mark.parametrize("level", ["summary", "digest"])
def test_lines_are_the_python_ones_byte_for_byte(path: str, level: str, key: bytes | None) -> None:
    rng = np.random.default_rng(4)
    pool = _awkward_doubles(rng)[-27:] + list(rng.standard_normal(40))
    for trial in range(20):
        n = int(rng.integers(1, 50)) if trial else 400  # 400: lines rendered over the pool in many tasks
        events = [(str(rng.choice(["qkv", "attn_norm", 'we"ird%s\\'])), None if rng.random() < 0.2 else int(i),
                   int(rng.integers(-1, 5000)), tuple(tuple(rng.integers(0, 70, rng.integers(0, 4)).tolist())
                                                      for _ in range(rng.integers(0, 4))), int(rng.integers(0, 10**9)))
                  for i in range(n)]
        stats = np.array([rng.choice(pool) for _ in range(3 * n)]).reshape(n, 3)
        digests = rng.integers(0, 256, (n, 16), dtype=np.uint8) if level == "digest" else None
        fields = LINE_FIELDS if digests is not None else LINE_FIELDS[:6] + (None, LINE_FIELDS[7])
        template = "".join(_stage_head(st, ly, sh, "float32", fields) + "\0" for st, ly, _, sh, _ in events)
        ref = Tracer(io.StringIO(), level, key)
        ref.seq, ref.n_tokens, ref.prev = int(rng.integers(0, 10**6)), int(rng.integers(0, 100)), os.urandom(32).hex()
        seq, prev = ref.seq, ref.prev
        want = _reference_lines(ref, events, stats, digests)
        meta = np.zeros((n, 24), np.int64)
        meta[:, 1], meta[:, 2] = [e[2] for e in events], [e[4] for e in events]
        text, last = _core.trace_lines(template, seq, ref.n_tokens, meta, stats, digests, prev, key)
        assert text == want and last == ref.prev
    assert _core.trace_lines("", 5, 0, np.zeros((0, 24), np.int64), np.zeros((0, 3)), None, "0" * 64, key) == (
        "", "0" * 64)


def test_posted_lines_are_trace_lines_and_a_template_that_does_not_fit_is_an_error(path: str) -> None:
    """trace_lines_post renders on the pool's idle worker what trace_lines renders, a tail line (a token's) chained
    after the events; a second post finishes the first. A template with fewer or more lines than events, a digest
    field without digests, or a field in the tail is a ValueError naming it."""
    rng = np.random.default_rng(7)
    fields = LINE_FIELDS[:6] + (None, LINE_FIELDS[7])
    batches = []
    for n in (300, 1, 57):
        events = [(str(rng.choice(["qkv", "attend"])), int(i), int(rng.integers(0, 99)),
                   ((1, int(rng.integers(1, 9))),), int(rng.integers(0, 10**7))) for i in range(n)]
        template = "".join(_stage_head(st, ly, sh, "float32", fields) + "\0" for st, ly, _, sh, _ in events)
        meta = np.zeros((n, 24), np.int64)
        meta[:, 1], meta[:, 2] = [e[2] for e in events], [e[4] for e in events]
        stats = rng.standard_normal((n, 3))
        ref = Tracer(io.StringIO(), "summary", b"k")
        ref.seq, ref.n_tokens, ref.prev = 40, 3, os.urandom(32).hex()
        args = (template, ref.seq, ref.n_tokens, meta, stats, None, ref.prev, b"k")
        tail = tm._line_head({"seq": ref.seq + n, "event": "token", "tok": 3, "id": 7, "piece": "é\n\"", "prob": 0.25})
        want = _reference_lines(ref, events, stats, None)
        want += ref._chain(tail + ref.prev + '"') + "\n"
        batches.append((args, tail, want, ref.prev))
    pending = [_core.trace_lines_post(*args, tail) for args, tail, _, _ in batches]  # each post finishes the last
    for p, (args, tail, want, last) in zip(pending, batches, strict=True):
        assert p.result() == (want, last) == _core.trace_lines(*args, tail)
        text, h = p.result(False)
        assert bytes(text).decode("utf-8") == want and h == last
        assert json.loads(want.splitlines()[-1])["piece"] == "é\n\""
    (template, *rest), tail, _, _ = batches[2]
    for bad, why in ((template.split("\0", 1)[1], "fewer"), (template + template.split("\0", 1)[0] + "\0", "more")):
        with pytest.raises(ValueError, match=why):
            _core.trace_lines_post(bad, *rest).result()
        with pytest.raises(ValueError, match=why):
            _core.trace_lines(bad, *rest, tail)
    with pytest.raises(ValueError, match="digests"):
        _core.trace_lines(template.replace(LINE_FIELDS[5], LINE_FIELDS[6]), *rest)
    with pytest.raises(ValueError, match="tail"):
        _core.trace_lines_post(template, *rest, tail + LINE_FIELDS[0])


def test_a_tracer_reuses_a_template_only_for_the_same_rows(path: str) -> None:
    """A batch of the stages, layers and shapes of the one before reuses its template; any other (other shapes, no
    stage events at all -- two tokens after one pass --, another dtype) has its own: every line as held."""
    stream = io.StringIO()
    tr = Tracer(stream, "summary")
    x, y = np.ones((1, 4), np.float32), np.ones((2, 4), np.float32)
    batches = [[("a", x), ("b", x)], [("a", x), ("b", x)], [], [("a", y)], [], [("c", x.astype(np.float64))],
               [("c", x)], [("c", x)]]
    want = []
    for batch in batches:
        for stage, arr in batch:
            tr.note(stage, 0, 0, (arr,), 0)
            want.append(("stage", stage, [list(arr.shape)], arr.dtype.name))
        tr.event("token", id=1, piece="a", prob=0.5)
        want.append(("token", None, None, None))
    tr.flush()
    events = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [(e["event"], e.get("stage"), e.get("shape"), e.get("dtype")) for e in events] == want
    assert [e["seq"] for e in events] == list(range(len(want)))


def test_a_tracer_batch_with_other_dtypes_and_a_large_output(path: str) -> None:
    """Float16, float64 and int outputs (statistics by `_batch_stats` in their own type, digests of their bytes), a
    bare array, and an output larger than the arena, between float32 ones: each line is the Python statement's,
    chained and signed as Tracer._chain does."""
    from tracelm.state.records import Heads, Hidden

    rng = np.random.default_rng(5)
    big = rng.standard_normal((tm.ARENA_BYTES // 4 // 1000 + 1, 1000)).astype(np.float32)
    outs = [Hidden(rng.standard_normal((2, 8)).astype(np.float32), 3), rng.standard_normal((3, 4)).astype(np.float16),
            Heads(*(rng.standard_normal((1, h, 4)).astype(np.float32) for h in (2, 1, 1)), 9),
            np.arange(12, dtype=np.int64).reshape(3, 4), Hidden(big, 0), rng.standard_normal(5),
            Hidden(np.full((1, 3), np.nan, np.float32), 1)]
    stream = io.StringIO()
    tr = Tracer(stream, "digest", b"key")
    for i, out in enumerate(outs):
        tr.call("stage", i, lambda out=out: out)
    tr.event("token", id=1, piece="a", prob=0.5)
    tr.flush()  # the token's batch is written at the next event or flush
    lines = stream.getvalue().splitlines()
    ref = Tracer(io.StringIO(), "digest", b"key")
    for i, (out, line) in enumerate(zip(outs, lines, strict=False)):
        arrays = list(tm.output_arrays(out))
        buf = tm._flatten(arrays)
        with np.errstate(all="ignore"):
            st = np.array(_batch_stats(buf, [buf.size])).T[0]
        event = json.loads(line)
        fields = (str(ref.seq), "0", str(getattr(out, "start", -1)), *(_num(v) for v in st), tm.digest(arrays),
                  f"{event['dur_us']:.1f}")
        assert line == ref._chain(_stage_head("stage", i, tuple(a.shape for a in arrays), arrays[0].dtype.name,
                                              fields) + ref.prev + '"'), i
    assert len(lines) == len(outs) + 1


def _traced_run(model, fused: bool, monkeypatch: pytest.MonkeyPatch, binary: bool = False) -> list[dict]:
    """A prompt and four decode steps traced (to a binary stream: `binary`), the chain checked; each line's fields
    but the timing and chain ones."""
    if not fused:
        monkeypatch.setattr(graph, "layer_note", lambda parts: False if parts[0].call is graph.plain_call else None)
    stream = io.BytesIO() if binary else io.StringIO()
    tracer = Tracer(stream, "digest")
    cache = graph.new_cache(model.cfg, 64)
    ids = model.tokenizer.encode("hello, hello world, and a longer prompt")[:20]
    logits = graph.forward(model.cfg, model.weights, cache, ids, call=tracer.call)
    for _ in range(4):
        tracer.event("token", id=1, piece="a", prob=0.5)
        logits = graph.forward(model.cfg, model.weights, cache, [int(np.argmax(logits.values[-1]))], call=tracer.call)
    tracer.flush()
    monkeypatch.undo()
    lines = (stream.getvalue().decode("utf-8") if binary else stream.getvalue()).splitlines()
    prev = tm.GENESIS
    for line in lines:
        body, h = line[: line.index(',"hash":')], json.loads(line)["hash"]
        assert body.endswith(f'"prev":"{prev}"') and h == hashlib.sha256(body.encode()).hexdigest()
        prev = h
    return [{k: v for k, v in json.loads(x).items() if not tm.is_timing_field(k) and k not in tm.CHAIN_FIELDS}
            for x in lines]


@pytest.mark.parametrize("window", [0, 8])
def test_a_traced_fused_pass_logs_what_a_staged_pass_logs(tmp_path, monkeypatch, window: int) -> None:
    """The traced pass runs graph.fused_layers, the tracer noting each stage's output: every line (timing and chain
    fields aside) is the stage-by-stage pass's, prompt and decode steps."""
    import gguf

    from tracelm import Session

    path = write_tiny_gguf(tmp_path / "tiny.gguf", qtype=gguf.GGMLQuantizationType.Q4_1, window=window, seed=3)
    with Session(str(path)) as s:
        fused, staged = _traced_run(s.model, True, monkeypatch), _traced_run(s.model, False, monkeypatch)
    assert len(fused) == len(staged) > 40 and fused == staged


def test_traced_lines_are_the_same_at_any_thread_count_on_either_path(tmp_path, monkeypatch, kernels_restored) -> None:
    """One or two threads (the lines rendered on the caller, or on the pool's idle worker), the portable or the AVX2
    path, a text or a binary stream: the same lines (timing and chain fields aside), each run's chain whole."""
    import gguf

    from tracelm import Session

    path = write_tiny_gguf(tmp_path / "tiny.gguf", qtype=gguf.GGMLQuantizationType.Q4_1, seed=4)
    runs = []
    with Session(str(path)) as s:
        for i, (p, threads) in enumerate((p, t) for p in PATHS for t in (1, 2)):
            kernels.use_path(p)
            kernels.set_threads(threads)
            runs.append(_traced_run(s.model, True, monkeypatch, binary=i % 2 == 1))
    assert len(runs[0]) > 40 and all(r == runs[0] for r in runs)


@pytest.mark.model
@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma3-270m", "qwen2.5-coder-0.5b-instruct"])
def test_real_models_traced_fused_pass_logs_what_a_staged_pass_logs(name, monkeypatch) -> None:
    """The same on the real models: SmolLM2, Gemma 3 (q/k norms, post-norms, windows), Qwen2.5-Coder (q/k/v bias)."""
    from tracelm import Session

    _pull(name)  # fetched, or skipped (failed under CI) where it cannot be
    with Session(name) as s:
        fused, staged = _traced_run(s.model, True, monkeypatch), _traced_run(s.model, False, monkeypatch)
    assert fused == staged
