"""Trace events: one JSON line per stage call (and per sampled token), through structlog.

Levels: "off" (no events), "summary" (stage, layer, positions, shape, duration), "digest" (also a
blake2b-128 digest of the output arrays' bytes, so two runs can be compared bit for bit).
"""

from __future__ import annotations

import hashlib
import json
import platform
import sys
import time
from collections.abc import Callable
from importlib import metadata as importlib_metadata
from typing import IO, Any

import attrs
import numpy as np
import structlog

LEVELS = ("off", "summary", "digest")
TRACE_VERSION = 1
PACKAGES = ("tracelm", "numpy", "numexpr", "gguf", "tokenizers", "attrs", "structlog", "jinja2", "PyYAML")


def output_arrays(out: Any) -> list[np.ndarray]:
    """The arrays a stage returned, in field order (a record's array fields, or a bare array)."""
    if isinstance(out, np.ndarray):
        return [out]
    if attrs.has(type(out)):
        return [v for v in (getattr(out, f.name) for f in attrs.fields(type(out))) if isinstance(v, np.ndarray)]
    return []


def digest(arrays: list[np.ndarray]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for a in arrays:
        h.update(np.ascontiguousarray(a).data)
    return h.hexdigest()


def package_versions() -> dict[str, str]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib_metadata.version(name)
        except importlib_metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


def platform_facts() -> dict[str, Any]:
    return {"python": sys.version.split()[0], "machine": platform.machine(), "system": platform.system()}


class Tracer:
    """Times stage calls and writes one event per call to a JSON-lines stream."""

    def __init__(self, stream: IO[str], level: str = "digest"):
        if level not in LEVELS[1:]:
            raise ValueError(f"trace level must be 'summary' or 'digest', not {level!r}")
        self.level = level
        self.seq = 0
        self._log = structlog.wrap_logger(
            structlog.WriteLogger(stream),
            processors=[self._number, structlog.processors.JSONRenderer(serializer=_dumps)],
        )
        self._stream = stream

    def _number(self, _logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
        event = {"seq": self.seq, **event}
        self.seq += 1
        return event

    def event(self, kind: str, **fields: Any) -> None:
        self._log.msg(kind, **fields)

    def call(self, stage: str, layer: int | None, fn: Callable[..., Any], *args: Any) -> Any:
        t0 = time.perf_counter_ns()
        out = fn(*args)
        dur = time.perf_counter_ns() - t0
        arrays = output_arrays(out)
        fields: dict[str, Any] = {
            "stage": stage,
            "layer": layer,
            "start": getattr(out, "start", None),
            "shape": [list(a.shape) for a in arrays],
            "dtype": arrays[0].dtype.name if arrays else None,
            "dur_us": round(dur / 1000, 1),
        }
        if self.level == "digest":
            fields["digest"] = digest(arrays)
        self._log.msg("stage", **fields)
        return out

    def flush(self) -> None:
        self._stream.flush()


def _dumps(obj: Any, **kw: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, default=_jsonable, separators=(",", ":"))


def _jsonable(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    if attrs.has(type(x)):
        return attrs.asdict(x)
    if isinstance(x, tuple | set | frozenset):
        return list(x)
    return str(x)


def write_header(tracer: Tracer, run_config: Any, model: Any, prompt_ids: list[int]) -> None:
    """The opening event: everything needed to know what the run was and to repeat it."""
    from tracelm.io.registry import file_sha256
    from tracelm.io.run_config import config_as_dict

    tracer.event(
        "header",
        trace_version=TRACE_VERSION,
        level=tracer.level,
        digest_algorithm="blake2b-128" if tracer.level == "digest" else None,
        config=config_as_dict(run_config),
        model_file=str(model.path),
        model_sha256=file_sha256(model.path),
        model_config=attrs.asdict(model.cfg),
        packages=package_versions(),
        platform=platform_facts(),
        prompt_ids=list(prompt_ids),
        seed=run_config.sampling.seed,
    )


def write_footer(tracer: Tracer, stats: Any) -> None:
    tracer.event(
        "footer",
        events=tracer.seq + 1,
        n_prompt=stats.n_prompt,
        n_reused=stats.n_reused,
        n_generated=stats.n_generated,
        finish_reason=stats.finish_reason,
        output_ids=list(stats.tokens),
        prefill_seconds=round(stats.prefill_seconds, 6),
        decode_seconds=round(stats.decode_seconds, 6),
    )
    tracer.flush()
