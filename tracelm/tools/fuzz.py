"""`tracelm fuzz TARGET --count N --seed S`: mutation fuzzing of the readers of untrusted input (issue 18).

Each target (tracelm/tools/fuzz_targets.py) has small valid inputs built in memory; each fuzz input is one of them
with 1 to 3 mutations: bit flips, bytes set to boundary values, truncation, extension, a chunk deleted or
repeated, and mutations that know the format -- a GGUF's counts, types, lengths, dims and offsets set to boundary
values, a JSON value (a safetensors header, config.json, a trace line) replaced by a value of another type or out
of range, a chat template's text spliced with template syntax. The inputs depend on --seed alone.

Each input is read in a worker process (so a hang can be stopped and a crash cannot take the fuzzer down) and
classified: accepted, a clean error (TracelmError: one line naming the problem), a CRASH (any other exception,
or the worker dying) or a HANG (no answer within --timeout-s). Crash and hang inputs are written to --crash-dir,
one folder each, to become regression cases. The worker's private memory is capped (RLIMIT_DATA, --memory-mb), so
a reader allocating from an untrusted count shows as a MemoryError crash rather than swapping the machine.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import re
import resource
import shutil
import struct
import tempfile
import time
import traceback
from collections import Counter
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import attrs

from tracelm.state.errors import TracelmError
from tracelm.tools.fuzz_targets import TARGETS, Sample

ALL = "all"
MAX_SAVED = 200  # crash/hang inputs written per run (the counts go on)

# ---------------------------------------------------------------- mutations

BOUNDARY_BYTES = (0x00, 0x01, 0x7F, 0x80, 0xFF, 0x20, 0x22, 0x5C)


def boundary_ints(width: int, original: int) -> list[int]:
    """Values worth trying in an unsigned field of `width` bytes that held `original` (wrapped to the width)."""
    top = 1 << (8 * width)
    values = [0, 1, 2, 3, 7, 8, 31, 32, 33, 255, 256, 4096, 1 << 16, top // 2 - 1, top // 2, top - 1, top - 2,
              original + 1, original - 1, original * 2, original // 2, original + (1 << 16), original << 8]
    if width == 8:
        values += [1 << 32, 1 << 40, (1 << 32) - 1]
    return [v % top for v in values]


def mutate_bytes(rng: random.Random, data: bytes, fields: list[tuple[int, int]]) -> bytes:
    """One mutation of `data`: generic, or of one of the (offset, width) integer `fields` when there are any."""
    if not data:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 16)))
    buf = bytearray(data)
    op = rng.randrange(8 if fields else 6)
    pos = rng.randrange(len(buf))
    if op == 0:  # bit flips
        for _ in range(rng.randrange(1, 9)):
            i = rng.randrange(len(buf))
            buf[i] ^= 1 << rng.randrange(8)
    elif op == 1:
        buf[pos] = rng.choice(BOUNDARY_BYTES)
    elif op == 2:  # truncation, often inside the first kilobytes (the headers)
        return bytes(buf[: rng.randrange(min(len(buf), 4096 if rng.random() < 0.7 else len(buf)))])
    elif op == 3:  # extension
        return bytes(buf) + rng.choice([b"\0" * rng.randrange(1, 64), bytes(rng.randrange(256) for _ in range(32)),
                                        bytes(buf[pos : pos + 256])])
    elif op == 4:  # a chunk deleted
        del buf[pos : pos + rng.randrange(1, 64)]
    elif op == 5:  # a chunk repeated
        buf[pos:pos] = buf[pos : pos + rng.randrange(1, 64)]
    else:  # a format field set to a boundary value
        at, width = rng.choice(fields)
        original = int.from_bytes(buf[at : at + width], "little")
        buf[at : at + width] = rng.choice(boundary_ints(width, original)).to_bytes(width, "little")
    return bytes(buf)


def gguf_fields(data: bytes) -> list[tuple[int, int]]:
    """(offset, width) of a valid GGUF's integer fields: counts, key and string lengths, value types, array element
    types and counts, tensor dims, types and offsets."""
    u32, u64 = (lambda p: struct.unpack_from("<I", data, p)[0]), (lambda p: struct.unpack_from("<Q", data, p)[0])
    fields, pos = [(4, 4), (8, 8), (16, 8)], 24
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def value(vtype: int, pos: int, top: bool) -> int:
        if vtype == 8:
            fields.append((pos, 8)) if top else None  # every string length of a vocabulary would drown the rest
            return pos + 8 + u64(pos)
        if vtype != 9:
            return pos + sizes[vtype]
        fields.extend([(pos, 4), (pos + 4, 8)])
        etype, count, pos = u32(pos), u64(pos + 4), pos + 12
        for _ in range(count):
            pos = value(etype, pos, False)
        return pos

    for _ in range(u64(16)):  # metadata: key, value type, value
        fields.append((pos, 8))
        pos += 8 + u64(pos)
        fields.append((pos, 4))
        pos = value(u32(pos), pos + 4, True)
    for _ in range(u64(8)):  # tensor table: name, n_dims, dims, type, offset
        pos += 8 + u64(pos)
        n_dims = u32(pos)
        fields.extend([(pos, 4), *((pos + 4 + 8 * k, 8) for k in range(n_dims)), (pos + 4 + 8 * n_dims, 4),
                       (pos + 8 + 8 * n_dims, 8)])
        pos += 16 + 8 * n_dims
    return fields


def llama2c_fields(name: str, data: bytes) -> list[tuple[int, int]]:
    """The 7 int32 of a checkpoint's header; a tokenizer.bin's max length and each token's length."""
    if name == "model.bin":
        return [(4 * k, 4) for k in range(7)]
    fields, pos = [(0, 4)], 4
    while pos + 8 <= len(data):
        fields.append((pos + 4, 4))
        pos += 8 + struct.unpack_from("<i", data, pos + 4)[0]
    return fields


