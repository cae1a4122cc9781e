"""Trace events: one JSON line per stage call, per sampled token, per generate call, with a hash chain.

The format is described in docs/trace.md (format "tracelm-trace", version 4). In short:

- line 1 is a `header` (resolved config, model and tokenizer hashes, versions, platform, BLAS, RNG, seed,
  prompt ids); then `generate` (one per generate call), `stage` (one per stage call) and `token` (one per
  sampled token) events; the last line is a `footer` (counts and totals).
- Every line is `{BODY,"hash":"H"}` or `{BODY,"hash":"H","mac":"M"}` where BODY ends with `"prev":"P"`:
  H = sha256(BODY as UTF-8 bytes), P = the previous line's H (64 zeros on line 1), M = HMAC-SHA256(key, H)
  when the trace is signed. Editing, deleting, inserting or reordering a line breaks the chain.
- A trace signed with an Ed25519 key (`--sign-key FILE`, version 4) names the algorithm and the public key in its
  header, and its footer line ends `,"sig":"S"}`: S = Ed25519 over the footer's H, which commits to every line
  (tracelm/io/trace_keys.py). One signature per trace, not per line (~200 lines a token, tens of us each).
- Fields whose names end in `_us` or `_seconds` are timing: they differ between two runs of the same config
  and seed (and so do the chain fields that cover them); everything else is deterministic.

Levels: "off" (no events), "summary" (statistics, no digests), "digest" (also a sha256-128 digest of the
output bytes, so two runs can be compared bit for bit).

The hot path (`Tracer.call`, or for a pass through graph.fused_layers, whose outputs are buffers the next stage
overwrites, the `note` that `Tracer.bind` returns, those buffers bound once per pass) is one call to the kernels'
TraceHolder per stage event: it times the stage, computes the output's statistics while its bytes are in cache
(numpy's reduceat order, so `_batch_stats` below gives the same bits) and, at level digest, copies its float32 bytes
into an arena (4 * BATCH_ELEMENTS bytes), with its start, duration, stage, layer and shapes in a meta row. Everything
else runs in batches -- at each token event, at flush, or when the arena is full -- in the trace kernels
(tracelm/kernels/trace_stats.c): every event's digest over the pool, then the lines (the token's own last) from a
template cached per sequence of stages and shapes (`_stage_head`), each closed, hashed and signed as `_chain` does,
rendered by the pool's worker while it waits between the next pass's kernel jobs, and written through one structlog
call per batch at the next event or flush (a token's lines reach the stream one token late). An output that is not
float32 has its statistics and digest computed by `_batch_stats` and `digest` when it is held.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import io
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from importlib import metadata as importlib_metadata
from operator import attrgetter
from pathlib import Path
from typing import IO, Any

import attrs
import numpy as np
import structlog

from tracelm.kernels import TraceHolder, trace_lines_post, trace_stats
from tracelm.state.records import Hidden

LEVELS = ("off", "summary", "digest")
FORMAT = "tracelm-trace"
TRACE_VERSION = 4  # 3: the footer says whether the run completed (`status`, `last_token`); 4: Ed25519 signatures
READABLE_VERSIONS = (2, 3, 4)  # version 2 traces (footers without a status: complete) still verify and replay
GENESIS = "0" * 64  # the `prev` of line 1
PACKAGES = ("tracelm", "numpy", "numexpr", "gguf", "tokenizers", "sentencepiece", "attrs", "structlog", "jinja2",
            "PyYAML", "llguidance")
BATCH_ELEMENTS = 1 << 20  # output elements held (4 MiB) that force a batch: bounds the memory a prefill holds
ARENA_BYTES = 4 * BATCH_ELEMENTS  # the float32 outputs' copies, held until their lines are rendered
META_ROWS, META_WIDTH = 4096, 24  # stage events held at most; each one's arena end, start, dur, stage, layer, shapes
TIMING_SUFFIXES = ("_us", "_seconds")
CHAIN_FIELDS = ("prev", "hash", "mac", "sig")
FOOTER_STATUSES = ("complete", "interrupted")
F32 = np.dtype(np.float32)


def is_timing_field(name: str) -> bool:
    return name.endswith(TIMING_SUFFIXES)


def output_arrays(out: Any) -> tuple[np.ndarray, ...]:
    """The arrays a stage returned, in field order (a record's array fields, or a bare array)."""
    if type(out) is Hidden:  # most stage outputs (~2/3 of a decode step's): no per-type lookup
        return (out.x,)
    get = _array_getters.get(type(out))
    if get is None:
        get = _array_getters[type(out)] = _array_getter(type(out))
    return get(out)


def _array_getter(cls: type) -> Callable[[Any], tuple[np.ndarray, ...]]:
    """For a record type, a function giving its array fields (those annotated as arrays) as a tuple."""
    if cls is np.ndarray:
        return lambda a: (a,)
    fields = [f for f in attrs.fields(cls) if "ndarray" in str(f.type)] if attrs.has(cls) else []
    if not fields:
        return lambda _out: ()
    get = attrgetter(*(f.name for f in fields))
    if len(fields) == 1:
        return lambda out: (v,) if type(v := get(out)) is np.ndarray else ()
    if any("None" in str(f.type) for f in fields):  # optional arrays: keep those present
        return lambda out: tuple(v for v in get(out) if type(v) is np.ndarray)
    return get


_array_getters: dict[type, Callable[[Any], tuple[np.ndarray, ...]]] = {}


def digest(arrays: list[np.ndarray]) -> str:
    """sha256-128: the first 128 bits of sha256 over the arrays' bytes in C order, one after another
    (sha256 rather than blake2b: with the CPU's SHA instructions it is about twice as fast here)."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(a if a.flags.c_contiguous else np.ascontiguousarray(a))
    return h.hexdigest()[:32]


def _flatten(arrays: list[np.ndarray]) -> np.ndarray:
    """All elements of the arrays, one after another, as one 1-D float array."""
    buf = np.concatenate(arrays, axis=None) if len(arrays) != 1 else arrays[0].ravel()
    return buf if buf.dtype.kind == "f" else buf.astype(np.float64)


def _batch_stats(buf: np.ndarray, sizes: list[int], overwrite: bool = False
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean, rms and max |x| of consecutive groups of the 1-D array `buf` (group i holds sizes[i]
    elements), in a few vectorised passes over all of them.

    Sums and sums of squares accumulate in the arrays' own float type (float32: numpy's pairwise
    summation keeps the relative error near 1e-6 for these sizes; float64 would double the cost), the
    divisions and the square root in float64; max |x| is the larger of max x and -min x. Empty groups give
    NaN. `overwrite`: buf is a scratch copy, squared in place (no large temporary to allocate and fault in).
    """
    n = len(sizes)
    counts = np.array(sizes, dtype=np.int64)
    if not counts.any():
        return np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan)
    offsets = np.cumsum(counts) - counts
    if counts.all():
        mean = np.add.reduceat(buf, offsets).astype(np.float64) / counts
        top, bottom = np.maximum.reduceat(buf, offsets), np.minimum.reduceat(buf, offsets)
        maxabs = np.abs(np.maximum(top, np.negative(bottom))).astype(np.float64)
        squares = np.square(buf, out=buf if overwrite else None)
        return mean, np.sqrt(np.add.reduceat(squares, offsets).astype(np.float64) / counts), maxabs
    nonempty = counts > 0
    mean, rms, maxabs = np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan)
    mean[nonempty], rms[nonempty], maxabs[nonempty] = _batch_stats(buf, counts[nonempty].tolist(), overwrite)
    return mean, rms, maxabs


