"""The runner: prefill a prompt in one batched pass, then decode one token at a time, streaming text."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import numpy as np

from tracelm.io.grammar import Matcher, mask_digest
from tracelm.io.loader import LoadedModel, load_model
from tracelm.pipeline.bounds import check_context, check_memory
from tracelm.pipeline.finite import check_logits
from tracelm.pipeline.graph import Part, forward, forward_batch, new_cache, plain_call
from tracelm.pipeline.speculative import lookup_draft, model_draft
from tracelm.pipeline.trace import Tracer
from tracelm.stages.constrain import constrain
from tracelm.stages.sample import sample
from tracelm.state.cache import RING_SLACK
from tracelm.state.errors import TracelmError
from tracelm.state.records import Choice, Logits, SamplingParams


@attrs.define
class GenerationStats:
    n_prompt: int = 0  # prompt tokens
    n_reused: int = 0  # prompt tokens whose keys/values were already in the Cache
    n_generated: int = 0
    finish_reason: str = ""  # "stop" (end-of-generation token or stop string), "length" or "cancelled"
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    tokens: list[int] = attrs.Factory(list)
    n_passes: int = 0  # decode forward passes (with speculation one pass can yield several tokens)
    n_drafted: int = 0  # draft tokens fed ahead of being sampled
    n_accepted: int = 0  # draft tokens the sampler then chose
    constrain_seconds: float = 0.0  # of decode_seconds: the grammar's masks, applying them, advancing it
    stop_word: str = ""  # the stop string that ended the generation ("" for any other end)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


def stop_at(text: str, at: int, stops: Sequence[str]) -> str:
    """The stop string stop_split found at `at` in `text` (the first of `stops` that begins there)."""
    return next(s for s in stops if text.startswith(s, at))


def stop_split(text: str, stops: Sequence[str]) -> tuple[str, str, bool]:
    """Split pending text into (safe to emit, held back, stopped).

    Stopped: text up to the first stop string is safe, the rest dropped. Otherwise the longest tail
    that could begin a stop string is held back until more text decides it.
    """
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    if hits:
        return text[: min(hits)], "", True
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:n]):
                hold = n
                break
    return text[: len(text) - hold], text[len(text) - hold :], False


def check_fits(n_prompt: int, max_tokens: int, n_ctx: int) -> None:
    """A prompt plus the tokens to generate must fit the context: checked before any work."""
    if n_prompt == 0:
        raise TracelmError("empty prompt: nothing to condition on (give at least one token)")
    if n_prompt + max_tokens > n_ctx:
        raise TracelmError(f"prompt of {n_prompt} tokens + max_tokens {max_tokens} exceeds the context of "
                           f"{n_ctx} positions")


def check_sampling(sampling: SamplingParams, tokenizer: Any) -> Matcher | None:
    """TracelmError unless every logit_bias id is in the vocabulary and the constraint compiles against it; the
    constraint's Matcher at the start of its grammar (None without one)."""
    for i, _bias in sampling.logit_bias:
        if i >= tokenizer.n_vocab:
            raise TracelmError(f"sampling.logit_bias: token id {i} is outside the vocabulary "
                               f"(0..{tokenizer.n_vocab - 1})")
    return Matcher(sampling.constraint, tokenizer) if sampling.constraint is not None else None


def speculation(cfg: Any) -> dict[str, Any]:
    """Runner keyword arguments for a RunConfig's `speculative` section (the draft model loaded once)."""
    spec = cfg.speculative
    draft = draft_model(spec.draft_model, cfg.compute) if spec.draft_model and spec.draft_tokens else None
    return {"draft_tokens": spec.draft_tokens, "draft_ngram": spec.ngram, "draft_model": draft}


@functools.lru_cache(maxsize=2)
def draft_model(name_or_path: str, compute: str = "kernels") -> LoadedModel:
    return load_model(name_or_path, progress=False, compute=compute)


def check_same_vocabulary(model: LoadedModel, draft: LoadedModel) -> None:
    """A draft model must spell every token id as the model does: its guesses are ids of the model's vocabulary."""
    a, b = model.tokenizer, draft.tokenizer
    same = a.n_vocab == b.n_vocab and all(a.token_bytes(i) == b.token_bytes(i) for i in range(a.n_vocab))
    if not same:
        raise TracelmError(f"draft model {draft.path.name} has another vocabulary than {model.path.name} "
                           f"({b.n_vocab} vs {a.n_vocab} tokens, or tokens spelled differently): it cannot draft")