def fields_of(name: str, data: bytes) -> list[tuple[int, int]]:
    """The integer fields of a seed file (a valid one: the scanners trust its structure)."""
    if name.endswith(".gguf"):
        return gguf_fields(data)
    if name.endswith(".bin"):
        return llama2c_fields(name, data)
    if name == "model.safetensors":
        return [(0, 8)]
    return []


ODD_JSON = (0, -1, 1, 2**31, 2**63, 2**64, -(2**63), 1.5, -0.0, 1e308, "", "x", "F64", "../x", [], [1.5], [-1, 0],
            {}, {"a": 1}, None, True, False, [[[[]]]])


def _json_paths(value: Any, path: tuple = ()) -> list[tuple]:
    """Every path (keys and indices) to a value inside a parsed JSON document, the root included."""
    out = [path]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _json_paths(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value[:64]):
            out += _json_paths(v, (*path, i))
    return out


def mutate_json(rng: random.Random, doc: Any) -> Any:
    """The document with one value replaced by an odd one, one key dropped, or one nested very deep."""
    paths = [p for p in _json_paths(doc) if p]
    if not paths:
        return rng.choice(ODD_JSON)
    path = rng.choice(paths)
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    if isinstance(parent, dict) and rng.random() < 0.2:
        del parent[path[-1]]
    elif rng.random() < 0.03:
        parent[path[-1]] = "DEEP"  # rendered as 100,000 nested arrays (see `json_text`)
    else:
        parent[path[-1]] = rng.choice(ODD_JSON)
    return doc


def json_text(doc: Any) -> str:
    return json.dumps(doc, separators=(",", ":")).replace('"DEEP"', "[" * 100_000 + "]" * 100_000)


def mutate_safetensors_header(rng: random.Random, data: bytes) -> bytes:
    n = int.from_bytes(data[:8], "little")
    text = json_text(mutate_json(rng, json.loads(data[8 : 8 + n]))).encode()
    return struct.pack("<Q", len(text)) + text + data[8 + n :]


def mutate_trace(rng: random.Random, data: bytes) -> bytes:
    """One line's JSON value changed; mostly with the chain recomputed, so the change reaches past the hash check."""
    lines = data.decode("utf-8").splitlines()
    i = rng.randrange(len(lines))
    m = re.match(r'^(\{.*),"hash":"[0-9a-f]{64}"((?:,"mac":"[0-9a-f]{64}")?(?:,"sig":"[0-9a-f]{128}")?)\}$', lines[i])
    if m is None:
        return data
    doc = json.loads(m.group(1) + "}")
    prev = doc.pop("prev", None)
    lines[i] = json_text({**mutate_json(rng, doc), "prev": prev})[:-1] + f',"hash":"{"0" * 64}"{m.group(2)}}}'
    return ("\n".join(rechain(lines) if rng.random() < 0.8 else lines) + "\n").encode("utf-8")


def rechain(lines: list[str]) -> list[str]:
    """Each line's prev and hash recomputed (its mac and sig kept): an edit as someone without the keys makes it."""
    import hashlib

    out, prev = [], "0" * 64
    for line in lines:
        m = re.match(r'^(\{.*),"prev":"[^"]*","hash":"[0-9a-f]{64}"(.*)$', line, re.DOTALL)
        if m is None:
            return lines
        body = f'{m.group(1)},"prev":"{prev}"'
        prev = hashlib.sha256(body.encode("utf-8")).hexdigest()
        out.append(f'{body},"hash":"{prev}"{m.group(2)}')
    return out