def _num(x: float) -> str:
    """A statistic as JSON: 7 significant digits; NaN and infinities as strings (JSON has no literal)."""
    if x != x:
        return '"nan"'
    if x in (float("inf"), float("-inf")):
        return '"inf"' if x > 0 else '"-inf"'
    return f"{x:.7g}"


def package_versions() -> dict[str, str]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib_metadata.version(name)
        except importlib_metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


def platform_facts() -> dict[str, Any]:
    return {"python": sys.version.split()[0], "implementation": platform.python_implementation(),
            "machine": platform.machine(), "system": platform.system(), "release": platform.release(),
            "processor": platform.processor(), "cpu_count": os.cpu_count()}


def blas_facts() -> list[dict[str, Any]]:
    """The BLAS (and OpenMP) libraries numpy loaded, their versions, CPU kernels and thread counts."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return []
    keep = ("user_api", "internal_api", "version", "num_threads", "threading_layer", "architecture")
    return [{k: info.get(k) for k in keep} for info in threadpool_info()]


def kernel_facts() -> dict[str, Any]:
    """tracelm's compiled kernels: the path this CPU runs (amx, avx512vnni, avxvnni, avx2 or portable), its self-test
    against the portable path, and the pool's threads. None changes a bit of the products; recorded so a reader
    sees what ran."""
    import tracelm.kernels as kernels

    status, detail = kernels.selftest()[kernels.path()]
    return {"path": kernels.path(), "selftest": f"{status}: {detail}", "threads": kernels.threads()}


def tokenizer_sha256(model_path: Any) -> str:
    """For a GGUF, sha256 of its `tokenizer.*` metadata (vocabulary, types, merges, special ids, template) as
    canonical JSON: the same for two files that tokenize alike, whatever their weights. For any other
    tokenizer source (tokenizer.bin, .model, tokenizer.json, a model folder), the sha256 of its bytes."""
    from tracelm.io.registry import path_sha256

    p = Path(model_path)
    if p.is_dir():
        return path_sha256(p)
    with open(p, "rb") as f:
        if f.read(4) != b"GGUF":
            return path_sha256(p)
    st = os.stat(model_path)
    return _tokenizer_sha256(str(Path(model_path).resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _tokenizer_sha256(path: str, _size: int, _mtime_ns: int) -> str:
    from tracelm.io.gguf_file import GGUFFile

    meta = GGUFFile(path).metadata
    tok = {k: v for k, v in sorted(meta.items()) if k.startswith("tokenizer.")}
    text = json.dumps(tok, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=_jsonable)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def trace_key(env_name: str) -> bytes:
    """The HMAC key held in environment variable `env_name` (UTF-8 bytes)."""
    from tracelm.state.errors import TracelmError

    value = os.environ.get(env_name)
    if not value:
        raise TracelmError(f"environment variable {env_name} (the trace signing key) is not set or empty")
    return value.encode("utf-8")


def trace_signer(path: str | None) -> Any:
    """The Ed25519 private key in the PEM file `path` (a config's trace.sign_key), or None without one."""
    if path is None:
        return None
    from tracelm.io.trace_keys import load_private_key

    return load_private_key(path)


class Tracer:
    """Times stage calls and writes the trace's JSON lines to `stream`, a text stream or a binary one (UTF-8; a file
    opened "wb" is written the kernels' lines without a copy) (see the module docstring).

    `key`: HMAC key bytes; when given every line carries a `mac`. `signer`: an Ed25519 private key; when given the
    footer carries a `sig` over its chain hash. `seq` and `prev` continue a chain (a fresh trace starts at 0 and
    GENESIS).
    """

    def __init__(self, stream: IO[Any], level: str = "digest", key: bytes | None = None, signer: Any = None):
        if level not in LEVELS[1:]:
            raise ValueError(f"trace level must be 'summary' or 'digest', not {level!r}")
        self.level = level
        self.key = key
        self.signer = signer
        self.seq = 0
        self.prev = GENESIS
        self.n_tokens = 0  # token events so far: the index of the token the next forward pass computes
        self.counts: dict[str, int] = {}
        self.stage_ns = 0  # total duration of the stage calls drained
        self._digest = level == "digest"
        # the stage events held (TraceHolder, in the kernels): event i's row of _meta is its arena end, start, dur_ns,
        # stage id (_stage_ids), layer (-1: None) and shapes (shapes_row in trace_stats.c), _stats[i] its mean, rms
        # and max |x|; at level digest its float32 bytes stay in the arena for the digests. `_own`: event index ->
        # (mean, rms, maxabs, digest, dtype, shapes) of any other output
        self._arena = bytearray(ARENA_BYTES)
        self._meta, self._stats = np.zeros((META_ROWS, META_WIDTH), np.int64), np.zeros((META_ROWS, 3))
        self._stage_ids: dict[str, int] = {}
        self._own: dict[int, tuple[Any, ...]] = {}
        self._holder = TraceHolder(self._arena, self._meta, self._stats, self._stage_ids, self._hold_other,
                                   self._digest)
        # note(stage, layer, start, arrays): a stage's output arrays as a pass computed them without `call`
        # (graph.fused_layers, into buffers the next stage overwrites), held at once; its time is the time since the
        # last event was held
        self.note = self._holder.note
        self._templates: dict[tuple[Any, ...], str] = {}
        self._last_template: tuple[Any, str] = ((b"", ()), "")  # the last batch's key (rows, other outputs), template
        self._stream = stream
        self.written = (0, GENESIS)  # seq and prev after the last line written: where an interrupted chain resumes
        self._batch: dict[str, int] = {}  # lines per kind of the batch being written, counted once written
        # a batch posted to the kernels' idle worker (a token's stage events and its line), written when settled
        self._pending: Any = None
        # bound once: wrap_logger's lazy proxy binds a new logger at every call (two a token)
        self._writer = _LineWriter(self, stream)
        self._log = structlog.wrap_logger(self._writer, processors=[self._render],
                                          context_class=dict).bind()

    # -- the hot path -------------------------------------------------------------------------------
    def call(self, stage: str, layer: int | None, fn: Callable[..., Any], *args: Any) -> Any:
        t0 = time.perf_counter_ns()
        out = fn(*args)
        dur = time.perf_counter_ns() - t0
        self.note(stage, layer, getattr(out, "start", -1), output_arrays(out), dur)
        return out

    def bind(self, start: int, stages: dict[str, tuple[np.ndarray, ...]]) -> Callable[[str, int | None], None]:
        """For a pass through graph.fused_layers: each stage's output arrays (buffers the pass rewrites in place, the
        same at every layer), their buffers taken once; the function returned, note(stage, layer), holds a stage's
        event as `note` does, its outputs starting at position `start`. Until unbind (or the next bind)."""
        self._holder.bind(start, stages)
        return self._holder.mark

    def unbind(self) -> None:
        self._holder.unbind()

    def _hold_other(self, stage: str, layer: int | None, start: int, arrays: tuple[np.ndarray, ...], dur: int,
                    status: int) -> None:
        """An output the holder did not take as float32: no room (render what is held first; an output larger than
        the arena gets a larger one), or held but not float32 (its statistics and digest now)."""
        if status == -2:
            self._drain()
            need = sum(a.nbytes for a in arrays)
            if need > len(self._arena):
                self._arena = bytearray(need)
                self._holder.reset(self._arena)
            self.note(stage, layer, start, arrays, dur)
            return
        buf = _flatten(list(arrays))
        mean, rms, maxabs = _batch_stats(buf, [buf.size])
        d = bytes.fromhex(digest(list(arrays))) if self._digest else b""
        self._own[self._holder.n - 1] = (mean[0], rms[0], maxabs[0], d, arrays[0].dtype.name,
                                         tuple([a.shape for a in arrays]))

    # -- events -------------------------------------------------------------------------------------
    def event(self, kind: str, **fields: Any) -> None:
        """One non-stage event (header, generate, token, footer), after any pending stage events. A token's line is
        rendered with the stage events before it, while the next pass runs, and written at the next event or flush."""
        if kind == "token":
            self._drain({"tok": self.n_tokens, **fields})
            self.n_tokens += 1
            return
        self._drain()
        self._settle()
        self._log.msg(kind, **fields)

    def flush(self) -> None:
        self._drain()
        self._settle()
        self._stream.flush()

    def close(self) -> None:
        """After the last flush: let go of the holder and the logger. Both call back into the Tracer (a reference
        cycle), so without this its arena (4 MiB) and tables would wait for Python's cycle collector."""
        self._holder = self.note = self._log = self._writer = self._pending = None

    def _commit(self) -> None:
        """A rendered batch is written: count its lines and move the resume point past them."""
        for kind, n in self._batch.items():
            self.counts[kind] = self.counts.get(kind, 0) + n
        self.written = (self.seq, self.prev)

    def resync(self) -> None:
        """After an interruption (KeyboardInterrupt at any point): continue the chain from the last line written,
        forgetting any batch rendered but not written. Stage events still held, and a batch posted (it follows the
        last line written), are written by the next flush."""
        self.seq, self.prev = self.written

    def _drain(self, token: dict[str, Any] | None = None) -> None:
        """Post the stage events held (and `token`'s line after them) as one batch, once the batch before is
        written."""
        self._settle()
        n, repeats, arena = self._holder.n, self._holder.repeats, self._arena  # before the reset
        self.stage_ns = self._holder.held_ns
        own, self._own = self._own, {}
        if len(arena) > ARENA_BYTES:  # the larger arena of one large output is not kept
            self._arena = bytearray(ARENA_BYTES)
            self._holder.reset(self._arena)
        self._holder.reset()
        if n or token is not None:
            self._pending = self._post(n, repeats, arena, own, token)

    def _settle(self) -> None:
        """Write the batch posted, if any (its lines rendered by now, or finished here)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._log.msg("batch", pending=pending)

    # -- rendering and chaining (structlog processor) -------------------------------------------------
    def _render(self, _logger: Any, _name: str, event: dict[str, Any]) -> str:
        if event.get("event") == "batch" and "pending" in event:
            lines, self._batch = event["pending"]
            text, self.prev = lines.result(not self._writer.binary)
            self.seq += sum(self._batch.values())
            return text if type(text) is str else ((text,), {})  # structlog's (args, kwargs) for the writer
        self._batch = {event["event"]: 1}
        body = {"seq": self.seq, "event": event.pop("event"), **event, "prev": self.prev}
        line = _JSON.encode(body)[:-1]
        return self._chain(line, sign=body["event"] == "footer")

    def _chain(self, body: str, sign: bool = False) -> str:
        """Close one line: hash its body (and mac the hash; `sign`: the footer, also signed); advance seq and prev."""
        h = hashlib.sha256(body.encode("utf-8")).hexdigest()
        self.seq += 1
        self.prev = h
        tail = f',"hash":"{h}"'
        if self.key is not None:
            tail += f',"mac":"{hmac.new(self.key, h.encode("ascii"), "sha256").hexdigest()}"'
        if sign and self.signer is not None:
            from tracelm.io.trace_keys import sign as ed25519_sign

            tail += f',"sig":"{ed25519_sign(self.signer, h)}"'
        return body + tail + "}"

    def _post(self, n: int, repeats: bool, arena: bytearray, own: dict[int, tuple[Any, ...]],
              token: dict[str, Any] | None) -> tuple[Any, dict[str, int]]:
        """Post the n stage events held (~200 per decoded token, so kept lean) and `token`'s line after them to the
        trace kernels, which render, chain and sign them on the pool's otherwise idle worker while the next pass
        runs: event i's row of _meta and _stats (see __init__), its float32 bytes (level digest) in `arena` from the
        previous event's end (their digests taken here, before the arena is reused); `own` holds the statistics,
        digests, dtypes and shapes of any other output. The template of the lines is cached per sequence of stages,
        layers and shapes, which repeats every decode step; trace_lines fills in each line's numbers, then closes and
        hashes each line in turn. Returns the pending lines and their count per kind."""
        meta, stats = self._meta[:n], self._stats[:n]
        digests = None
        if self._digest:
            offsets = np.zeros(n + 1, np.int64)
            offsets[1:] = meta[:, 0]
            digests = np.empty((n, 16), np.uint8)
            trace_stats(arena, offsets, None, digests)
        for i, (mean, rms, maxabs, d, *_) in own.items():
            stats[i] = mean, rms, maxabs
            if digests is not None:
                digests[i] = np.frombuffer(d, np.uint8)
        # a decode step's batch is the last one's (`repeats`: the holder compared their rows as it held them)
        repeats = repeats and not own and not self._last_template[0][1]
        key = () if repeats else (meta[:, 3:].tobytes(), tuple((i, o[4:]) for i, o in own.items()))
        if not repeats and key != self._last_template[0]:
            template = self._templates.get(key)
            if template is None:
                if len(self._templates) >= 256:  # prefill batches rarely repeat: keep the cache bounded
                    self._templates.clear()
                template = self._templates[key] = self._template(meta, own)
            self._last_template = (key, template)
        tail = None if token is None else _line_head({"seq": self.seq + n, "event": "token", **token})
        lines = trace_lines_post(self._last_template[1], self.seq, self.n_tokens, meta, stats, digests, self.prev,
                                 self.key, tail)
        return lines, {"stage": n, **({"token": 1} if token is not None else {})}

    def _template(self, meta: np.ndarray, own: dict[int, tuple[Any, ...]]) -> str:
        """trace_lines' template of a batch: each event's line head (LINE_FIELDS for its numbers), ended by NUL."""
        fields = LINE_FIELDS if self._digest else LINE_FIELDS[:6] + (None, LINE_FIELDS[7])
        names, heads = list(self._stage_ids), []
        for i, (stage, layer, *row) in enumerate(meta[:, 3:].tolist()):
            dtype, shapes = own[i][4:] if i in own else ("float32", _shapes_of(row))
            heads.append(_stage_head(names[stage], None if layer < 0 else layer, shapes, dtype, fields) + "\0")
        return "".join(heads)


class _LineWriter:
    """The Tracer's structlog logger: writes and flushes each rendered batch of lines, then commits it. To a binary
    stream (a file opened "wb") a line goes as UTF-8, and a batch's lines as the kernels wrote them (not copied)."""

    def __init__(self, tracer: Tracer, stream: IO[Any]):
        self._tracer, self._stream = tracer, stream
        self.binary = isinstance(stream, io.BufferedIOBase | io.RawIOBase)

    def msg(self, message: Any) -> None:
        if type(message) is str:
            line = message if message.endswith("\n") else message + "\n"  # a batch's lines end with theirs
            self._stream.write(line.encode("utf-8") if self.binary else line)
        else:
            self._stream.write(message)  # a batch's lines (bytes-like) to a binary stream
        self._stream.flush()
        self._tracer._commit()

    info = msg  # what structlog's bound logger calls for `msg`


def _shapes_of(row: list[int]) -> tuple[tuple[int, ...], ...]:
    """The shapes the holder wrote in a meta row (from its column META_SHAPES): k, then each array's ndim and dims."""
    shapes, at = [], 1
    for _ in range(row[0]):
        shapes.append(tuple(row[at + 1 : at + 1 + row[at]]))
        at += 1 + row[at]
    return tuple(shapes)


LINE_FIELDS = tuple(chr(i) for i in range(1, 9))  # trace_lines' one-byte fields, in _stage_head's order


def _stage_head(stage: str, layer: int | None, shapes: tuple[tuple[int, ...], ...], dtype: str,
                fields: tuple[str | None, ...]) -> str:
    """A stage line up to its `prev` value, its numbers given as text: `fields` are seq, tok, start, mean, rms,
    maxabs, digest (None: level summary, no digest field) and dur_us -- as rendered (seq, tok and start as
    integers, each statistic by `_num`, dur_us as "%.1f" of the microseconds), or LINE_FIELDS, trace_lines'
    template of them."""
    seq, tok, start, mean, rms, maxabs, dig, dur = fields
    shape = ",".join("[" + ",".join(map(str, sh)) + "]" for sh in shapes)
    n = shapes[0][0] if shapes and len(shapes[0]) > 1 else 1
    layer_text = "null" if layer is None else layer
    return (f'{{"seq":{seq},"event":"stage","tok":{tok},"stage":{json.dumps(stage)},"layer":{layer_text},'
            f'"start":{start},"n":{n},"shape":[{shape}],"dtype":"{dtype}","mean":{mean},"rms":{rms},'
            f'"maxabs":{maxabs}' + ("" if dig is None else f',"digest":"{dig}"') + f',"dur_us":{dur},"prev":"')


def _line_head(body: dict[str, Any]) -> str:
    """An event's line up to its `prev` value, as _render writes it (trace_lines' tail: a line without fields)."""
    return _JSON.encode({**body, "prev": ""})[:-2]


def _jsonable(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, bytes):
        return x.decode("utf-8", "replace")
    if attrs.has(type(x)):
        return attrs.asdict(x)
    if isinstance(x, tuple | set | frozenset):
        return list(x)
    return str(x)


_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), default=_jsonable)  # a line's json.dumps


