"""`tracelm batch`: a JSON-lines file of prompts through one model load, several sequences per forward pass,
one result line per item appended as it finishes; on this machine, or on a Ray cluster (Ray Data).

Input, one JSON object a line: `{"id": ..., "prompt": "..."}` or `{"id": ..., "messages": [{"role", "content"},
...]}` (the model's chat template), with optional `max_tokens`, `stop` and sampling fields (`SAMPLING_FIELDS`).
An id is a string or an integer, unique in the file. Output, one JSON object a line per item: the id, the text,
the finish reason, token counts, the seed, timings and the sha256 chain hash of the item's trace (its last line's
`hash`: `--traces DIR` keeps the trace as DIR/<name>.jsonl, verifiable with `tracelm trace verify`).

The items go through the server's engine (`tracelm.server.queue.Engine`): up to `batch_size` sequences decode
together, one forward pass per token for all of them, and a sequence's numbers do not depend on its company
(`forward_batch`). An item's seed is its own (`seed` on its line, else `item_seed(run seed, id)`), so a result
is the same whatever engine, batch size or order ran it. With `--engine ray` the pending items become a Ray
dataset whose `map_batches` runs on actors that each hold one `Worker` (one model load per actor).

Robust by construction: each result line is written whole and flushed when its item finishes, so a crash or
Ctrl-C loses only items still decoding; a re-run skips the ids already in the output (a torn last line left by
a crash is cut off first); a bad input line is reported with its line number and skipped, or with `strict`
stops the run (exit 2) before anything is generated.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import attrs

from tracelm.io.files import GiB, read_regular
from tracelm.io.run_config import config_as_dict, record_from_dict, run_config_from_dict
from tracelm.server.errors import ApiError
from tracelm.server.queue import Engine, Job
from tracelm.session import Session, chat_prompt, shift_chat
from tracelm.state.errors import TracelmError, shown
from tracelm.state.records import SamplingParams
from tracelm.state.run_config import RunConfig

SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seed", "repeat_penalty", "repeat_last_n",
                   "frequency_penalty", "presence_penalty")
ITEM_FIELDS = ("id", "prompt", "messages", "max_tokens", "stop", *SAMPLING_FIELDS)
ROLES = ("system", "developer", "user", "assistant")
MAX_INPUT_BYTES = GiB  # an input (or output, read to resume) larger than this is refused before it is read
MAX_BATCH = 8  # the engine's limit: rows of a pass stay bitwise what they are alone (ServerOptions.max_batch)
_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
_FINAL_HASH = re.compile(rb'"hash":"([0-9a-f]{64})"(?:,"mac":"[0-9a-f]{64}")?(?:,"sig":"[0-9a-f]{128}")?\}\s*$')


# -- records -------------------------------------------------------------------------------------------------

@attrs.frozen
class Item:
    """One input line, checked and resolved against the run's config (everything but its token ids)."""

    line: int  # 1-based line number in the input file
    id: str | int
    prompt: str | None  # exactly one of prompt and messages
    messages: tuple[tuple[str, str], ...] | None  # (role, content) pairs
    max_tokens: int
    stop: tuple[str, ...]
    sampling: SamplingParams  # with the item's own seed


@attrs.frozen
class BadLine:
    line: int
    message: str


@attrs.frozen(eq=False)
class Outcome:
    """An item's result line (`record`), or why it produced none (`error`): its input's fault (`bad`: the prompt
    does not fit, the engine refused its request) or the engine's (it failed while generating)."""

    line: int
    id: str | int
    record: dict[str, Any] | None = None
    error: str | None = None
    bad: bool = False


@attrs.frozen
class BatchOptions:
    cfg: RunConfig
    input: Path
    output: Path
    traces: Path | None = None
    strict: bool = False
    engine: str = "local"  # local | ray
    address: str | None = None  # ray: join this cluster (None: start a local one)
    actors: int = 2  # ray: actors, each one model load
    cpus_per_actor: float = 1.0  # ray: CPUs each actor reserves (and its threads, unless the config sets them)
    batch_size: int = MAX_BATCH  # sequences decoded together per model
    progress: bool | None = None  # the tqdm bar: None = when stderr is a terminal