class Runner:
    """A model and one Cache (one conversation). Later calls reuse the cached common prefix."""

    def __init__(self, model: LoadedModel, n_ctx: int, draft_tokens: int = 0, draft_ngram: int = 8,
                 draft_model: LoadedModel | None = None, kv_dtype: str = "f16"):
        self.model = model
        slack = max(RING_SLACK, draft_tokens)  # a KV ring takes back guesses
        check_context(model.cfg, n_ctx, model.rope_scale, model.path.name)
        check_memory(model.cfg, n_ctx, slack=slack, kv_dtype=kv_dtype)
        self.cache = new_cache(model.cfg, n_ctx, slack, kv_dtype)
        self.draft_tokens = draft_tokens  # prompt-lookup speculation: tokens guessed per pass (0 = off)
        self.draft_ngram = draft_ngram
        self.draft: Runner | None = None  # a draft model's own runner (None: drafts from prompt lookup)
        if draft_model is not None:
            check_same_vocabulary(model, draft_model)
            self.draft = Runner(draft_model, n_ctx, kv_dtype=kv_dtype)
        self.stats = GenerationStats()

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        """Up to k tokens guessed to follow `history`: by the draft model, else by prompt lookup."""
        if self.draft is not None:
            return model_draft(self.draft, history, k)
        return lookup_draft(history, k, self.draft_ngram)

    def _forward(self, ids: Sequence[int], all_logits: bool = False, tracer: Tracer | None = None) -> Logits:
        call = tracer.call if tracer is not None else plain_call
        with np.errstate(all="ignore"):  # a non-finite value is reported by check_logits, not warned about
            logits = forward(self.model.cfg, self.model.weights, self.cache, ids, all_logits, call)
        check_logits(logits.values, self.model.cfg, self.model.weights, self.cache.tokens, logits.start)
        return logits

    def prefill(self, ids: Sequence[int], all_logits: bool = False, tracer: Tracer | None = None) -> Logits:
        """Bring the Cache to hold exactly `ids`, computing only positions past the common prefix (each stage
        call traced by `tracer` when given)."""
        check_fits(len(ids), 0, self.cache.n_ctx)
        keep = self.cache.reusable(min(common_prefix(self.cache.tokens, ids), len(ids) - 1))
        if all_logits:
            keep = 0
        self.cache.truncate(keep)
        self.stats.n_reused = keep
        return self._forward(ids[keep:], all_logits, tracer)

    def step(self, token: int, tracer: Tracer | None = None) -> Logits:
        """Decode one position: feed `token` (the last sampled), return the next logits."""
        if self.cache.n_past >= self.cache.n_ctx:
            raise TracelmError(f"the context of {self.cache.n_ctx} positions is full")
        return self._forward([token], tracer=tracer)

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """f32 logits of every position of `ids`: [T, vocab]."""
        return np.asarray(self.prefill(ids, all_logits=True).values)

    def hidden(self, ids: Sequence[int]) -> np.ndarray:
        """The final hidden state of every position of `ids` -- after the output norm, the head not run -- f32
        [T, n_embd], computed on this runner's Cache emptied first (what embeddings pool; no token is sampled)."""
        check_fits(len(ids), 0, self.cache.n_ctx)
        self.cache.reset()
        cfg, weights = self.model.cfg, self.model.weights
        with np.errstate(all="ignore"):  # a non-finite value is reported by check_logits, not warned about
            out = forward(cfg, weights, self.cache, ids, all_logits=True, hidden=True)
        check_logits(out.x, cfg, weights, self.cache.tokens, out.start)
        return np.asarray(out.x)

    def part(self, ids: Sequence[int], tracer: Tracer | None = None) -> Part:
        """This runner's share of a batched pass: its Cache, the ids to feed, the tracer's hook."""
        return Part(self.cache, ids, tracer.call if tracer is not None else plain_call)

    def start(self, prompt_ids: Sequence[int], max_tokens: int, sampling: SamplingParams,
              stop: Sequence[str] = (), *, cancel: Callable[[], bool] | None = None,
              on_token: Callable[[Choice, np.ndarray], None] | None = None,
              tracer: Tracer | None = None) -> Generation:
        """Prefill the prompt and return the Generation that decodes from it (see `generate`)."""
        prompt_ids = [int(i) for i in prompt_ids]
        check_fits(len(prompt_ids), max_tokens, self.cache.n_ctx)
        matcher = check_sampling(sampling, self.model.tokenizer)
        self.stats = stats = GenerationStats(n_prompt=len(prompt_ids), finish_reason="length")
        rng = np.random.default_rng(sampling.seed)
        if tracer is not None:  # what a replay needs to repeat this call exactly
            reused = self.cache.reusable(min(common_prefix(self.cache.tokens, prompt_ids), len(prompt_ids) - 1))
            tracer.event("generate", prompt_ids=prompt_ids, reused=reused, max_tokens=max_tokens,
                              stop=list(stop), sampling=attrs.asdict(sampling),
                              rng={"generator": type(rng.bit_generator).__name__, "seed": sampling.seed})
        t0 = time.perf_counter()
        logits = self.prefill(prompt_ids, tracer=tracer)
        stats.prefill_seconds = time.perf_counter() - t0
        return Generation(self, prompt_ids, logits.values[-1], max_tokens, sampling, rng, stop, cancel, on_token,
                          tracer, matcher)

    def generate(self, prompt_ids: Sequence[int], max_tokens: int, sampling: SamplingParams,
                 stop: Sequence[str] = (), *, cancel: Callable[[], bool] | None = None,
                 on_token: Callable[[Choice, np.ndarray], None] | None = None,
                 tracer: Tracer | None = None) -> Iterator[str]:
        """Yield text as it is decoded (never half a UTF-8 character); statistics land in self.stats.

        `cancel()` is asked before each token is sampled: True ends generation there (finish_reason
        "cancelled"). `on_token(choice, logits)` sees each sampled token with the logits [vocab] it came from.
        `tracer`, when given, records this call: its generate event, every stage call and every token.
        """
        gen = self.start(prompt_ids, max_tokens, sampling, stop, cancel=cancel, on_token=on_token, tracer=tracer)
        try:
            while not gen.done:
                text = gen.step(self.draft_tokens)
                if text:
                    yield text
                feed_together([gen])
        except (GeneratorExit, KeyboardInterrupt):  # closed early (chat's Ctrl-C) or interrupted: as far as it got
            gen.stats.finish_reason = "cancelled"
            gen.close()
            raise
        text = gen.close()
        if text:
            yield text