def write_header(tracer: Tracer, run_config: Any, model: Any, prompt_ids: list[int], continues: str | None = None,
                 attestation: dict[str, Any] | None = None) -> None:
    """The opening event: everything needed to know what the run was and to repeat it. `continues`: the last
    line hash of the trace this one follows (a chat resumed from a session file), written as the field
    `continues` (absent otherwise). `attestation`: the evidence binding the signing key to the TEE ({"binding",
    "evidence"}, docs/trust.md), written as the field `attestation` (absent otherwise)."""
    from tracelm.io.registry import path_sha256
    from tracelm.io.run_config import config_as_dict
    from tracelm.version import __version__

    tok = model.tokenizer
    tracer.event(
        "header",
        format=FORMAT,
        trace_version=TRACE_VERSION,
        level=tracer.level,
        digest_algorithm="sha256-128" if tracer.level == "digest" else None,
        hash_algorithm="sha256",
        mac_algorithm="hmac-sha256" if tracer.key is not None else None,
        **signature_fields(tracer.signer),
        **({"attestation": attestation} if attestation is not None else {}),
        tracelm_version=__version__,
        config=config_as_dict(run_config),
        model_file=str(Path(model.path).resolve()),
        model_sha256=path_sha256(model.path),
        tokenizer_sha256=tokenizer_sha256(model.tokenizer_path or model.path),
        model_config=attrs.asdict(model.cfg),
        packages=package_versions(),
        platform=platform_facts(),
        blas=blas_facts(),
        kernels=kernel_facts(),
        rng={"generator": "PCG64", "seeding": "numpy.random.default_rng(seed)", "seed": run_config.sampling.seed,
             "draws_per_token": 1},
        seed=run_config.sampling.seed,
        prompt_ids=[int(i) for i in prompt_ids],
        prompt_text=tok.decode(prompt_ids),
        **({"continues": continues} if continues else {}),
        created_unix_seconds=round(time.time(), 3),
    )


