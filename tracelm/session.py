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
import ctypes
import ctypes.util
import functools
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from tracelm.io.attest.binding import parse_nonce
from tracelm.io.chat_template import RenderBudget, builtin_template_for, encode_chat, template_named
from tracelm.io.files import MiB, read_regular_text
from tracelm.io.grammar import closed as closed_schema
from tracelm.io.grammar import lark_of_gbnf, unspellable
from tracelm.io.loader import LoadedModel, ModelFile
from tracelm.io.registry import home, path_sha256
from tracelm.io.run_config import load_run_config, packaged_configs, positional_is_model
from tracelm.io.session_file import SUFFIX, SavedSession, check_session, config_dict, read_session, write_session
from tracelm.pipeline.bounds import check_run
from tracelm.pipeline.runner import (
    Generation,
    GenerationStats,
    Runner,
    check_fits,
    check_sampling,
    common_prefix,
    feed_together,
    speculation,
)
from tracelm.pipeline.trace import (
    Tracer,
    decode_rate,
    signature_fields,
    trace_key,
    trace_signer,
    write_footer,
    write_header,
)
from tracelm.stages.head import head
from tracelm.stages.pool import POOLINGS, pool
from tracelm.stages.sample import top_logprobs

# what the server, replay and the tools use of the engine, through the front door
__all__ = ["POOLINGS", "SUFFIX", "Generation", "GenerationStats", "MiB", "RenderBudget", "Runner", "Session",
           "ThreadLimits", "Tracer", "builtin_template_for", "chat_prompt", "check_sampling", "closed_schema",
           "decode_rate", "embedding", "encode_chat", "held_bytes", "lark_of_gbnf", "load_conversation", "numerics",
           "packaged_configs", "parse_nonce", "positional_is_model", "prompt_logprobs", "read_regular_text",
           "release_memory", "run_config", "save_conversation", "shift_chat", "signature_fields", "template_budget",
           "top_logprobs", "trace_key", "unspellable", "write_footer"]
from tracelm.state.errors import SessionIncompatible, TracelmError, shown
from tracelm.state.records import Hidden, SamplingParams
from tracelm.state.run_config import ACTIVATION_MODES, RunConfig

MAX_SESSION_NAME = 128  # characters of `tracelm chat --session NAME` (a file name: the system allows 255 bytes)

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
    if cfg.trace.key == "ephemeral" and cfg.trace.sign_key is not None:
        raise TracelmError("trace.key: ephemeral and trace.sign_key both name a signing key: keep one")
    if cfg.attest.provider != "off" and cfg.trace.key != "ephemeral":  # evidence binds a key made in the TEE
        if cfg.trace.sign_key is not None:
            raise TracelmError(f"attest.provider {cfg.attest.provider} binds an ephemeral key made in memory at start; "
                               "drop trace.sign_key (a key from a file could have been copied out of the TEE)")
        cfg = attrs.evolve(cfg, trace=attrs.evolve(cfg.trace, key="ephemeral"))
    return cfg if model is None else attrs.evolve(cfg, model=model)


def numerics(cfg: RunConfig) -> str:
    """What decides a run's numbers besides the model: the compute mode, on the kernels the activations, the type
    its float matrices are quantized to on load, and the KV cache's dtype ("kernels/int16/kv-f16"); a saved Cache
    is only resumed by a run with the same."""
    mode = f"{cfg.compute}/{cfg.activations}" if cfg.compute == "kernels" else cfg.compute
    quantized = f"/quantize-{cfg.quantize}" if cfg.quantize else ""  # the float matrices' blocks made on load
    return f"{mode}{quantized}/kv-{cfg.kv_cache}"


def as_configured(model: LoadedModel, cfg: RunConfig) -> LoadedModel:
    """The model as `cfg.activations` asks its quantized products to run (the same blocks, no copy), and with
    `cfg.chat_template` in its own template's place."""
    weights = model.weights.with_halves(ACTIVATION_MODES[cfg.activations])
    template = template_named(cfg.chat_template) if cfg.chat_template is not None else model.template_override
    if weights is model.weights and template == model.template_override:
        return model
    return attrs.evolve(model, weights=weights, template_override=template)


