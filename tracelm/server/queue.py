"""The engine: one model, one worker thread, requests decoded together in batches, started in arrival order.

numpy/BLAS work never runs on the event loop: `Engine.submit` admits a `Job` into a bounded queue (or
refuses it at once: the caller answers 429). The worker thread keeps a batch of up to `server.max_batch`
active sequences, each a `Generation` on its own `Runner` (the session's, or a scratch one emptied first),
so its own Cache, sampler and RNG, stop strings and limits. At every step boundary it starts waiting jobs
while the batch has room (their prompts prefilled one at a time), samples one token of every active
sequence, lets finished ones leave, and computes the next position of all the others in one batched
forward pass (one read of the weights for all of them). A sequence's numbers do not depend on its batch
(`forward_batch`), so a request gets the text it would get alone. Alone in the batch a sequence may
speculate (`speculative.draft_tokens`); with company it does not.

A job asking for n choices (`Job.n`) is prefilled once: choice 0 on its runner, then each other choice forks it
(`_fork`): a scratch runner whose Cache is a copy of choice 0's, sampling from the same last logits row with its
own seed (`choice_seed`) and its own grammar state. The n sequences then decode in the batch like any others; the
job starts only once the batch has room for all n.

What happens is posted back to the job's asyncio queue: `("start",)`, `("piece", text, logprobs, choice)` per
piece of text, `("done", result, choice)` per choice, or `("error", ApiError)`. A step's events go out together,
in order, once every sequence has sampled and before the pass (`post_all`: one wake-up of the event loop per step,
not one per token). A job ends early when its client
is gone (`Job.gone`), its time limit passes or its CPU budget is spent (`Job.cpu_used`: its prefill's CPU time and its
share of each step's): it is asked before every token, so generation stops within one token.

A `Task` is work that runs the model without sampling (the texts of an embeddings request): admitted into the same
bounded queue, it runs on the worker thread, one item per step boundary (so it shares the model with the batch
and never holds it up for more than one item's pass), each on a scratch runner; its future gets the results.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from tracelm.server.errors import ApiError
from tracelm.server.sessions import SessionFiles, SessionStore, prune_oldest
from tracelm.session import (
    Generation,
    GenerationStats,
    Runner,
    Session,
    check_sampling,
    held_bytes,
    numerics,
    release_memory,
    top_logprobs,
    write_footer,
)
from tracelm.state.errors import GrammarLibraryError, TracelmError
from tracelm.state.records import Choice, SamplingParams

log = logging.getLogger("tracelm.server")


class QueueFull(Exception):
    def __init__(self, retry_after: int):
        super().__init__("queue full")
        self.retry_after = retry_after


@attrs.define(eq=False)
class Job:
    request_id: str
    prompt_ids: list[int]
    prompt_text: str
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    deadline: float  # time.monotonic() after which generation stops
    loop: asyncio.AbstractEventLoop
    session_id: str | None = None
    logprobs: int | None = None  # top alternatives per token; None = no logprobs
    n: int = 1  # choices, sampled from one prefill
    cpu_limit: float = 0.0  # CPU seconds it may use (server.request_cpu_seconds; 0: no limit)
    predict_limit: float = 0.0  # seconds it may generate once its prompt is in (the deadline moves in; 0: none)
    cpu_used: float = 0.0  # its prefill's, and its share of each batched step's (worker thread only)
    remaining: int = 0  # its choices started and not yet ended (worker thread only)
    arrived: float = attrs.Factory(time.monotonic)  # when it was made (time to first token counts from here)
    events: asyncio.Queue = attrs.Factory(asyncio.Queue)
    gone: threading.Event = attrs.Factory(threading.Event)  # the client went away
    # a new watcher per choice: fed the choice's text, True ends it there (finish "stop"; its trace's footer says
    # interrupted: the server ended it, not the run's own rules). Tool calls: server/tools.py's ExcessCalls
    watch: Callable[[], Callable[[str], bool]] | None = None

    def post(self, *event: Any) -> None:
        """From the worker thread: hand an event to the request's coroutine."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server is shutting down
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    @property
    def over_cpu(self) -> bool:
        return 0 < self.cpu_limit < self.cpu_used