def signature_fields(signer: Any) -> dict[str, Any]:
    """The header's signature fields: the algorithm (null when unsigned) and, when signed, the public key (raw, hex)
    and its fingerprint (sha256 of the raw key)."""
    if signer is None:
        return {"signature_algorithm": None}
    from tracelm.io.trace_keys import ALGORITHM, fingerprint, public_hex

    public = signer.public_key()
    return {"signature_algorithm": ALGORITHM, "public_key": public_hex(public),
            "public_key_sha256": fingerprint(public)}


def decode_rate(n_generated: int, decode_seconds: float) -> float:
    """Decode tokens per second, the one definition every report uses (`tracelm run`, chat's /stats, `trace show`,
    `trace plot`): tokens generated over the wall time of the decode loop (sampling, grammar and tracing included,
    prefill not); 0.0 when no time was measured."""
    return n_generated / decode_seconds if decode_seconds > 0 else 0.0


def write_footer(tracer: Tracer, stats: Any, text: str | None = None, status: str = "complete") -> None:
    """The closing event: whether the run completed, counts of every kind of event, the output, and timing totals.
    `status` "interrupted": the run was stopped (Ctrl-C) after the token `last_token`; the chain resumes from
    the last line written, so the trace still verifies."""
    if status not in FOOTER_STATUSES:
        raise ValueError(f"footer status {status!r} is not one of {FOOTER_STATUSES}")
    if status == "interrupted":
        tracer.resync()
    tracer.flush()
    counts = dict(sorted(tracer.counts.items()))
    tracer.event(
        "footer",
        status=status,
        last_token=counts.get("token", 0) - 1 if counts.get("token") else None,
        events=tracer.seq + 1,
        counts=counts,
        n_prompt=stats.n_prompt,
        n_reused=stats.n_reused,
        n_generated=stats.n_generated,
        finish_reason=stats.finish_reason,
        output_ids=list(stats.tokens),
        output_text=text,
        decode_passes=stats.n_passes,
        draft_tokens=stats.n_drafted,
        draft_accepted=stats.n_accepted,
        stage_total_us=round(tracer.stage_ns / 1000, 1),
        prefill_seconds=round(stats.prefill_seconds, 6),
        decode_seconds=round(stats.decode_seconds, 6),
    )
    tracer.flush()