def held_bytes(runner: Runner) -> int:
    """The bytes of every numpy array a Runner holds -- its Cache's keys and values, RoPE tables, masks and pass
    buffers, and a draft model's runner's -- each buffer counted once however many views of it there are."""
    buffers: dict[int, int] = {}
    for a in _arrays(vars(runner.cache)):
        while isinstance(a.base, np.ndarray):
            a = a.base
        buffers[id(a)] = a.nbytes
    return sum(buffers.values()) + (held_bytes(runner.draft) if runner.draft is not None else 0)


def _arrays(x: Any) -> Iterator[np.ndarray]:
    """The numpy arrays in x, and in the lists, tuples and dict values inside it."""
    if isinstance(x, np.ndarray):
        yield x
    elif isinstance(x, dict):
        for value in list(x.values()):  # a copy: /health measures while the engine's thread works
            yield from _arrays(value)
    elif isinstance(x, list | tuple):
        for value in x:
            yield from _arrays(value)


@functools.cache
def _libc(name: str) -> Callable[..., int] | None:
    """A glibc function by name (malloc_trim, mallopt), None without glibc."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def release_memory() -> None:
    """Hand freed memory back to the OS (glibc's malloc_trim(0): the free pages of every malloc arena, not only
    the top of the heap); a no-op without glibc."""
    trim = _libc("malloc_trim")
    if trim is not None:
        trim(0)


def embedding(runner: Runner, ids: Sequence[int], pooling: str = "mean") -> np.ndarray:
    """The unit-length f32 embedding of `ids`: their final hidden states (after the output norm) pooled by
    `pooling` (mean or last, stages/pool.py), computed on `runner`'s Cache emptied first."""
    return pool(runner.hidden(ids), pooling)


def prompt_logprobs(runner: Runner, ids: Sequence[int], k: int, rows: int = 64
                    ) -> list[tuple[float, np.ndarray, np.ndarray]]:
    """Each prompt token's log-probability given the ones before it, from the second on (OpenAI's `echo` with
    `logprobs`): `top_logprobs` of position i's logits for token i + 1 with the k likeliest, computed on `runner`'s
    Cache emptied first. The head runs `rows` positions at a time, so a long prompt's logits are never all held
    ([T, vocab] f32 is 1.2 GB for 2,048 positions of Qwen's vocabulary)."""
    h, w = runner.hidden(ids), runner.model.weights.output
    out = []
    for a in range(0, len(ids) - 1, rows):
        b = min(a + rows, len(ids) - 1)
        logits = head(Hidden(h[a:b], a), w).values
        out += [top_logprobs(logits[j], int(ids[a + j + 1]), k) for j in range(b - a)]
    return out


def template_budget(cfg: RunConfig) -> RenderBudget:
    """What one rendering of a chat template may take under `cfg` (template_cpu_seconds, template_max_chars)."""
    return RenderBudget(cfg.template_cpu_seconds, cfg.template_max_chars)


def chat_prompt(model: LoadedModel, messages: list[dict[str, str]], budget: RenderBudget | None = None) -> list[int]:
    """The conversation's token ids, rendered with the model's chat template (or the built-in one for its
    vocabulary) under `budget`; control tokens spelled in the messages stay plain text."""
    return encode_chat(model.tokenizer, model.chat_template, messages, add_generation_prompt=True, budget=budget)


def chat_head(model: LoadedModel, messages: list[dict[str, str]], budget: RenderBudget | None = None) -> int:
    """How many leading tokens of the conversation's rendering a context shift keeps: what the template puts
    before the first user's words (the system prompt, the explicit one or the template's default, and the
    opening of a user turn), found as the common prefix of two renderings that differ in those words only."""
    system = [m for m in messages[:1] if m.get("role") == "system"]
    try:
        a, b = (encode_chat(model.tokenizer, model.chat_template, [*system, {"role": "user", "content": c}],
                            add_generation_prompt=False, budget=budget) for c in ("\x01", "\x02"))
    except TracelmError:
        return 0
    return common_prefix(a, b)