TEMPLATE_SNIPPETS = ("{{", "}}", "{%", "%}", "{#", "#}", "{% for m in messages %}", "{% endfor %}", "{% if ",
                     "{% endif %}", "{{ messages }}", "| tojson", "| length", "~", "*", "**", "range(99999)",
                     "loop.index",
                     "{% set x = ", "namespace(", ".__class__", "raise_exception('x')", "'a' * 999", "{{ 1/0 }}",
                     "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "[::-1]", "|join", "messages[9]",
                     "{% for i in range(999) %}", "strftime_now('%Y')", "{%- ", " -%}", "\"", "'", "\\")


def mutate_template(rng: random.Random, data: bytes) -> bytes:
    text = data.decode("utf-8", "replace")
    pos = rng.randrange(len(text) + 1)
    op = rng.randrange(4)
    if op == 0:
        text = text[:pos] + rng.choice(TEMPLATE_SNIPPETS) + text[pos:]
    elif op == 1:
        text = text[:pos] + text[pos + rng.randrange(1, 40) :]
    elif op == 2:
        cut = rng.randrange(len(text) + 1)
        text = text[: min(pos, cut)] + text[min(pos, cut) : max(pos, cut)] * 2 + text[max(pos, cut) :]
    else:
        return mutate_bytes(rng, data, [])
    return text.encode("utf-8")


def mutate_file(rng: random.Random, name: str, data: bytes, fields: list[tuple[int, int]]) -> bytes:
    """One mutation of file `name`, of a kind that suits it; `fields`: its seed's integer fields."""
    structured = {".json": lambda: json_text(mutate_json(rng, json.loads(data))).encode(),
                  ".safetensors": lambda: mutate_safetensors_header(rng, data),
                  ".jsonl": lambda: mutate_trace(rng, data)}
    kind = Path(name).suffix
    if kind in structured and rng.random() < 0.65:
        try:
            return structured[kind]()
        except (ValueError, UnicodeDecodeError, RecursionError):  # an earlier mutation broke the structure
            pass
    if kind == ".jinja" and rng.random() < 0.8:
        return mutate_template(rng, data)
    return mutate_bytes(rng, data, fields if rng.random() < 0.6 else [])


def mutate(rng: random.Random, seed: Sample, fields: dict[str, list[tuple[int, int]]]) -> Sample:
    """A seed with 1 to 3 mutations, each of one of its files (`fields`: each file's integer fields)."""
    sample = dict(seed)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        name = rng.choice(sorted(sample))
        sample[name] = mutate_file(rng, name, sample[name], fields.get(name, []))
    return sample


# ---------------------------------------------------------------- the worker process


def _worker(conn: Connection, memory_mb: int) -> None:
    """Read inputs from `conn` until None; answer each with (outcome, error type, message)."""
    if memory_mb:
        limit = memory_mb << 20
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    base = Path(tempfile.mkdtemp(prefix="tracelm-fuzz-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    try:
        while (job := conn.recv()) is not None:
            target, sample = job
            conn.send(_read_one(TARGETS[target].read, base, sample))
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _read_one(read: Any, base: Path, sample: Sample) -> tuple[str, str, str]:
    folder = base / "input"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    for name, data in sample.items():
        (folder / name).write_bytes(data)
    try:
        read(folder)
    except TracelmError as e:
        return "error", type(e).__name__, str(e)[:300]
    except Exception as e:  # noqa: BLE001 -- what the fuzzer looks for
        return "crash", type(e).__name__, f"{_where(e)}: {str(e)[:200]}"
    return "accepted", "", ""


def _where(e: BaseException) -> str:
    """The innermost frame of tracelm's own code in the exception's traceback (file:line), else the innermost."""
    frames = traceback.extract_tb(e.__traceback__)
    ours = [f for f in frames if "/tracelm/" in f.filename and "/tools/fuzz" not in f.filename] or frames
    return f"{Path(ours[-1].filename).name}:{ours[-1].lineno}" if ours else "?"


class Worker:
    """A worker process reading inputs; restarted after a hang (killed) or a death."""

    def __init__(self, memory_mb: int):
        self.memory_mb = memory_mb
        self._start()

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no threads or state of the parent's
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, self.memory_mb), daemon=True)
        self.proc.start()
        child.close()

    def read(self, target: str, sample: Sample, timeout_s: float) -> tuple[str, str, str]:
        try:
            self.conn.send((target, sample))
            if not self.conn.poll(timeout_s):
                self.restart()
                return "hang", "Timeout", f"no answer within {timeout_s:g} s"
            return self.conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            self.proc.join(5)
            code = self.proc.exitcode
            self.restart()
            return "crash", "WorkerDied", f"the reader's process ended (exit status {code})"

    def restart(self) -> None:
        self.stop(kill=True)
        self._start()

    def stop(self, kill: bool = False) -> None:
        if not kill:
            try:
                self.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()
        self.conn.close()


# ---------------------------------------------------------------- a run


