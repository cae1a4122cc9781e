"""The engine: one model, one worker thread, requests served one at a time in arrival order.

numpy/BLAS work never runs on the event loop: `Engine.submit` admits a `Job` into a bounded queue (or
refuses it at once: the caller answers 429), the worker thread runs it on a `Runner` -- the session's, or
a scratch one emptied first -- and posts what happens back to the job's asyncio queue: `("start",)`,
`("piece", text, logprobs)` per piece of text, then `("done", result)` or `("error", ApiError)`.

A job ends early when its client is gone (`Job.gone`) or its time limit passes: the runner asks before
every token, so generation stops within one token of either.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from tracelm import TracelmError
from tracelm.io.loader import LoadedModel
from tracelm.pipeline.runner import Runner, speculation
from tracelm.server.params import ApiError
from tracelm.server.sessions import SessionStore
from tracelm.stages.sample import top_logprobs
from tracelm.state.records import Choice, SamplingParams
from tracelm.state.run_config import RunConfig, TraceOptions

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
    events: asyncio.Queue = attrs.Factory(asyncio.Queue)
    gone: threading.Event = attrs.Factory(threading.Event)  # the client went away

    def post(self, *event: Any) -> None:
        """From the worker thread: hand an event to the request's coroutine."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server is shutting down
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)


@attrs.define
class Counters:
    served: int = 0
    cancelled: int = 0  # client gone before or during generation
    timed_out: int = 0
    rejected: int = 0  # 429
    failed: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    generated_tokens: int = 0


class Engine:
    def __init__(self, model: LoadedModel, cfg: RunConfig):
        self.model = model
        self.cfg = cfg
        # for requests without a session; emptied before each
        self.scratch = Runner(model, cfg.context, **speculation(cfg))
        opts = cfg.server
        self.sessions = SessionStore(lambda: Runner(model, cfg.context, **speculation(cfg)), opts.max_sessions,
                                     opts.session_memory_mb << 20, self.scratch.cache.nbytes)
        self.trace_dir = Path(opts.trace_dir) if opts.trace_dir else None
        self.trace_level = cfg.trace.level if cfg.trace.level != "off" else "digest"
        if self.trace_dir is not None:
            try:
                self.trace_dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise TracelmError(f"server.trace_dir {opts.trace_dir}: cannot create: {e.strerror}") from None
        self.counters = Counters()
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._outstanding = 0  # admitted and not finished: the running job plus those waiting
        self._limit = opts.queue_size + 1
        self._mean_seconds = 1.0  # running mean of a job's time, for Retry-After
        self.running: Job | None = None
        self._thread = threading.Thread(target=self._work, name="tracelm-engine", daemon=True)

    # -- the event loop's side ---------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        running = self.running
        if running is not None:
            running.gone.set()
        self._jobs.put(None)
        self._thread.join(timeout)

    @property
    def queued(self) -> int:
        return self._jobs.qsize()

    def submit(self, job: Job) -> None:
        """Admit a job in arrival order, or raise QueueFull at once."""
        with self._lock:
            if self._outstanding >= self._limit:
                self.counters.rejected += 1
                raise QueueFull(max(1, round(self._mean_seconds * self._outstanding)))
            self._outstanding += 1
        self._jobs.put(job)

    # -- the worker thread -------------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            t0 = time.monotonic()
            self.running = job
            try:
                self._serve(job)
            except ApiError as e:
                job.post("error", e)
            except TracelmError as e:  # a user-caused error the checks before admission did not catch
                if job.session_id is not None:
                    self.sessions.drop(job.session_id)
                job.post("error", ApiError(400, str(e)))
            except Exception:  # never let one request take the worker down; the client gets a plain 500
                self.counters.failed += 1
                log.exception("request %s failed", job.request_id)
                if job.session_id is not None:
                    self.sessions.drop(job.session_id)  # its Cache may be half-written
                job.post("error", ApiError(500, "internal error while generating; see the server log"))
            finally:
                self.running = None
                with self._lock:
                    self._outstanding -= 1
                    self._mean_seconds = 0.8 * self._mean_seconds + 0.2 * (time.monotonic() - t0)

    def _serve(self, job: Job) -> None:
        if job.gone.is_set():
            self.counters.cancelled += 1
            return
        if time.monotonic() > job.deadline:
            self.counters.timed_out += 1
            raise ApiError(503, "the request waited in the queue past its time limit (server.request_timeout)",
                           headers={"Retry-After": "1"})
        if job.session_id is not None:
            try:
                runner = self.sessions.get(job.session_id)
            except TracelmError as e:
                raise ApiError(400, str(e), param="session_id") from None
        else:
            runner = self.scratch
            runner.cache.reset()  # a request without a session sees nothing of the one before
        job.post("start")
        tok = self.model.tokenizer
        pending: list[dict[str, Any]] = []

        def cancel() -> bool:
            return job.gone.is_set() or time.monotonic() > job.deadline

        def on_token(choice: Choice, logits: np.ndarray) -> None:
            if job.logprobs is not None and choice.token not in tok.eog_ids:
                lp, ids, lps = top_logprobs(logits, choice.token, job.logprobs)
                pending.append({"id": choice.token, "logprob": lp, "top": list(zip(ids.tolist(), lps.tolist(),
                                                                                    strict=True))})

        with self._trace(job, runner) as tracer:
            for piece in runner.generate(job.prompt_ids, job.max_tokens, job.sampling, job.stop, cancel=cancel,
                                         on_token=on_token if job.logprobs is not None else None):
                job.post("piece", piece, pending[:])
                pending.clear()
            stats = runner.stats
            if tracer is not None:
                from tracelm.pipeline.trace import write_footer

                write_footer(tracer, stats)
        finish = stats.finish_reason
        if finish == "cancelled":
            if job.gone.is_set():
                self.counters.cancelled += 1
            else:  # the time limit: what was generated is returned, cut short as by max_tokens
                self.counters.timed_out += 1
                finish = "length"
        self.counters.served += 1
        self.counters.prompt_tokens += stats.n_prompt
        self.counters.reused_tokens += stats.n_reused
        self.counters.generated_tokens += stats.n_generated
        job.post("done", {"finish_reason": finish, "prompt_tokens": stats.n_prompt, "cached_tokens": stats.n_reused,
                          "completion_tokens": stats.n_generated})

    @contextlib.contextmanager
    def _trace(self, job: Job, runner: Runner) -> Iterator[Any]:
        """The request's own trace file when server.trace_dir is set; the runner writes into it meanwhile."""
        if self.trace_dir is None:
            yield None
            return
        from tracelm.pipeline.trace import Tracer, write_header

        path = self.trace_dir / f"{job.request_id}.jsonl"
        cfg = attrs.evolve(self.cfg, prompt=job.prompt_text, max_tokens=job.max_tokens, stop=job.stop,
                           sampling=job.sampling, trace=TraceOptions(level=self.trace_level, file=str(path)))
        with open(path, "w", encoding="utf-8") as stream:
            tracer = Tracer(stream, self.trace_level)
            write_header(tracer, cfg, self.model, job.prompt_ids)
            tracer.event("request", request_id=job.request_id, session_id=job.session_id)
            runner.tracer = tracer
            try:
                yield tracer
            finally:
                runner.tracer = None