def context_shift(ids: list[int], head: int, keep: int) -> list[int]:
    """A conversation too long for the context, cut: its first `head` tokens and its latest ones, at most `keep`
    and more than keep - keep // 2. The cut falls a multiple of keep // 2 tokens past the head, so the next
    turns, which extend the same conversation, are cut at the same place until they outgrow it, and reuse the
    cached prefix."""
    body = len(ids) - head
    if body <= keep:
        return list(ids)
    step = max(1, keep // 2)
    cut = head + -(-(body - keep) // step) * step
    return [*ids[:head], *ids[cut:]]


def shift_chat(model: LoadedModel, cfg: RunConfig, messages: list[dict[str, str]], ids: list[int],
               max_tokens: int) -> list[int]:
    """The prompt of a chat turn under the config's context_policy: `ids` (the whole conversation) while it and
    max_tokens fit the context, or always with `stop`; with `shift`, the system prompt and the latest
    shift_keep tokens (half the context when 0; fewer when the reply's max_tokens would not fit after them) once
    they do not (see `context_shift`)."""
    if cfg.context_policy != "shift" or len(ids) + max_tokens <= cfg.context:
        return ids
    head = min(chat_head(model, messages, template_budget(cfg)), len(ids) - 1)
    keep = max(1, min(cfg.shift_keep or cfg.context // 2, cfg.context - head - max_tokens))
    return context_shift(ids, head, keep)


def save_conversation(path: str | os.PathLike, runner: Runner, model_sha256: str, compute: str, *,
                      kind: str = "chat", messages: list[dict[str, str]] | None = None, trace_hash: str | None = None,
                      session_id: str | None = None) -> int:
    """Write a session file of the runner's Cache and the conversation around it (tracelm/io/session_file.py),
    atomically; return its size in bytes."""
    saved = SavedSession(runner.cache.snapshot(), model_sha256, config_dict(runner.model.cfg), compute, kind,
                         messages, trace_hash, session_id, Path(runner.model.path).name)
    return write_session(path, saved)


def load_conversation(path: str | os.PathLike, runner: Runner, model_sha256: str, compute: str) -> SavedSession:
    """Read a session file, check it was made with this model, ModelConfig, tracelm version and compute mode,
    and restore its positions into the runner's Cache (a SessionFileError subclass naming the file and the
    reason otherwise: the Cache is then left as it was)."""
    saved = read_session(path)
    check_session(path, saved, model_sha256, runner.model.cfg, compute)
    try:
        runner.cache.restore(saved.snapshot)
    except TracelmError as e:
        raise SessionIncompatible(f"{path}: {e}; resume it with the context it was saved with") from None
    return saved


def _ephemeral_key() -> Any:
    from tracelm.io.trace_keys import ephemeral_key

    return ephemeral_key()


def session_path(name: str) -> Path:
    """Where `tracelm chat --session NAME` keeps a conversation: TRACELM_HOME/sessions/NAME.tlsession."""
    if (not name or len(name) > MAX_SESSION_NAME or name.startswith(".")
            or not all(c.isalnum() or c in "._-" for c in name)):
        raise TracelmError(f"--session {shown(name)}: a session name is letters, digits, '.', '_' and '-' (1 to "
                           f"{MAX_SESSION_NAME} of them), not starting with '.'")
    return home() / "sessions" / f"{name}{SUFFIX}"


class Session:
    """A model opened as a RunConfig says, with its thread limits, one conversation's Runner and Cache, chat
    history, and traces. The weights load on first use, so a prompt can be checked against the context
    (`encode`, `check`) before the expensive part."""

    def __init__(self, model: str | LoadedModel | None = None, config: str | os.PathLike | RunConfig | None = None,
                 *, settings: Iterable[str] = (), progress: bool = False, quantize: str | None = None):
        """`model`: a registry name or a path (a GGUF, a Hugging Face folder, a llama2.c .bin), `hf:ORG/REPO[:FILE
        or :QUANT]`, a name in the local Hugging Face or Ollama cache, or a model already loaded (shared by
        sessions; the caller's thread settings then stand); `config`: a YAML file, the name of a packaged config
        (`smollm2`) or a RunConfig; `settings`: overrides as `--set` takes them ("sampling.top_k=20"); `quantize`:
        the float matrices quantized as they load (q8_0, q4_0, q4_k, ...: the config key `quantize`)."""
        self.progress = progress
        self._model: LoadedModel | None = None
        self._runner: Runner | None = None
        if isinstance(model, LoadedModel):
            self.cfg = run_config(None if config is not None else str(model.path), config, settings)
            self._model, self.path, self.tokenizer = as_configured(model, self.cfg), model.path, model.tokenizer
            self.limits: ThreadLimits | None = None
        else:
            self.cfg = run_config(model, config, settings)
            if quantize is not None:
                try:
                    self.cfg = attrs.evolve(self.cfg, quantize=quantize)
                except ValueError as e:
                    raise TracelmError(f"quantize: {e}") from None
            self.limits = ThreadLimits(self.cfg.threads, self.cfg.compute)
            self.source = ModelFile(self.cfg.model, self.cfg.tokenizer)
            self.path, self.tokenizer = self.source.path, self.source.tokenizer
            check_run(self.source.cfg, self.cfg.context, self.cfg.rope_scale,  # before any weight is allocated
                      self.source.weights_bytes(self.cfg.weights, self.cfg.compute, self.cfg.quantize), self.path.name,
                      self.cfg.kv_cache)
        if self.cfg.chat_template is not None:
            template_named(self.cfg.chat_template)  # a name it does not know: said now, before the weights load
        self.messages: list[dict[str, str]] = self._new_conversation()
        self.trace_chain: str | None = None  # the last line hash of this conversation's latest trace
        self.last_trace_hash: str | None = None  # ... of the last call's trace (None: it wrote none)
        self.shifted = 0  # tokens of the conversation the last chat turn's context shift left out
        self._sha256: str | None = None
        # trace.key: ephemeral: the key that signs every trace of this session, made now in memory, never written
        self.signer = _ephemeral_key() if self.cfg.trace.key == "ephemeral" else None
        self.started_ms = int(time.time() * 1000)
        self._start_attestation: dict[str, Any] | None = None
        self._attest_lock = threading.Lock()

    @property
    def model(self) -> LoadedModel:
        if self._model is None:
            self._model = as_configured(self.source.load(self.progress, self.cfg.weights, self.cfg.compute,
                                                            self.cfg.rope_scale, self.cfg.quantize), self.cfg)
        return self._model

    @property
    def model_sha256(self) -> str:
        """sha256 of the model's bytes (as a trace header has it; cached by size and mtime in TRACELM_HOME)."""
        if self._sha256 is None:
            self._sha256 = path_sha256(self.path)
        return self._sha256

    def attestation(self, nonce: bytes | None = None) -> dict[str, Any]:
        """The attestation document of this session's ephemeral key ({"binding", "evidence"}: docs/trust.md): with
        `nonce`, fresh evidence over it (GET /v1/attestation); without, the evidence made at start over the start
        time (every trace header carries it), made once."""
        if self.cfg.attest.provider == "off" or self.signer is None:
            raise TracelmError("this run attests nothing: start it with --attest tpm|tsm (attest.provider)")
        if nonce is not None:
            return self._attest(nonce)
        with self._attest_lock:
            if self._start_attestation is None:
                from tracelm.io.attest.binding import start_nonce

                self._start_attestation = self._attest(start_nonce(self.started_ms))
            return self._start_attestation

    def _attest(self, nonce: bytes) -> dict[str, Any]:
        from tracelm.io.attest.binding import Binding
        from tracelm.io.attest.provider import evidence
        from tracelm.io.trace_keys import public_raw
        from tracelm.version import __version__

        binding = Binding(public_raw(self.signer.public_key()), __version__, self.model_sha256, nonce)
        return {"binding": binding.as_dict(), "evidence": evidence(self.cfg.attest, binding.report_data())}

    @property
    def runner(self) -> Runner:
        """The conversation's Runner (its Cache), made on first use."""
        if self._runner is None:
            self._runner = self.new_runner()
        return self._runner

    def new_runner(self, context: int | None = None) -> Runner:
        """Another Runner on this session's model (its own Cache of `context` positions, the config's by
        default, and the config's speculation): one per sequence when several are decoded together."""
        return Runner(self.model, context or self.cfg.context, **speculation(self.cfg), kv_dtype=self.cfg.kv_cache)

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

    def check_sampling(self, sampling: SamplingParams) -> None:
        """A TracelmError naming the problem unless `sampling` can run on this model: its logit_bias ids are in the
        vocabulary and its constraint compiles against it (the tokenizer only: the weights need not be loaded)."""
        check_sampling(sampling, self.tokenizer)

    def stream(self, prompt: str | Sequence[int], *, max_tokens: int | None = None, stop: Sequence[str] | None = None,
               trace: str | os.PathLike | Tracer | None = None, trace_key_env: str | None = None,
               trace_continues: str | None = None, cancel: Callable[[], bool] | None = None,
               **sampling: Any) -> Iterator[str]:
        """Text as it is decoded from `prompt` (text, or token ids as they are). Keyword arguments override
        the config: max_tokens, stop, any SamplingParams field (temperature, top_k, top_p, min_p, seed, logit_bias,
        constraint: a Constraint or a mapping of its fields),
        and `trace`, a file that gets this call's trace (the config's trace.file when not given), signed
        with the key in the environment variable `trace_key_env`, whose header names `trace_continues` (the last
        hash of the trace it follows; `last_trace_hash` is then this one's); or an open Tracer that records the
        call's events only (replay's comparer). `cancel()`, asked before each token, ends the call early when True
        (a traced one's footer then says `status: interrupted`, as after a KeyboardInterrupt)."""
        ids = self.encode(prompt) if isinstance(prompt, str) else [int(i) for i in prompt]
        max_tokens = self.cfg.max_tokens if max_tokens is None else max_tokens
        self.check(len(ids), max_tokens)
        try:
            params = attrs.evolve(self.cfg.sampling, **sampling)
        except (TypeError, ValueError) as e:
            raise TracelmError(f"sampling: {e}") from None
        self.check_sampling(params)
        stop = self.cfg.stop if stop is None else tuple(stop)
        text = prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)
        try:
            cfg = attrs.evolve(self.cfg, prompt=text, max_tokens=max_tokens, stop=stop, sampling=params)
        except (TypeError, ValueError) as e:
            raise TracelmError(str(e)) from None
        if isinstance(trace, Tracer):
            yield from self.runner.generate(ids, max_tokens, params, stop, tracer=trace, cancel=cancel)
            return
        self.last_trace_hash = None
        with self.open_trace(ids, trace, trace_key_env, cfg, continues=trace_continues) as tracer:
            out = []
            pieces = self.runner.generate(ids, max_tokens, params, stop, tracer=tracer, cancel=cancel)
            try:
                for piece in pieces:
                    out.append(piece)
                    yield piece
            except (KeyboardInterrupt, GeneratorExit):  # Ctrl-C, or the caller closed the stream (chat's Ctrl-C)
                pieces.close()  # the statistics and the Cache as far as it got
                if tracer is not None:  # the events up to the interruption, closed by a footer that says so
                    write_footer(tracer, self.runner.stats, "".join(out), status="interrupted")
                raise
            if tracer is not None:
                cancelled = cancel is not None and self.runner.stats.finish_reason == "cancelled"
                write_footer(tracer, self.runner.stats, "".join(out), status="interrupted" if cancelled else "complete")
                self.last_trace_hash = tracer.prev

    def generate(self, prompt: str | Sequence[int], **kwargs: Any) -> str:
        """The whole text `stream` yields."""
        return "".join(self.stream(prompt, **kwargs))

    def logits(self, prompt: str | Sequence[int]) -> Any:
        """f32 logits [T, vocab] of every position of `prompt` (text, or token ids), computed in one pass on a
        fresh Cache of exactly T positions (the conversation's is left as it is)."""
        ids = self.encode(prompt) if isinstance(prompt, str) else [int(i) for i in prompt]
        check_fits(len(ids), 0, max(len(ids), 1))
        return Runner(self.model, len(ids)).logits(ids)

    def embed(self, text: str | Sequence[int], pooling: str = "mean") -> np.ndarray:
        """The unit-length f32 [n_embd] embedding of `text` (or token ids as they are): its positions' final hidden
        states, after the output norm, pooled by `pooling` ("mean" or "last"), computed on a fresh Cache of exactly
        its length (the conversation's is left as it is). No token is sampled."""
        if pooling not in POOLINGS:
            raise TracelmError(f"pooling: expected one of {', '.join(POOLINGS)}, got {pooling!r}")
        ids = self.encode(text) if isinstance(text, str) else [int(i) for i in text]
        check_fits(len(ids), 0, max(len(ids), 1))
        return embedding(Runner(self.model, len(ids)), ids, pooling)

    def chat_stream(self, message: str, **kwargs: Any) -> Iterator[str]:
        """The reply to `message` as the next user turn of this session's conversation, rendered with the
        model's chat template, as it is decoded; the reply joins the conversation. Keyword arguments as
        `stream`'s; max_tokens is cut to the room left in the context. When the conversation and max_tokens
        outgrow the context, `context_policy: shift` keeps its system prompt and latest tokens (`shift_chat`;
        `shifted` says how many it left out); `stop` cuts the reply short, and refuses a turn with no room. A
        traced turn's header names the last hash of the conversation's previous trace (`trace_chain`)."""
        self.messages.append({"role": "user", "content": message})
        full = chat_prompt(self.model, self.messages, template_budget(self.cfg))
        asked = kwargs.get("max_tokens")
        asked = self.cfg.max_tokens if asked is None else asked
        ids = shift_chat(self.model, self.cfg, self.messages, full, asked)
        self.shifted = len(full) - len(ids)
        room = self.cfg.context - len(ids)
        if room <= 0:
            self.messages.pop()
            raise TracelmError(f"the conversation ({len(ids)} tokens) no longer fits the context of "
                               f"{self.cfg.context}; raise 'context', set context_policy: shift, or start over")
        kwargs["max_tokens"] = min(asked, room)
        reply = []
        for piece in self.stream(ids, trace_continues=self.trace_chain, **kwargs):
            reply.append(piece)
            yield piece
        self.messages.append({"role": "assistant", "content": "".join(reply).strip()})
        self.trace_chain = self.last_trace_hash or self.trace_chain

    def chat(self, message: str, **kwargs: Any) -> str:
        """The whole reply `chat_stream` yields."""
        return "".join(self.chat_stream(message, **kwargs))

    def reset(self) -> None:
        """Start a new conversation (the system prompt of the config only)."""
        self.messages = self._new_conversation()
        self.trace_chain = None

    def save(self, path: str | os.PathLike) -> int:
        """Save this conversation to a session file (tracelm/io/session_file.py), atomically: its Cache (the
        keys and values of the positions held), the messages, the trace chain, the model's sha256 and
        ModelConfig, the tracelm version and compute mode. Returns the file's size in bytes."""
        return save_conversation(path, self.runner, self.model_sha256, numerics(self.cfg), messages=self.messages,
                                 trace_hash=self.trace_chain)

    def load(self, path: str | os.PathLike) -> None:
        """Resume the conversation saved in `path` (`save`): its messages, trace chain and Cache, whose next
        logits are those of recomputing the whole conversation, bit for bit. A file of another model or
        ModelConfig, another tracelm version or compute mode, a truncated or a tampered one is refused with its
        named error (tracelm.state.errors: SessionModelMismatch, SessionIncompatible, SessionFileTruncated,
        SessionFileTampered); the session is then left as it was."""
        saved = load_conversation(path, self.runner, self.model_sha256, numerics(self.cfg))
        self.messages = [dict(m) for m in saved.messages or []]
        self.trace_chain = saved.trace_hash

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
                   cfg: RunConfig | None = None, continues: str | None = None) -> Iterator[Tracer | None]:
        """A Tracer writing `path` (or the config's trace file; None when neither asks for a trace): the header
        of a call on prompt `ids` configured as `cfg` (the session's config by default) now, the events as they
        come, open until the block ends. An interrupted call leaves every event up to the interruption; the
        footer is the caller's (`write_footer`)."""
        cfg = self.cfg if cfg is None else cfg
        if path is not None:
            level = cfg.trace.level if cfg.trace.level != "off" else "digest"
            cfg = attrs.evolve(cfg, trace=attrs.evolve(cfg.trace, level=level, file=str(path)))
        if cfg.trace.level == "off" or not cfg.trace.file:
            yield None
            return
        key = trace_key(key_env) if key_env else None
        signer = self.signer or trace_signer(cfg.trace.sign_key)
        attestation = self.attestation() if cfg.attest.provider != "off" else None
        try:
            stream = open(Path(cfg.trace.file), "wb")  # noqa: SIM115  (the Tracer writes UTF-8)
        except OSError as e:
            raise TracelmError(f"{cfg.trace.file}: cannot write trace: {e.strerror}") from None
        with stream:
            tracer = Tracer(stream, cfg.trace.level, key=key, signer=signer)
            write_header(tracer, cfg, self.model, ids, continues, attestation)
            try:
                yield tracer
            finally:
                tracer.flush()
                tracer.close()