@attrs.define
class FuzzReport:
    target: str
    inputs: int = 0
    accepted: int = 0
    errors: Counter = attrs.Factory(Counter)  # clean errors by type
    crashes: Counter = attrs.Factory(Counter)  # crashes by type
    hangs: int = 0
    examples: dict[str, str] = attrs.Factory(dict)  # crash or hang type -> its first message
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return bool(self.crashes) or self.hangs > 0

    def describe(self) -> str:
        clean = sum(self.errors.values())
        lines = [f"{self.target}: {self.inputs} inputs: {self.accepted} accepted, {clean} clean errors, "
                 f"{sum(self.crashes.values())} crashes, {self.hangs} hangs ({self.seconds:.1f} s)"]
        if self.errors:
            lines.append("  clean errors by type: " + ", ".join(f"{k} {v}" for k, v in self.errors.most_common()))
        for kind, n in self.crashes.most_common():
            lines.append(f"  CRASH {kind} x{n}: {self.examples.get(kind, '')}")
        if self.hangs:
            lines.append(f"  HANG x{self.hangs}: {self.examples.get('hang', '')}")
        return "\n".join(lines)


@attrs.define
class FuzzOptions:
    target: str
    count: int
    seed: int = 0
    timeout_s: float = 10.0
    crash_dir: Path = Path("fuzz-crashes")
    memory_mb: int = 2048


def check_options(opts: FuzzOptions) -> None:
    if opts.target != ALL and opts.target not in TARGETS:
        raise TracelmError(f"fuzz: unknown target {opts.target!r} (targets: {', '.join(TARGETS)}, {ALL})")
    if opts.count < 1 or opts.timeout_s <= 0 or opts.memory_mb < 0:
        raise TracelmError("fuzz: --count must be at least 1, --timeout-s above 0 and --memory-mb at least 0")


def run_fuzz(opts: FuzzOptions) -> list[FuzzReport]:
    """Fuzz the target (or every one), --count inputs each, in one worker process; a report per target."""
    check_options(opts)
    names = list(TARGETS) if opts.target == ALL else [opts.target]
    worker, saved = Worker(opts.memory_mb), [0]
    try:
        return [_fuzz_target(name, opts, worker, saved) for name in names]
    finally:
        worker.stop()


def _fuzz_target(name: str, opts: FuzzOptions, worker: Worker, saved: list[int]) -> FuzzReport:
    rng = random.Random(f"{opts.seed}:{name}")
    seeds = TARGETS[name].seeds()
    fields = [{fname: fields_of(fname, data) for fname, data in seed.items()} for seed in seeds]
    report, t0 = FuzzReport(name), time.perf_counter()
    for i in range(opts.count):
        k = i if i < len(seeds) else rng.randrange(len(seeds))
        sample = seeds[k] if i < len(seeds) else mutate(rng, seeds[k], fields[k])
        outcome, kind, message = worker.read(name, sample, opts.timeout_s)
        report.inputs += 1
        if outcome == "accepted":
            report.accepted += 1
        elif outcome == "error":
            report.errors[kind] += 1
        else:
            key = "hang" if outcome == "hang" else kind
            report.hangs += outcome == "hang"
            if outcome == "crash":
                report.crashes[kind] += 1
            report.examples.setdefault(key, message)
            if saved[0] < MAX_SAVED:
                saved[0] += 1
                _save(opts.crash_dir / f"{name}-{i:06d}-{key}", sample, message)
    report.seconds = time.perf_counter() - t0
    return report


def _save(folder: Path, sample: Sample, message: str) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for fname, data in sample.items():
            (folder / fname).write_bytes(data)
        (folder / "outcome.txt").write_text(message + "\n", encoding="utf-8")
    except OSError as e:
        raise TracelmError(f"fuzz: --crash-dir {folder.parent}: cannot write: {e.strerror}") from None


def peak_rss_mb() -> tuple[float, float]:
    """Peak resident memory in MB of the largest finished worker process and of this process."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return children, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def summary(reports: list[FuzzReport], opts: FuzzOptions, seconds: float) -> str:
    lines = [r.describe() for r in reports]
    if len(reports) > 1:
        total = FuzzReport(ALL, sum(r.inputs for r in reports), sum(r.accepted for r in reports),
                           sum((r.errors for r in reports), Counter()), sum((r.crashes for r in reports), Counter()),
                           sum(r.hangs for r in reports))
        total.seconds = seconds
        lines.append(total.describe().splitlines()[0])
    worker_mb, own_mb = peak_rss_mb()
    lines.append(f"peak RSS {worker_mb:.0f} MB (reader process), {own_mb:.0f} MB (fuzzer); wall {seconds:.1f} s; "
                 f"seed {opts.seed}")
    if any(r.failed for r in reports):
        lines.append(f"crash and hang inputs written to {opts.crash_dir}/ (at most {MAX_SAVED})")
    return "\n".join(lines)
