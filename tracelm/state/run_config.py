"""RunConfig: what a run does (model, context, sampling, trace, threads), as read from YAML."""

from __future__ import annotations

import attrs
from attrs import validators as v

from tracelm.state.records import SamplingParams


@attrs.frozen(slots=True)
class TraceOptions:
    level: str = attrs.field(default="off", validator=v.in_(("off", "summary", "digest")))
    file: str | None = None


@attrs.frozen(slots=True)
class RunConfig:
    model: str = "smollm2-135m-instruct"  # registry name or path to a GGUF file
    context: int = attrs.field(default=2048, validator=v.gt(0))  # positions the Cache holds
    threads: int = attrs.field(default=0, validator=v.ge(0))  # BLAS threads; 0 = all cores
    max_tokens: int = attrs.field(default=128, validator=v.ge(0))
    stop: tuple[str, ...] = attrs.field(default=(), converter=tuple)  # stop strings
    system: str | None = None  # chat: system prompt (None: the template's default)
    prompt: str = "The capital of France is"
    sampling: SamplingParams = SamplingParams()
    trace: TraceOptions = TraceOptions()