@attrs.frozen
class BatchReport:
    done_before: int  # ids already in the output, skipped
    written: int  # result lines appended by this run
    failed: int  # items the engine failed on (reported; a re-run retries them)
    bad_lines: int  # input lines skipped (reported: not an item, a duplicate id, a prompt that does not fit)
    completion_tokens: int
    seconds: float

    def describe(self) -> str:
        rate = self.written / self.seconds if self.seconds else 0.0
        tok = self.completion_tokens / self.seconds if self.seconds else 0.0
        return (f"[batch: {self.written} items written, {self.done_before} already done, {self.failed} failed, "
                f"{self.bad_lines} bad lines skipped; {self.completion_tokens} tokens in {self.seconds:.1f} s: "
                f"{rate:.2f} items/s, {tok:.1f} tok/s]")


# -- reading the input ---------------------------------------------------------------------------------------

def item_key(item_id: str | int) -> str:
    """An id as the output and the resume rule compare it: its JSON (1 and "1" are different ids)."""
    return json.dumps(item_id, ensure_ascii=False)


def item_seed(run_seed: int, item_id: str | int) -> int:
    """The seed of an item whose line gives none: 63 bits of sha256 over the run's seed and the item's id, so it
    depends on nothing else (not the line, the batch or the engine)."""
    digest = hashlib.sha256(f"{run_seed}\0{item_key(item_id)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def trace_name(item_id: str | int) -> str:
    """The file name (without .jsonl) of an item's trace: the id itself when it is a plain name (a string of
    letters, digits, '.', '_', '-' not all digits, or an integer), else '_' and 32 hex digits of its sha256."""
    if isinstance(item_id, int):
        return str(item_id)
    if _SAFE_NAME.fullmatch(item_id) and not item_id.isdigit():
        return item_id
    return "_" + hashlib.sha256(item_key(item_id).encode()).hexdigest()[:32]


def _field_error(field: str, why: str) -> TracelmError:
    return TracelmError(f"field '{field}': {why}")


def _item_id(obj: dict[str, Any]) -> str | int:
    if "id" not in obj:
        raise _field_error("id", "missing")
    value = obj["id"]
    if (isinstance(value, bool) or not isinstance(value, str | int) or value == ""
            or (isinstance(value, int) and not -(1 << 63) <= value < 1 << 63)):
        raise _field_error("id", f"expected a non-empty string or a 64-bit integer, got {shown(value)}")
    return value


def _messages(value: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise _field_error("messages", "expected a non-empty array of {\"role\", \"content\"} objects")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            raise _field_error(f"messages[{i}]", "expected an object with exactly \"role\" and \"content\"")
        if m["role"] not in ROLES:
            raise _field_error(f"messages[{i}].role", f"expected one of {', '.join(ROLES)}, got {m['role']!r}")
        if not isinstance(m["content"], str):
            raise _field_error(f"messages[{i}].content", f"expected a string, got {m['content']!r}")
        out.append(("system" if m["role"] == "developer" else m["role"], m["content"]))
    return tuple(out)


def _stop(value: Any) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _field_error("stop", f"expected a string or an array of non-empty strings, got {value!r}")
    return tuple(stops)


def _max_tokens(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _field_error("max_tokens", f"expected an integer >= 0, got {value!r}")
    return value


def _sampling(obj: dict[str, Any], cfg: RunConfig, item_id: str | int) -> SamplingParams:
    """The config's sampling with the line's fields over it; the seed the line's, else derived from the id."""
    fields = {k: obj[k] for k in SAMPLING_FIELDS if k in obj}
    try:
        given = record_from_dict(SamplingParams, fields)
    except TracelmError as e:
        message = str(e).removeprefix("config key ")
        raise _field_error(message.split(":", 1)[0], message.split(":", 1)[-1].strip()) from None
    values = {k: getattr(given, k) for k in fields}
    values.setdefault("seed", item_seed(cfg.sampling.seed, item_id))
    return attrs.evolve(cfg.sampling, **values)


def parse_item(line: int, text: str, cfg: RunConfig) -> Item:
    """One input line as an Item; a TracelmError naming the field otherwise."""
    try:
        obj = json.loads(text)
    except RecursionError:
        raise TracelmError("not valid JSON (nested too deeply)") from None
    except ValueError as e:  # a number of more than 4300 digits too
        raise TracelmError(f"not valid JSON ({str(e).split(';')[0]})") from None
    if not isinstance(obj, dict):
        raise TracelmError(f"expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(ITEM_FIELDS))
    if unknown:
        raise _field_error(unknown[0], f"unknown (known: {', '.join(ITEM_FIELDS)})")
    item_id = _item_id(obj)
    if ("prompt" in obj) == ("messages" in obj):
        raise _field_error("prompt", "give exactly one of \"prompt\" and \"messages\"")
    prompt = obj.get("prompt")
    if "prompt" in obj and (not isinstance(prompt, str) or not prompt):
        raise _field_error("prompt", f"expected a non-empty string, got {prompt!r}")
    messages = _messages(obj["messages"]) if "messages" in obj else None
    max_tokens = _max_tokens(obj["max_tokens"]) if "max_tokens" in obj else cfg.max_tokens
    stop = _stop(obj["stop"]) if "stop" in obj else cfg.stop
    return Item(line, item_id, prompt, messages, max_tokens, stop, _sampling(obj, cfg, item_id))


def read_items(path: Path, cfg: RunConfig) -> tuple[list[Item], list[BadLine]]:
    """Every line of the input as an Item, or a BadLine saying why not (blank lines are skipped); the second of
    two lines with one id is a BadLine."""
    data = read_regular(path, "batch input", MAX_INPUT_BYTES)
    items: list[Item] = []
    bad: list[BadLine] = []
    first: dict[str, int] = {}
    for n, raw in enumerate(data.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            item = parse_item(n, raw.decode("utf-8"), cfg)
        except UnicodeDecodeError:
            bad.append(BadLine(n, "not UTF-8 text"))
            continue
        except TracelmError as e:
            bad.append(BadLine(n, str(e)))
            continue
        key = item_key(item.id)
        if key in first:
            bad.append(BadLine(n, f"duplicate id {key} (first on line {first[key]})"))
            continue
        first[key] = n
        items.append(item)
    return items, bad


# -- the output: resume ----------------------------------------------------------------------------------------

def done_ids(path: Path) -> tuple[set[str], int]:
    """The ids (item_key) already in an output file, and the bytes of a torn last line (one without its newline:
    what a crash in mid-write leaves), which is cut off the file. A whole line that is not a result is a
    TracelmError: the file was not written by tracelm batch, or was edited."""
    if not os.path.lexists(path):
        return set(), 0
    data = read_regular(path, "batch output", MAX_INPUT_BYTES)
    *complete, tail = data.split(b"\n")  # tail: what follows the last newline (b"" when the file ends in one)
    ids: set[str] = set()
    good = 0  # bytes of complete result lines
    for n, raw in enumerate(complete, 1):
        key = _result_key(raw)
        if key is None:
            raise TracelmError(f"{path}:{n}: not a result line (a JSON object with an \"id\"); fix or remove it")
        ids.add(key)
        good += len(raw) + 1
    torn = len(data) - good
    if torn:
        _truncate(path, good)
    return ids, torn


def _result_key(raw: bytes) -> str | None:
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(obj, dict) or "id" not in obj:
        return None
    return item_key(obj["id"])


def _truncate(path: Path, size: int) -> None:
    try:
        os.truncate(path, size)
    except OSError as e:
        raise TracelmError(f"{path}: cannot cut off its torn last line: {e.strerror}") from None


class ResultFile:
    """The output, opened for appending: each record is one JSON line, written whole and flushed at once."""

    def __init__(self, path: Path):
        try:
            self.stream: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115 -- closed by close()
        except OSError as e:
            raise TracelmError(f"{path}: cannot write output: {e.strerror}") from None

    def write(self, record: dict[str, Any]) -> None:
        self.stream.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.stream.flush()

    def close(self) -> None:
        self.stream.close()


# -- the worker: one Session, the server's engine ------------------------------------------------------------

def final_hash(path: Path) -> str:
    """A trace's last chain hash (its footer line's `hash`): what names the whole trace."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 512))
        match = _FINAL_HASH.search(f.read())
    if match is None:
        raise TracelmError(f"{path}: the trace has no final hash (not closed by a footer)")
    return match.group(1).decode("ascii")


def engine_config(cfg: RunConfig, batch_size: int, trace_dir: Path) -> RunConfig:
    """The config the worker's Engine runs: `batch_size` sequences per pass, room for twice as many in flight,
    every item traced into `trace_dir`, no server sessions."""
    server = attrs.evolve(cfg.server, max_batch=batch_size, queue_size=2 * batch_size, trace_dir=str(trace_dir),
                          sessions_dir=None, max_sessions=0)
    return attrs.evolve(cfg, server=server)


class Worker:
    """A model loaded once, with the server's engine on it: items in, one Outcome per item out. Traces go to
    `trace_dir` (kept), or to a temporary directory, each deleted once its final hash is read."""

    def __init__(self, cfg: RunConfig, batch_size: int = MAX_BATCH, trace_dir: Path | None = None):
        self._scratch = tempfile.TemporaryDirectory(prefix="tracelm-batch-") if trace_dir is None else None
        self.keep_traces = trace_dir is not None
        self.trace_dir = Path(trace_dir) if trace_dir is not None else Path(self._scratch.name)
        self.session = Session(config=engine_config(cfg, batch_size, self.trace_dir))
        self.cfg = self.session.cfg
        self.in_flight = 2 * batch_size
        self.engine: Engine | None = None
        try:
            self.engine = Engine(self.session)  # loads the model
        except BaseException:
            self.close()
            raise
        self.engine.start()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.stop()
        self.session.close()
        if self._scratch is not None:
            self._scratch.cleanup()

    def prompt_ids(self, item: Item) -> list[int]:
        """The item's prompt as token ids (a chat rendered with the template, the config's system prompt first
        when the messages have none), checked against the context."""
        if item.messages is None:
            ids = self.session.encode(item.prompt or "")
        else:
            messages = [{"role": r, "content": c} for r, c in item.messages]
            if self.cfg.system and not any(m["role"] == "system" for m in messages):
                messages.insert(0, {"role": "system", "content": self.cfg.system})
            model = self.session.model
            ids = shift_chat(model, self.cfg, messages, chat_prompt(model, messages), item.max_tokens)
        self.session.check(len(ids), item.max_tokens)
        return ids

    def run(self, items: Iterable[Item], emit: Callable[[Outcome], None]) -> None:
        """Every item through the engine, `emit` called with each Outcome as it is ready (in the calling
        thread): first those whose prompt does not fit, then the others as they finish."""
        ready: list[tuple[Item, list[int]]] = []
        for item in items:
            try:
                ready.append((item, self.prompt_ids(item)))
            except TracelmError as e:
                emit(Outcome(item.line, item.id, error=str(e), bad=True))
        asyncio.run(self._run(ready, emit))

    async def _run(self, ready: list[tuple[Item, list[int]]], emit: Callable[[Outcome], None]) -> None:
        room = asyncio.Semaphore(self.in_flight)  # the engine's queue never overflows

        async def one(job: Job, item: Item) -> None:
            try:
                outcome = await self._collect(job, item)
            finally:
                room.release()
            if outcome is not None:
                emit(outcome)

        loop = asyncio.get_running_loop()
        tasks = []
        for item, ids in ready:
            await room.acquire()
            job = Job(request_id=trace_name(item.id), prompt_ids=ids, prompt_text=self.session.tokenizer.decode(ids),
                      max_tokens=item.max_tokens, sampling=item.sampling, stop=item.stop, deadline=math.inf,
                      loop=loop)
            self.engine.submit(job)
            tasks.append(asyncio.create_task(one(job, item)))
        await asyncio.gather(*tasks)

    async def _collect(self, job: Job, item: Item) -> Outcome | None:
        """The job's events gathered into its Outcome (None when it was cancelled: the run is stopping)."""
        pieces: list[str] = []
        while True:
            event = await job.events.get()
            if event[0] == "piece":
                pieces.append(event[1])
            elif event[0] == "error":
                error: ApiError = event[1]
                return Outcome(item.line, item.id, error=error.message, bad=error.status < 500)
            elif event[0] == "done":
                break
        done = event[1]
        if done["finish_reason"] == "cancelled":
            return None
        path = self.trace_dir / f"{job.request_id}.jsonl"
        record = {"id": item.id, "text": "".join(pieces), "finish_reason": done["finish_reason"],
                  "prompt_tokens": done["prompt_tokens"], "completion_tokens": done["completion_tokens"],
                  "seed": item.sampling.seed, "prefill_seconds": round(done["prefill_seconds"], 6),
                  "decode_seconds": round(done["decode_seconds"], 6), "trace_hash": final_hash(path)}
        if self.keep_traces:
            record["trace"] = path.name
        else:
            path.unlink()
        return Outcome(item.line, item.id, record)


# -- the run ---------------------------------------------------------------------------------------------------

class Progress:
    """Result lines as outcomes arrive: written and flushed, failures reported, the bar moved (items/s, tok/s)."""

    def __init__(self, out: ResultFile, total: int, opts: BatchOptions):
        from tqdm import tqdm

        self.out, self.opts = out, opts
        self.written = self.failed = self.bad = self.tokens = 0
        self.t0 = time.perf_counter()  # from when the model is loaded (`loaded`): the tokens/s of generation
        self.bar = tqdm(total=total, unit="item", file=sys.stderr, dynamic_ncols=True, leave=False,
                        disable=None if opts.progress is None else not opts.progress)

    def loading(self, what: str) -> None:
        """Say on the bar what is being loaded (before the first item, loading is all that happens)."""
        self.bar.set_description_str(f"loading {what}", refresh=True)

    def loaded(self) -> None:
        self.bar.set_description_str("generating", refresh=True)
        self.t0 = time.perf_counter()

    def emit(self, outcome: Outcome) -> None:
        if outcome.record is None:
            message = f"{self.opts.input}:{outcome.line}: id {item_key(outcome.id)}: {outcome.error}"
            if self.opts.strict:
                raise TracelmError(message + " (--strict)")
            self.bad += outcome.bad
            self.failed += not outcome.bad
            self.bar.write(f"tracelm: {message}; {'line skipped' if outcome.bad else 'no result'}", file=sys.stderr)
        else:
            self.out.write(outcome.record)
            self.written += 1
            self.tokens += outcome.record["completion_tokens"]
        self.bar.set_postfix_str(f"{self.tokens / max(time.perf_counter() - self.t0, 1e-9):.1f} tok/s", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def pending_items(opts: BatchOptions) -> tuple[list[Item], int, int]:
    """The input's items not yet in the output, how many were, and how many lines were bad (each reported; with
    `strict` the first is a TracelmError)."""
    items, bad = read_items(opts.input, opts.cfg)
    for b in bad:
        message = f"{opts.input}:{b.line}: {b.message}"
        if opts.strict:
            raise TracelmError(message + " (--strict)")
        print(f"tracelm: {message}; line skipped", file=sys.stderr)
    done, torn = done_ids(opts.output)
    if torn:
        print(f"tracelm: {opts.output}: cut off a torn last line ({torn} bytes) left by an interrupted run",
              file=sys.stderr)
    pending = [it for it in items if item_key(it.id) not in done]
    return pending, len(items) - len(pending), len(bad)


def check_options(opts: BatchOptions) -> None:
    if not 1 <= opts.batch_size <= MAX_BATCH:
        raise TracelmError(f"--batch-size {opts.batch_size}: expected 1 to {MAX_BATCH}")
    if opts.actors < 1 or opts.cpus_per_actor <= 0:
        raise TracelmError("--actors and --cpus-per-actor must be positive")
    if opts.engine == "local" and opts.address is not None:
        raise TracelmError("--address joins a Ray cluster: it needs --engine ray")
    if opts.input.resolve() == opts.output.resolve():
        raise TracelmError(f"--output {opts.output} is the input file")


def run_batch(opts: BatchOptions) -> BatchReport:
    """The whole command: resume, read the input, run the pending items on the engine asked for, append their
    results."""
    check_options(opts)
    t0 = time.perf_counter()
    items, before, bad = pending_items(opts)
    if opts.traces is not None:
        try:
            opts.traces.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TracelmError(f"--traces {opts.traces}: cannot create: {e.strerror}") from None
    out = ResultFile(opts.output)
    progress = Progress(out, len(items), opts)
    try:
        if items and opts.engine == "ray":
            progress.loading(f"{Path(opts.cfg.model).name} on {opts.actors} Ray actors")
            run_on_ray(opts, items, progress.emit)
        elif items:
            progress.loading(Path(opts.cfg.model).name)
            worker = Worker(opts.cfg, opts.batch_size, opts.traces)
            progress.loaded()
            try:
                worker.run(items, progress.emit)
            finally:
                worker.close()
    except KeyboardInterrupt:
        print(f"tracelm: interrupted; the {progress.written} results written are kept in {opts.output}: run the same "
              "command again to resume", file=sys.stderr)
        raise
    finally:
        progress.close()
        out.close()
    return BatchReport(before, progress.written, progress.failed, bad + progress.bad, progress.tokens,
                       time.perf_counter() - t0)


# -- Ray -----------------------------------------------------------------------------------------------------

def item_row(item: Item) -> str:
    """An Item as the JSON text a Ray dataset row carries (`item_from_row` reads it back, checked)."""
    return json.dumps({"line": item.line, "id": item.id, "prompt": item.prompt, "messages": item.messages,
                       "max_tokens": item.max_tokens, "stop": item.stop, "sampling": attrs.asdict(item.sampling)})


def item_from_row(text: str) -> Item:
    d = json.loads(text)
    messages = tuple((r, c) for r, c in d["messages"]) if d["messages"] is not None else None
    return Item(d["line"], d["id"], d["prompt"], messages, d["max_tokens"], tuple(d["stop"]),
                record_from_dict(SamplingParams, d["sampling"], "sampling."))


def outcome_row(outcome: Outcome) -> str:
    return json.dumps(attrs.asdict(outcome), ensure_ascii=False)


def outcome_from_row(text: str) -> Outcome:
    return Outcome(**json.loads(text))


class RayWorker:
    """A Ray Data actor: one Worker (one model load) on the config `config` (as `config_as_dict` writes it),
    called with batches of items (a pyarrow table's `item` column, `item_row` texts), answering with their
    outcomes (`outcome`, `outcome_row` texts)."""

    def __init__(self, config: dict[str, Any], batch_size: int, trace_dir: str | None):
        cfg = run_config_from_dict(config, "the driver's config")
        self.worker = Worker(cfg, batch_size, Path(trace_dir) if trace_dir else None)

    def __call__(self, table: Any) -> Any:
        import pyarrow as pa

        outcomes: list[Outcome] = []
        self.worker.run([item_from_row(t) for t in table.column("item").to_pylist()], outcomes.append)
        return pa.table({"outcome": pa.array([outcome_row(o) for o in outcomes], pa.string())})


def actor_config(opts: BatchOptions) -> dict[str, Any]:
    """The config an actor opens, as a mapping: model and tokenizer paths made absolute (an actor's working
    directory is not the driver's), its threads the CPUs it reserves unless the config names a count."""
    cfg = opts.cfg
    paths = {k: str(Path(v).resolve()) for k in ("model", "tokenizer") if (v := getattr(cfg, k)) and Path(v).exists()}
    threads = cfg.threads or max(1, int(opts.cpus_per_actor))
    return config_as_dict(attrs.evolve(cfg, threads=threads, **paths))


def run_on_ray(opts: BatchOptions, items: list[Item], emit: Callable[[Outcome], None]) -> None:
    """The items as a Ray dataset, `map_batches` over `opts.actors` RayWorker actors, each Outcome handed to
    `emit` on the driver as it comes back. Joins the cluster at `opts.address`, or one already initialised in
    this process, else starts a local one (shut down after)."""
    try:
        import ray
    except ImportError:
        raise TracelmError("--engine ray needs Ray: pip install 'tracelm[ray]'") from None
    started = not ray.is_initialized()
    if started:
        try:
            ray.init(address=opts.address, include_dashboard=False, logging_level="WARNING")
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise TracelmError(f"ray: cannot start or join a cluster{_at(opts.address)}: {_one_line(e)}") from None
    try:
        _quiet(ray, opts)
        for outcome in _ray_outcomes(ray, opts, items):
            emit(outcome)
    except ray.exceptions.RayError as e:  # an actor failed (its own traceback is in Ray's log above)
        raise TracelmError(f"ray: the batch failed: {_one_line(e)}") from None
    finally:
        if started:
            ray.shutdown()


def _quiet(ray: Any, opts: BatchOptions) -> None:
    """Ray Data's own bars and notes off (the batch's bar says it all); a word when the cluster has fewer CPUs
    than the actors reserve (they would wait for more)."""
    from ray.util.debug import log_once

    ray.data.DataContext.get_current().enable_progress_bars = False
    log_once("ray_data_progress_manager_disabled")  # its warning that the bars are off: they are, on purpose
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    cpus = ray.cluster_resources().get("CPU", 0)
    if cpus < opts.actors * opts.cpus_per_actor:
        print(f"tracelm: the Ray cluster has {cpus:g} CPUs, fewer than {opts.actors} actors x "
              f"{opts.cpus_per_actor:g} CPUs: some actors wait until the cluster grows", file=sys.stderr)


def _at(address: str | None) -> str:
    return f" at {address}" if address else ""


def _one_line(e: BaseException) -> str:
    lines = [s for s in str(e).splitlines() if s.strip()]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}".strip()


def _ray_outcomes(ray: Any, opts: BatchOptions, items: list[Item]) -> Iterator[Outcome]:
    per_call = 2 * opts.batch_size  # items an actor takes at once: its engine keeps batch_size decoding
    blocks = max(1, min(len(items), -(-len(items) // per_call)))
    traces = str(opts.traces.resolve()) if opts.traces is not None else None
    ds = ray.data.from_items([{"item": item_row(it)} for it in items], override_num_blocks=blocks)
    ds = ds.map_batches(RayWorker, batch_size=per_call, batch_format="pyarrow", concurrency=opts.actors,
                        num_cpus=opts.cpus_per_actor,
                        fn_constructor_kwargs={"config": actor_config(opts), "batch_size": opts.batch_size,
                                               "trace_dir": traces})
    for row in ds.iter_rows():
        yield outcome_from_row(row["outcome"])