class Generation:
    """One sequence being decoded, one token per `step`: sampling from the logits rows computed for it,
    end-of-generation, stop strings, the UTF-8 stream decoder, statistics and speculation guesses.

    After a step either `done` is set or `feed` holds the ids the next forward pass must compute for this
    sequence (the sampled token, plus any guessed ones); `take` hands it their logits. With a constraint, its
    `matcher` (the grammar's mutable state, as `rng` is the draw's) masks each row before sampling and takes the
    token drawn; a grammar that is complete ends the generation ("stop"). `Runner.generate`
    drives one Generation; the server drives several in step, computing all their `feed`s in one pass
    (`feed_together`). `close` releases held-back text and fixes the statistics.
    """

    def __init__(self, runner: Runner, prompt_ids: list[int], row: np.ndarray, max_tokens: int,
                 sampling: SamplingParams, rng: np.random.Generator, stop: Sequence[str] = (),
                 cancel: Callable[[], bool] | None = None,
                 on_token: Callable[[Choice, np.ndarray], None] | None = None, tracer: Tracer | None = None,
                 matcher: Matcher | None = None):
        self.runner, self.max_tokens, self.sampling, self.rng, self.stop = runner, max_tokens, sampling, rng, stop
        self.matcher = matcher
        self.cancel, self.on_token, self.tracer = cancel, on_token, tracer
        self.stats = runner.stats
        self.history = list(prompt_ids)
        self.n_tokens = runner.model.tokenizer.n_vocab  # Qwen2.5's folders: 151936 rows, 151665 tokens
        self.decoder = runner.model.tokenizer.stream_decoder()
        self.pending, self.stopped = "", False
        self.rows = [row]  # logits rows ready to sample from, in position order
        self.guesses: list[int] = []  # draft tokens fed ahead; rows[i + 1] assumes guesses[:i + 1]
        self.feed: list[int] = []  # what the next pass computes for this sequence ([]: rows are ready, or done)
        self.n_steps = 0
        self.done = max_tokens == 0
        self.t0 = time.perf_counter()

    def step(self, draft_tokens: int = 0) -> str:
        """Sample the next token and return the text it completes (often ""); may guess up to
        `draft_tokens` tokens ahead to feed with it."""
        stats, tok, runner = self.stats, self.runner.model.tokenizer, self.runner
        if self.cancel is not None and self.cancel():
            return self._end("cancelled")
        row = self.rows.pop(0)[: self.n_tokens]  # a model's rows past its vocabulary (padding) are no tokens
        logits, mask_hash = self._constrain(row)
        choice = sample(logits, self.sampling, self.rng, np.asarray(self.history))
        if self.matcher is not None:
            t0 = time.perf_counter()
            self.matcher.consume(choice.token, mask_hash)
            stats.constrain_seconds += time.perf_counter() - t0
        if self.guesses:
            if choice.token == self.guesses[0]:
                self.guesses.pop(0)
                stats.n_accepted += 1
            else:  # the rest was computed for a context that did not happen
                runner.cache.truncate(runner.cache.n_past - len(self.guesses))
                self.rows, self.guesses = [], []
        if self.on_token is not None:
            self.on_token(choice, row)
        if self.tracer is not None:
            grammar = {} if self.matcher is None else {"constraint": self.matcher.digest, "mask": mask_hash,
                                                       "state": self.matcher.state}
            self.tracer.event("token", draw=self.n_steps, id=choice.token, piece=tok.piece(choice.token),
                              text=tok.token_bytes(choice.token).decode("utf-8", "replace"), prob=choice.prob,
                              **grammar)
        if choice.token in tok.eog_ids:
            return self._end("stop")
        self.history.append(choice.token)
        stats.tokens.append(choice.token)
        stats.n_generated += 1
        self.n_steps += 1
        text = self.pending + self.decoder.push(choice.token)
        emit, self.pending, self.stopped = stop_split(text, self.stop)
        if self.stopped:
            stats.stop_word = stop_at(text, len(emit), self.stop)
        if self.stopped or (self.matcher is not None and self.matcher.stopped):  # a stop string; a complete grammar
            self._end("stop")
        elif self.n_steps >= self.max_tokens:
            self.done = True
        elif not self.rows:
            # the last sampled token is never fed, so a pass may guess up to max_tokens - n_steps - 1 more
            k = min(draft_tokens, self.max_tokens - self.n_steps - 1)
            self.guesses = runner.propose(self.history, k)
            self.feed = [choice.token, *self.guesses]
            stats.n_passes += 1
            stats.n_drafted += len(self.guesses)
        return emit

    def _constrain(self, row: np.ndarray) -> tuple[np.ndarray, str]:
        """The row as sampling sees it -- logit bias added, the grammar's mask applied -- and the mask's digest."""
        if self.matcher is None:
            return (constrain(row, None, self.sampling.logit_bias) if self.sampling.logit_bias else row), ""
        t0 = time.perf_counter()
        mask = self.matcher.mask()
        out = constrain(row, mask, self.sampling.logit_bias)
        mask_hash = mask_digest(mask)
        self.stats.constrain_seconds += time.perf_counter() - t0
        return out, mask_hash

    def take(self, logits: Logits) -> None:
        """The logits of the positions `feed` asked for."""
        self.rows, self.feed = list(logits.values), []

    def end_here(self) -> None:
        """End after the token just sampled ("stop"), the caller's decision (the server's tool calls): the ids
        waiting to be fed are dropped, as after the last token of any generation."""
        if self.feed:  # guesses waiting in `feed` are not in the Cache (ones already fed are: `close` drops them)
            self.guesses = []
        self.feed = []
        self._end("stop")

    def _end(self, reason: str) -> str:
        self.stats.finish_reason, self.done = reason, True
        return ""

    def close(self) -> str:
        """Finish: keep the Cache holding only chosen tokens, the trace every event of the call written; return the
        text held back until now."""
        if self.tracer is not None:  # the last token's lines (a token's are written at the next event or flush)
            self.tracer.flush()
        if self.guesses:
            self.runner.cache.truncate(self.runner.cache.n_past - len(self.guesses))
            self.guesses = []
        emit = ""
        if not self.stopped:  # release what was held back for a stop string, and any trailing bytes
            text = self.pending + self.decoder.flush()
            emit, _, stopped = stop_split(text, self.stop)
            if stopped and self.stats.finish_reason != "cancelled":
                self.stats.finish_reason, self.stats.stop_word = "stop", stop_at(text, len(emit), self.stop)
        self.stats.decode_seconds = time.perf_counter() - self.t0
        return emit


def feed_together(gens: Sequence[Generation]) -> None:
    """One forward pass computing every waiting Generation's `feed` (one weight read for all of them)."""
    waiting = [g for g in gens if g.feed]
    if not waiting:
        return
    model = waiting[0].runner.model
    parts = [g.runner.part(g.feed, g.tracer) for g in waiting]
    with np.errstate(all="ignore"):  # a non-finite value is reported by check_logits, not warned about
        out = forward_batch(model.cfg, model.weights, parts, any(len(g.feed) > 1 for g in waiting))
    for g, logits in zip(waiting, out, strict=True):
        check_logits(logits.values, model.cfg, model.weights, g.runner.cache.tokens, logits.start)
        g.take(logits)
