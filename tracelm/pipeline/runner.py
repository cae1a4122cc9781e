"""The runner: prefill a prompt in one batched pass, then decode one token at a time, streaming text."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import numpy as np

from tracelm import TracelmError
from tracelm.io.loader import LoadedModel
from tracelm.pipeline.graph import forward, new_cache, plain_call
from tracelm.pipeline.speculative import lookup_draft
from tracelm.pipeline.trace import Tracer
from tracelm.stages.sample import sample
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


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


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


def speculation(cfg: Any) -> dict[str, int]:
    """Runner keyword arguments for a RunConfig's `speculative` section."""
    return {"draft_tokens": cfg.speculative.draft_tokens, "draft_ngram": cfg.speculative.ngram}


class Runner:
    """A model and one Cache (one conversation). Later calls reuse the cached common prefix."""

    def __init__(self, model: LoadedModel, n_ctx: int, tracer: Tracer | None = None, draft_tokens: int = 0,
                 draft_ngram: int = 3):
        self.model = model
        self.cache = new_cache(model.cfg, n_ctx)
        self.tracer = tracer
        self.draft_tokens = draft_tokens  # prompt-lookup speculation: tokens guessed per pass (0 = off)
        self.draft_ngram = draft_ngram
        self.stats = GenerationStats()

    def _forward(self, ids: Sequence[int], all_logits: bool = False) -> Logits:
        call = self.tracer.call if self.tracer is not None else plain_call
        return forward(self.model.cfg, self.model.weights, self.cache, ids, all_logits, call)

    def prefill(self, ids: Sequence[int], all_logits: bool = False) -> Logits:
        """Bring the Cache to hold exactly `ids`, computing only positions past the common prefix."""
        check_fits(len(ids), 0, self.cache.n_ctx)
        keep = min(common_prefix(self.cache.tokens, ids), len(ids) - 1)
        if all_logits:
            keep = 0
        self.cache.truncate(keep)
        self.stats.n_reused = keep
        return self._forward(ids[keep:], all_logits)

    def step(self, token: int) -> Logits:
        """Decode one position: feed `token` (the last sampled), return the next logits."""
        if self.cache.n_past >= self.cache.n_ctx:
            raise TracelmError(f"the context of {self.cache.n_ctx} positions is full")
        return self._forward([token])

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """f32 logits of every position of `ids`: [T, vocab]."""
        return np.asarray(self.prefill(ids, all_logits=True).values)

    def generate(self, prompt_ids: Sequence[int], max_tokens: int, sampling: SamplingParams,
                 stop: Sequence[str] = (), *, cancel: Callable[[], bool] | None = None,
                 on_token: Callable[[Choice, np.ndarray], None] | None = None) -> Iterator[str]:
        """Yield text as it is decoded (never half a UTF-8 character); statistics land in self.stats.

        `cancel()` is asked before each token is sampled: True ends generation there (finish_reason
        "cancelled"). `on_token(choice, logits)` sees each sampled token with the logits [vocab] it came from.
        """
        prompt_ids = [int(i) for i in prompt_ids]
        check_fits(len(prompt_ids), max_tokens, self.cache.n_ctx)
        tok = self.model.tokenizer
        self.stats = stats = GenerationStats(n_prompt=len(prompt_ids), finish_reason="length")
        rng = np.random.default_rng(sampling.seed)
        if self.tracer is not None:  # what a replay needs to repeat this call exactly
            reused = min(common_prefix(self.cache.tokens, prompt_ids), len(prompt_ids) - 1)
            self.tracer.event("generate", prompt_ids=prompt_ids, reused=reused, max_tokens=max_tokens,
                              stop=list(stop), sampling=attrs.asdict(sampling),
                              rng={"generator": type(rng.bit_generator).__name__, "seed": sampling.seed})
        t0 = time.perf_counter()
        logits = self.prefill(prompt_ids)
        stats.prefill_seconds = time.perf_counter() - t0
        history = list(prompt_ids)
        decoder = tok.stream_decoder()
        pending, stopped = "", False
        rows = [logits.values[-1]]  # logits rows ready to sample from, in position order
        guesses: list[int] = []  # draft tokens fed ahead; rows[i + 1] assumes guesses[:i + 1]
        t0 = time.perf_counter()
        for step in range(max_tokens):
            if cancel is not None and cancel():
                stats.finish_reason = "cancelled"
                break
            row = rows.pop(0)
            choice = sample(row, sampling, rng, np.asarray(history))
            if guesses:
                if choice.token == guesses[0]:
                    guesses.pop(0)
                    stats.n_accepted += 1
                else:  # the rest was computed for a context that did not happen
                    self.cache.truncate(self.cache.n_past - len(guesses))
                    rows, guesses = [], []
            if on_token is not None:
                on_token(choice, row)
            if self.tracer is not None:
                self.tracer.event("token", draw=step, id=choice.token, piece=tok.piece(choice.token),
                                  text=tok.token_bytes(choice.token).decode("utf-8", "replace"), prob=choice.prob)
            if choice.token in tok.eog_ids:
                stats.finish_reason = "stop"
                break
            history.append(choice.token)
            stats.tokens.append(choice.token)
            stats.n_generated += 1
            emit, pending, stopped = stop_split(pending + decoder.push(choice.token), stop)
            if emit:
                yield emit
            if stopped:
                stats.finish_reason = "stop"
                break
            if not rows and step + 1 < max_tokens:
                # the last sampled token is never fed, so a pass may guess up to max_tokens - step - 2 more
                guesses = lookup_draft(history, min(self.draft_tokens, max_tokens - step - 2), self.draft_ngram)
                rows = list(self._forward([choice.token, *guesses], all_logits=bool(guesses)).values)
                stats.n_passes += 1
                stats.n_drafted += len(guesses)
        if guesses:  # keep the Cache holding only tokens that were chosen
            self.cache.truncate(self.cache.n_past - len(guesses))
        if not stopped:  # release what was held back for a stop string, and any trailing bytes
            emit, _, stopped = stop_split(pending + decoder.flush(), stop)
            if stopped and stats.finish_reason != "cancelled":
                stats.finish_reason = "stop"
            if emit:
                yield emit
        stats.decode_seconds = time.perf_counter() - t0