@attrs.define(eq=False)
class Task:
    """Work on the model without sampling: `fn(runner, item)` for each item in order, on the worker thread, one per
    step boundary, each on a scratch runner (its Cache is the function's to reset); `future` gets the list of
    results, or the first exception (an ApiError past `deadline`, time.monotonic())."""

    items: list[Any]
    fn: Callable[[Runner, Any], Any]
    deadline: float
    future: concurrent.futures.Future = attrs.Factory(concurrent.futures.Future)
    results: list[Any] = attrs.Factory(list)


def post_all(events: list[tuple[Job, tuple[Any, ...]]]) -> None:
    """From the worker thread: hand a step's events to their jobs' coroutines, in order, in one wake-up of each
    event loop (a wake-up per event passes the GIL to the loop's thread and back once per token of every
    sequence)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Job, tuple[Any, ...]]]] = {}
    for job, event in events:
        by_loop.setdefault(job.loop, []).append((job, event))
    for loop, items in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server is shutting down
            loop.call_soon_threadsafe(_deliver, items)


def _deliver(items: list[tuple[Job, tuple[Any, ...]]]) -> None:
    for job, event in items:
        job.events.put_nowait(event)


@attrs.define
class Counters:
    served: int = 0
    cancelled: int = 0  # client gone before or during generation
    timed_out: int = 0
    cpu_limited: int = 0  # stopped by server.request_cpu_seconds
    rejected: int = 0  # 429
    failed: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    generated_tokens: int = 0
    passes: int = 0  # decode forward passes
    peak_batch: int = 0  # most sequences that shared one pass
    step_seconds: float = 0.0  # wall time of decode steps (sampling every active sequence + their shared pass)
    step_cpu_seconds: float = 0.0  # the worker thread's CPU time in them (BLAS helper threads not included)
    forks: int = 0  # choices beyond the first of n > 1 requests, each from a copy of the first's prefilled Cache
    traces_deleted: int = 0  # oldest traces deleted to keep server.trace_dir within server.traces_max_mb


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request seeded `seed`: the seed itself for choice 0 (so n = 1 is as before),
    else 63 bits of sha256 of "seed:index" -- a run with a seed is reproducible choice by choice."""
    if index == 0:
        return seed
    return int.from_bytes(hashlib.sha256(f"{seed}:{index}".encode()).digest()[:8], "little") >> 1


@attrs.define(eq=False)
class Active:
    """A started job: its runner (its session's, or a scratch one), its Generation and its trace file."""

    job: Job
    started: float  # time.monotonic() when it left the waiting line
    index: int = 0  # which of the job's choices
    prefilled: bool = False  # its runner prefilled the prompt (the other choices fork from that one)
    runner: Runner | None = None
    gen: Generation | None = None
    tracer: Any = None
    closing: contextlib.ExitStack = attrs.Factory(contextlib.ExitStack)  # closes the trace file
    entries: list[dict[str, Any]] = attrs.Factory(list)  # logprobs of the tokens behind text not yet posted
    ended: bool = False
    sampled: bool = False  # its first token is drawn (time to first token observed)
    watch: Callable[[str], bool] | None = None  # the job's watcher of this choice's text
    cut: bool = False  # ended by its watcher

    def cancelled(self) -> bool:
        return self.job.gone.is_set() or time.monotonic() > self.job.deadline or self.job.over_cpu

    def logprob(self, choice: Choice, logits: np.ndarray) -> None:
        if self.job.logprobs is not None and choice.token not in self.runner.model.tokenizer.eog_ids:
            lp, ids, lps = top_logprobs(logits, choice.token, self.job.logprobs)
            self.entries.append({"id": choice.token, "logprob": lp, "top": list(zip(ids.tolist(), lps.tolist(),
                                                                                    strict=True))})


