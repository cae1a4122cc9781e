"""The front door: a Session opens a model as a run config says and runs it -- prompts, chats, streams, each
traced to a file when asked. The CLI and Python users start here instead of wiring the loader, the
runner, the tracer and the thread limits by hand.

    from tracelm import Session
    s = Session("smollm2-135m-instruct")
    print(s.chat("Hi"))
    for piece in s.stream("Once upon a time", max_tokens=32, temperature=0.8, seed=1):
        print(piece, end="")
    s.generate("The capital of France is", temperature=0, trace="run.jsonl")   # a replayable trace

A Session holds one conversation's Cache: a prompt that starts like the previous one reuses its keys and
values. Settings come in layers: the built-in defaults (RunConfig), a YAML config, `key=value` overrides,
then the keyword arguments of a call (sampling fields, max_tokens, stop, trace).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs

from tracelm.io.chat_template import encode_chat
from tracelm.io.loader import LoadedModel, ModelFile
from tracelm.io.run_config import load_run_config
from tracelm.pipeline.runner import Generation, GenerationStats, Runner, check_fits, feed_together, speculation
from tracelm.pipeline.trace import Tracer, trace_key, write_footer, write_header
from tracelm.stages.sample import top_logprobs

# what the server, replay and the tools use of the engine, through the front door
__all__ = ["Generation", "GenerationStats", "Runner", "Session", "ThreadLimits", "Tracer", "chat_prompt",
           "run_config", "top_logprobs", "trace_key", "write_footer"]
from tracelm.state.errors import TracelmError
from tracelm.state.run_config import ACTIVATION_MODES, RunConfig, TraceOptions


class ThreadLimits:
    """Threads for a run, applied now, put back by `restore()` (or on leaving a with-block): on the kernels n
    threads (0: every CPU) in their pool and numexpr, and OpenBLAS at one thread so its workers never compete
    with the pool; on the reference n threads for BLAS and numexpr (0 keeps their defaults)."""

    def __init__(self, n: int, compute: str = "kernels"):
        import numexpr
        from threadpoolctl import threadpool_limits

        import tracelm.kernels as kernels

        self._kernels, self._blas, self._numexpr = kernels.threads(), None, None
        if compute == "kernels":
            n = n if n > 0 else kernels.default_threads()
            kernels.set_threads(n)
            self._blas = threadpool_limits(limits=1, user_api="blas")
        elif n > 0:
            self._blas = threadpool_limits(limits=n)
        if n > 0:
            self._numexpr = numexpr.set_num_threads(n)

    def restore(self) -> None:
        import numexpr

        import tracelm.kernels as kernels

        kernels.set_threads(self._kernels)
        if self._blas is not None:
            self._blas.restore_original_limits()
        if self._numexpr is not None:
            numexpr.set_num_threads(self._numexpr)

    def __enter__(self) -> ThreadLimits:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()


def run_config(model: str | None = None, config: str | os.PathLike | RunConfig | None = None,
               settings: Iterable[str] = ()) -> RunConfig:
    """Defaults < the config (a YAML path or a RunConfig) < `key=value` settings < `model` when given."""
    if isinstance(config, RunConfig):
        cfg = config
        if settings:
            raise TracelmError("settings apply to a config file; evolve a RunConfig with attrs.evolve instead")
    else:
        cfg = load_run_config(config, settings)
    if cfg.trace.file and cfg.trace.level == "off":  # a trace file alone means the digest level
        cfg = attrs.evolve(cfg, trace=attrs.evolve(cfg.trace, level="digest"))
    return cfg if model is None else attrs.evolve(cfg, model=model)


def with_activations(model: LoadedModel, cfg: RunConfig) -> LoadedModel:
    """The model as `cfg.activations` asks its quantized products to run (the same blocks, no copy)."""
    weights = model.weights.with_halves(ACTIVATION_MODES[cfg.activations])
    return model if weights is model.weights else attrs.evolve(model, weights=weights)


def chat_prompt(model: LoadedModel, messages: list[dict[str, str]]) -> list[int]:
    """The conversation's token ids, rendered with the model's chat template (or the built-in one for its
    vocabulary); control tokens spelled in the messages stay plain text."""
    return encode_chat(model.tokenizer, model.chat_template, messages, add_generation_prompt=True)


class Session:
    """A model opened as a RunConfig says, with its thread limits, one conversation's Runner and Cache, chat
    history, and traces. The weights load on first use, so a prompt can be checked against the context
    (`encode`, `check`) before the expensive part."""

    def __init__(self, model: str | LoadedModel | None = None, config: str | os.PathLike | RunConfig | None = None,
                 *, settings: Iterable[str] = (), progress: bool = False):
        """`model`: a registry name or a path (a GGUF, a Hugging Face folder, a llama2.c .bin), or a model
        already loaded (shared by sessions; the caller's thread settings then stand); `config`: a YAML file,
        the name of a packaged config (`smollm2`) or a RunConfig; `settings`: overrides as `--set` takes them
        ("sampling.top_k=20")."""
        self.progress = progress
        self._model: LoadedModel | None = None
        self._runner: Runner | None = None
        if isinstance(model, LoadedModel):
            self.cfg = run_config(None if config is not None else str(model.path), config, settings)
            self._model, self.path, self.tokenizer = with_activations(model, self.cfg), model.path, model.tokenizer
            self.limits: ThreadLimits | None = None
        else:
            self.cfg = run_config(model, config, settings)
            self.limits = ThreadLimits(self.cfg.threads, self.cfg.compute)
            self.source = ModelFile(self.cfg.model, self.cfg.tokenizer)
            self.path, self.tokenizer = self.source.path, self.source.tokenizer
        self.messages: list[dict[str, str]] = self._new_conversation()

    @property
    def model(self) -> LoadedModel:
        if self._model is None:
            self._model = with_activations(self.source.load(self.progress, self.cfg.weights, self.cfg.compute),
                                           self.cfg)
        return self._model

    @property
    def runner(self) -> Runner:
        """The conversation's Runner (its Cache), made on first use."""
        if self._runner is None:
            self._runner = self.new_runner()
        return self._runner

    def new_runner(self, context: int | None = None) -> Runner:
        """Another Runner on this session's model (its own Cache of `context` positions, the config's by
        default, and the config's speculation): one per sequence when several are decoded together."""
        return Runner(self.model, context or self.cfg.context, **speculation(self.cfg))

    @staticmethod
    def feed(generations: Sequence[Generation]) -> None:
        """One forward pass computing what each of `generations` (of runners of this session) waits for."""
        feed_together(generations)

    @property
    def stats(self) -> GenerationStats:
        """The last call's statistics (prompt, reused and generated tokens, times, finish reason, drafts)."""
        return self.runner.stats

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def check(self, n_prompt: int, max_tokens: int | None = None) -> None:
        """A TracelmError unless a prompt of n_prompt tokens plus max_tokens fits the context."""
        check_fits(n_prompt, self.cfg.max_tokens if max_tokens is None else max_tokens, self.cfg.context)

    def stream(self, prompt: str | Sequence[int], *, max_tokens: int | None = None, stop: Sequence[str] | None = None,
               trace: str | os.PathLike | Tracer | None = None, trace_key_env: str | None = None,
               **sampling: Any) -> Iterator[str]:
        """Text as it is decoded from `prompt` (text, or token ids as they are). Keyword arguments override
        the config: max_tokens, stop, any SamplingParams field (temperature, top_k, top_p, min_p, seed...),
        and `trace`, a file that gets this call's trace (the config's trace.file when not given), signed
        with the key in the environment variable `trace_key_env`; or an open Tracer that records the call's
        events only (replay's comparer)."""
        ids = self.encode(prompt) if isinstance(prompt, str) else [int(i) for i in prompt]
        max_tokens = self.cfg.max_tokens if max_tokens is None else max_tokens
        self.check(len(ids), max_tokens)
        try:
            params = attrs.evolve(self.cfg.sampling, **sampling)
        except (TypeError, ValueError) as e:
            raise TracelmError(f"sampling: {e}") from None
        stop = self.cfg.stop if stop is None else tuple(stop)
        text = prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)
        cfg = attrs.evolve(self.cfg, prompt=text, max_tokens=max_tokens, stop=stop, sampling=params)
        if isinstance(trace, Tracer):
            yield from self.runner.generate(ids, max_tokens, params, stop, tracer=trace)
            return
        with self.open_trace(ids, trace, trace_key_env, cfg) as tracer:
            out = []
            for piece in self.runner.generate(ids, max_tokens, params, stop, tracer=tracer):
                out.append(piece)
                yield piece
            if tracer is not None:
                write_footer(tracer, self.runner.stats, "".join(out))

    def generate(self, prompt: str | Sequence[int], **kwargs: Any) -> str:
        """The whole text `stream` yields."""
        return "".join(self.stream(prompt, **kwargs))

    def logits(self, prompt: str | Sequence[int]) -> Any:
        """f32 logits [T, vocab] of every position of `prompt` (text, or token ids), computed in one pass on a
        fresh Cache of exactly T positions (the conversation's is left as it is)."""
        ids = self.encode(prompt) if isinstance(prompt, str) else [int(i) for i in prompt]
        check_fits(len(ids), 0, max(len(ids), 1))
        return Runner(self.model, len(ids)).logits(ids)

    def chat_stream(self, message: str, **kwargs: Any) -> Iterator[str]:
        """The reply to `message` as the next user turn of this session's conversation, rendered with the
        model's chat template, as it is decoded; the reply joins the conversation. Keyword arguments as
        `stream`'s; max_tokens is cut to the room left in the context."""
        self.messages.append({"role": "user", "content": message})
        ids = chat_prompt(self.model, self.messages)
        room = self.cfg.context - len(ids)
        if room <= 0:
            self.messages.pop()
            raise TracelmError(f"the conversation ({len(ids)} tokens) no longer fits the context of "
                               f"{self.cfg.context}; raise 'context' or start over")
        asked = kwargs.get("max_tokens")
        kwargs["max_tokens"] = min(self.cfg.max_tokens if asked is None else asked, room)
        reply = []
        for piece in self.stream(ids, **kwargs):
            reply.append(piece)
            yield piece
        self.messages.append({"role": "assistant", "content": "".join(reply).strip()})

    def chat(self, message: str, **kwargs: Any) -> str:
        """The whole reply `chat_stream` yields."""
        return "".join(self.chat_stream(message, **kwargs))

    def reset(self) -> None:
        """Start a new conversation (the system prompt of the config only)."""
        self.messages = self._new_conversation()

    def close(self) -> None:
        """Put back the thread limits the session set."""
        if self.limits is not None:
            self.limits.restore()
            self.limits = None

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _new_conversation(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.cfg.system}] if self.cfg.system else []

    @contextlib.contextmanager
    def open_trace(self, ids: list[int], path: str | os.PathLike | None = None, key_env: str | None = None,
                   cfg: RunConfig | None = None) -> Iterator[Tracer | None]:
        """A Tracer writing `path` (or the config's trace file; None when neither asks for a trace): the header
        of a call on prompt `ids` configured as `cfg` (the session's config by default) now, the events as they
        come, open until the block ends. An interrupted call leaves every event up to the interruption; the
        footer is the caller's (`write_footer`)."""
        cfg = self.cfg if cfg is None else cfg
        if path is not None:
            level = cfg.trace.level if cfg.trace.level != "off" else "digest"
            cfg = attrs.evolve(cfg, trace=TraceOptions(level=level, file=str(path)))
        if cfg.trace.level == "off" or not cfg.trace.file:
            yield None
            return
        key = trace_key(key_env) if key_env else None
        try:
            stream = open(Path(cfg.trace.file), "w", encoding="utf-8")  # noqa: SIM115
        except OSError as e:
            raise TracelmError(f"{cfg.trace.file}: cannot write trace: {e.strerror}") from None
        with stream:
            tracer = Tracer(stream, cfg.trace.level, key=key)
            write_header(tracer, cfg, self.model, ids)
            try:
                yield tracer
            finally:
                tracer.flush()