class Engine:
    def __init__(self, session: Session):
        self.session = session
        self.model = session.model
        self.cfg = cfg = session.cfg
        opts = cfg.server
        self.max_batch = opts.max_batch
        # runners for requests without a session, at most max_batch of them; each emptied before use
        self._scratch = [session.new_runner()]
        files = (SessionFiles(opts.sessions_dir, opts.sessions_max_mb << 20, session.model_sha256, numerics(cfg))
                 if opts.sessions_dir else None)
        self.sessions = SessionStore(session.new_runner, opts.max_sessions, opts.session_memory_mb << 20,
                                     held_bytes(self._scratch[0]), files, measure=held_bytes, release=release_memory)
        self.trace_dir = Path(opts.trace_dir) if opts.trace_dir else None
        self.trace_level = cfg.trace.level if cfg.trace.level != "off" else "digest"
        self.counters = Counters()
        self.active: list[Active] = []  # the batch: sequences decoding together (worker thread only)
        self._traces_max = opts.traces_max_mb << 20
        if self.trace_dir is not None:
            try:
                self.trace_dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise TracelmError(f"server.trace_dir {opts.trace_dir}: cannot create: {e.strerror}") from None
            self._bound_traces()  # sets _trace_bytes
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._outstanding = 0  # admitted and not finished: those decoding plus those waiting
        self._limit = opts.queue_size + 1
        self._mean_seconds = 1.0  # running mean of a job's time, for Retry-After
        self._outbox: list[tuple[Job, tuple[Any, ...]]] | None = None  # a step's events, posted together
        self._waiting: deque[Job] = deque()  # taken from the queue, not yet in the batch
        self._tasks: deque[Task] = deque()  # taken from the queue, not yet done (run one item per step boundary)
        # called on the worker thread with the seconds from a job's arrival to its first token (server metrics)
        self.on_first_token: Callable[[float], None] | None = None
        self._thread = threading.Thread(target=self._work, name="tracelm-engine", daemon=True)

    # -- the event loop's side ---------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        for a in list(self.active):
            a.job.gone.set()
        self._jobs.put(None)
        self._thread.join(timeout)

    def memory(self) -> dict[str, int]:
        """What the engine's arrays hold, in bytes: the stored sessions' (against their bound), the scratch runners'
        (sequences without a session, and forked choices), and the model's weights."""
        return {"sessions_bytes": self.sessions.nbytes, "session_memory_bytes": self.sessions.max_bytes,
                "sessions_evicted": self.sessions.evicted, "model_bytes": self.model.weights.nbytes,
                "scratch_bytes": sum(held_bytes(r) for r in list(self._scratch))}

    @property
    def running(self) -> int:
        """Requests decoding now (in the batch)."""
        return len(self.active)

    @property
    def queued(self) -> int:
        """Requests admitted and waiting for a place in the batch."""
        return max(0, self._outstanding - len(self.active))

    def submit(self, job: Job | Task) -> None:
        """Admit a job (or a Task) in arrival order, or raise QueueFull at once."""
        with self._lock:
            if self._outstanding >= self._limit:
                self.counters.rejected += 1
                rounds = self._outstanding / min(self.max_batch, self._outstanding)
                raise QueueFull(max(1, round(self._mean_seconds * rounds)))
            self._outstanding += 1
        self._jobs.put(job)

    # -- the worker thread -------------------------------------------------------------------------------

    def _work(self) -> None:
        """Step boundaries: take new jobs, start (prefill) those that fit the batch, then decode one token of
        every active sequence, the forward passes of all of them in one batched pass."""
        stopping = False
        while not stopping or self.active:
            block = not self.active and not self._waiting and not self._tasks and not stopping
            stopping = self._take(block) or stopping
            if stopping:
                self._cancel_all()
            self._admit()
            self._task_item()
            t0, c0 = time.perf_counter(), time.thread_time()
            self._step()
            self.counters.step_seconds += time.perf_counter() - t0
            self.counters.step_cpu_seconds += time.thread_time() - c0

    def _take(self, block: bool) -> bool:
        """Move jobs from the queue to the waiting line (waiting for one when `block`); True on the stop mark."""
        while True:
            try:
                job = self._jobs.get(block=block)
            except queue.Empty:
                return False
            if job is None:
                return True
            (self._tasks if isinstance(job, Task) else self._waiting).append(job)
            block = False

    def _cancel_all(self) -> None:
        for a in self.active:
            a.job.gone.set()
        while self._waiting:
            job = self._waiting.popleft()
            job.post("error", ApiError(503, "the server is shutting down", headers={"Retry-After": "1"}))
            self._release()
        while self._tasks:
            self._tasks.popleft().future.set_exception(ApiError(503, "the server is shutting down",
                                                                headers={"Retry-After": "1"}))
            self._release()

    def _task_item(self) -> None:
        """Run the next item of the oldest Task on a scratch runner; the Task leaves when its items are done (or one
        failed, or its time is up)."""
        if not self._tasks:
            return
        task = self._tasks[0]
        try:
            if time.monotonic() > task.deadline:
                raise ApiError(503, "the request ran past its time limit (server.request_timeout)",
                               headers={"Retry-After": "1"})
            runner = self._scratch.pop() if self._scratch else self.session.new_runner()
            try:
                task.results.append(task.fn(runner, task.items[len(task.results)]))
            finally:
                self._scratch.append(runner)
            if len(task.results) == len(task.items):
                task.future.set_result(task.results)
        except Exception as e:  # noqa: BLE001 -- the task's caller answers it
            task.future.set_exception(e)
        if task.future.done():
            self._tasks.popleft()
            self._release()

    def _admit(self) -> None:
        """Start waiting jobs in arrival order while the batch has room; a job whose session is busy in the
        batch waits for it (one Cache serves one request at a time)."""
        busy = {a.job.session_id for a in self.active} - {None}
        for job in list(self._waiting):
            if len(self.active) + job.n > self.max_batch:  # all of a job's choices start together
                return
            if job.session_id is not None:
                if job.session_id in busy:
                    continue
                busy.add(job.session_id)
            self._waiting.remove(job)
            self._start(job)

    def _start(self, job: Job) -> None:
        t0 = time.monotonic()
        if job.gone.is_set():
            self.counters.cancelled += 1
            return self._release()
        if t0 > job.deadline:
            self.counters.timed_out += 1
            job.post("error", ApiError(503, "the request waited in the queue past its time limit "
                                            "(server.request_timeout)", headers={"Retry-After": "1"}))
            return self._release()
        a = Active(job, t0, watch=job.watch() if job.watch is not None else None)
        job.remaining = 1
        forks: list[Active] = []
        try:
            a.runner = self._runner_for(job)
            job.post("start")
            a.tracer = self._open_trace(job, a.closing)
            cpu0 = time.process_time()
            a.gen = a.runner.start(job.prompt_ids, job.max_tokens, job.sampling, job.stop, cancel=a.cancelled,
                                   on_token=a.logprob if job.logprobs is not None else None, tracer=a.tracer)
            a.prefilled = True
            if job.predict_limit:  # generation's own time limit starts now, after the prefill
                job.deadline = min(job.deadline, time.monotonic() + job.predict_limit)
            if job.n > 1:
                snapshot = a.runner.cache.snapshot()
                if a.tracer is not None:  # the trace follows choice 0; the others are named by their seeds
                    a.tracer.event("fork", choices=job.n, seeds=[choice_seed(job.sampling.seed, i)
                                                                 for i in range(job.n)])
                for i in range(1, job.n):
                    forks.append(Active(job, t0, index=i, watch=job.watch() if job.watch is not None else None))
                    self._fork(forks[-1], a, snapshot)
            job.cpu_used += time.process_time() - cpu0
        except Exception as e:  # noqa: BLE001 -- mapped to the job's error answer
            for f in forks:
                self._end(f)
            return self._fail(a, e)
        self.active += [a, *forks]

    def _fork(self, f: Active, first: Active, snapshot: Any) -> None:
        """Choice f.index of first's job: a scratch runner holding `snapshot` (first's prefilled Cache), decoding
        from first's last logits row with the choice's own seed and grammar state."""
        job = f.job
        job.remaining += 1  # from here on f's _end releases its share
        f.runner = self._scratch.pop() if self._scratch else self.session.new_runner()
        f.runner.cache.restore(snapshot)
        sampling = attrs.evolve(job.sampling, seed=choice_seed(job.sampling.seed, f.index))
        n_prompt = len(job.prompt_ids)
        f.runner.stats = GenerationStats(n_prompt=n_prompt, n_reused=n_prompt, finish_reason="length")
        matcher = check_sampling(sampling, f.runner.model.tokenizer)
        f.gen = Generation(f.runner, list(job.prompt_ids), np.array(first.gen.rows[0]), job.max_tokens, sampling,
                           np.random.default_rng(sampling.seed), job.stop, f.cancelled,
                           f.logprob if job.logprobs is not None else None, None, matcher)
        self.counters.forks += 1

    def _step(self) -> None:
        """One token of every active sequence; those that finish leave; one pass computes the rest."""
        draft = self.active[0].runner.draft_tokens if len(self.active) == 1 else 0  # alone, it may speculate
        stepping, cpu0 = list(self.active), time.process_time()
        self._outbox = []
        try:
            for a in list(self.active):
                try:
                    text = a.gen.step(draft)
                    if not a.sampled and a.gen.stats.finish_reason != "cancelled":
                        self._first_token(a)
                    if text:
                        self._post(a.job, "piece", text, a.entries[:], a.index)
                        a.entries.clear()
                        if a.watch is not None and not a.gen.done and a.watch(text):
                            a.gen.end_here()
                            a.cut = True
                    if a.gen.done:
                        self._finish(a)
                except Exception as e:  # noqa: BLE001 -- mapped to the job's error answer
                    self._fail(a, e)
        finally:  # before the pass: the pieces go out while it runs
            self._flush()
            self._outbox = None
        n = sum(1 for a in self.active if a.gen.feed)
        if n:
            self.counters.passes += 1
            self.counters.peak_batch = max(self.counters.peak_batch, n)
        try:
            self.session.feed([a.gen for a in self.active])
        except Exception as e:  # noqa: BLE001 -- the shared pass failed: every sequence in it fails
            for a in [a for a in self.active if a.gen.feed]:
                self._fail(a, e)
        share = (time.process_time() - cpu0) / max(len(stepping), 1)  # each sequence's part of the step
        for a in stepping:
            a.job.cpu_used += share

    def _first_token(self, a: Active) -> None:
        """A sequence drew its first token: the time since its job arrived goes to `on_first_token` (choice 0's)."""
        a.sampled = True
        if a.index == 0 and self.on_first_token is not None:
            self.on_first_token(time.monotonic() - a.job.arrived)

    def _post(self, job: Job, *event: Any) -> None:
        """Post an event to a job: within a step's sampling, with the step's others (post_all); else at once."""
        if self._outbox is None:
            job.post(*event)
        else:
            self._outbox.append((job, event))

    def _flush(self) -> None:
        """Post the events gathered so far in this step."""
        if self._outbox:
            events, self._outbox = self._outbox, []
            post_all(events)

    def _finish(self, a: Active) -> None:
        text = a.gen.close()
        if text:
            self._post(a.job, "piece", text, a.entries[:], a.index)
        stats = a.runner.stats
        if a.tracer is not None:
            write_footer(a.tracer, stats, status="interrupted" if a.cut else "complete")
        self._end(a)
        finish, note = stats.finish_reason, None
        if finish == "cancelled":
            if a.job.gone.is_set():
                self.counters.cancelled += 1
            elif a.job.over_cpu:  # what was generated is returned, cut short as by max_tokens; nothing: a 400
                self.counters.cpu_limited += 1
                note = f"stopped after its CPU budget of {a.job.cpu_limit:g} s (server.request_cpu_seconds)"
                if stats.n_generated == 0:
                    return self._over_cpu(a, note)
                finish = "length"
            else:  # the time limit: what was generated is returned, cut short as by max_tokens
                self.counters.timed_out += 1
                finish = "length"
        if a.index == 0:  # the prompt is counted once for all of a request's choices
            self.counters.served += 1
            self.counters.prompt_tokens += stats.n_prompt
            self.counters.reused_tokens += stats.n_reused
        self.counters.generated_tokens += stats.n_generated
        self._post(a.job, "done", {"finish_reason": finish, "prompt_tokens": stats.n_prompt,
                                   "cached_tokens": stats.n_reused, "completion_tokens": stats.n_generated,
                                   "prefill_seconds": stats.prefill_seconds, "decode_seconds": stats.decode_seconds,
                                   "prefilled": a.prefilled, "note": note, "stop_word": stats.stop_word},
                   a.index)
        if a.job.session_id is not None:  # with server.sessions_dir: its file, once the answer is out
            self._flush()
            self.sessions.save(a.job.session_id)
            self._bound_sessions()

    def _over_cpu(self, a: Active, note: str) -> None:
        """A job stopped by its CPU budget before its first token: a 400 saying so (its prompt was too costly)."""
        self._post(a.job, "error", ApiError(400, f"the request was {note}, before its first token",
                                            code="cpu_budget_exceeded"))

    def _bound_sessions(self) -> None:
        """Keep the stored sessions within their count and bytes (a Cache grows masks and buffers as it is used)."""
        self.sessions.bound({a.job.session_id for a in self.active} - {None})

    def _fail(self, a: Active, e: Exception) -> None:
        """End a job with the error answer its exception calls for (a session's Cache may be half-written)."""
        job = a.job
        if isinstance(e, ApiError):
            self._post(job, "error", e)
        else:
            if job.session_id is not None:
                self.sessions.drop(job.session_id)
                release_memory()
            if isinstance(e, TracelmError):  # a user-caused error the checks before admission did not catch
                if isinstance(e, GrammarLibraryError):
                    log.warning("request %s refused: %s", job.request_id, e)
                self._post(job, "error", ApiError(400, str(e)))
            else:  # never let one request take the worker down; the client gets a plain 500
                self.counters.failed += 1
                log.error("request %s failed", job.request_id, exc_info=e)
                self._post(job, "error", ApiError(500, "internal error while generating; see the server log"))
        self._end(a)

    def _end(self, a: Active) -> None:
        """The job leaves: its trace file closes, a scratch runner goes back to the pool."""
        if a.ended:
            return
        a.ended = True
        if a in self.active:
            self.active.remove(a)
        a.closing.close()
        if a.tracer is not None:
            self._bound_traces(self._trace_path(a.job))
        a.gen = None  # its callbacks are a's bound methods: a cycle that would keep the runner (a session's Cache,
        # tens of MB) alive after an eviction until Python's cycle collector happens to run
        if a.runner is not None and a.job.session_id is None:
            self._scratch.append(a.runner)
        a.job.remaining -= 1
        if a.job.remaining == 0:  # the job's last choice: it leaves the queue's count
            self._release(a.started)

    def _release(self, started: float | None = None) -> None:
        with self._lock:
            self._outstanding -= 1
            if started is not None:
                self._mean_seconds = 0.8 * self._mean_seconds + 0.2 * (time.monotonic() - started)

    def _runner_for(self, job: Job) -> Runner:
        if job.session_id is not None:
            try:
                return self.sessions.get(job.session_id, frozenset({a.job.session_id for a in self.active}))
            except TracelmError as e:
                raise ApiError(400, str(e), param="session_id") from None
        runner = self._scratch.pop() if self._scratch else self.session.new_runner()
        runner.cache.reset()  # a request without a session sees nothing of the one before
        return runner

    def _open_trace(self, job: Job, closing: contextlib.ExitStack) -> Any:
        """The request's own trace file when server.trace_dir is set (a Tracer its generation writes into),
        open until `closing` closes."""
        if self.trace_dir is None:
            return None
        path = self._trace_path(job)
        cfg = attrs.evolve(self.cfg, prompt=job.prompt_text, max_tokens=job.max_tokens, stop=job.stop,
                           sampling=job.sampling, trace=attrs.evolve(self.cfg.trace, level=self.trace_level,
                                                                     file=str(path)))
        tracer = closing.enter_context(self.session.open_trace(job.prompt_ids, cfg=cfg))
        tracer.event("request", request_id=job.request_id, session_id=job.session_id)
        return tracer

    def _trace_path(self, job: Job) -> Path:
        assert self.trace_dir is not None
        return self.trace_dir / f"{job.request_id}.jsonl"

    def _bound_traces(self, written: Path | None = None) -> None:
        """Keep server.trace_dir within server.traces_max_mb: once a trace just `written` takes the folder past it,
        its oldest traces are deleted down to 90 % of it (so the folder is scanned once per tenth of the bound
        written, not per request); the traces still being written stay."""
        assert self.trace_dir is not None
        if written is not None:
            with contextlib.suppress(OSError):
                self._trace_bytes += written.stat().st_size
            if self._trace_bytes <= self._traces_max:
                return
        busy = {self._trace_path(a.job) for a in self.active if a.tracer is not None}
        self._trace_bytes, deleted = prune_oldest(self.trace_dir, "*.jsonl", self._traces_max * 9 // 10, busy)
        self.counters.traces_deleted += len(deleted)
        for f, size in deleted:
            if f == written:
                log.warning("trace %s (%d bytes) alone exceeds server.traces_max_mb: deleted", f, size)
