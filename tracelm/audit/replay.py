"""`tracelm replay`: re-run a traced run from its header and generate events, and find the first point
where the new run departs from the recorded one.

Each event the replay produces is compared, in order, with the recorded event of the same sequence number:
- kind, stage, layer, token index, positions, shape and dtype must be equal;
- at level digest, equal digests mean bit-identical outputs; where the digests differ (bits differ) the
  statistics must agree within the tolerance below, else the run has diverged;
- at level summary, the statistics must agree within the tolerance;
- a token event must have the same id (and its probability agree within the tolerance).

Tolerance (STATS_RTOL): |mean - mean'| <= STATS_RTOL * max(rms, rms') and, for rms and max |x|,
|a - a'| <= STATS_RTOL * max(|a|, |a'|) (+ STATS_ATOL for values near 0). Timing fields (`*_us`,
`*_seconds`), the chain fields (prev, hash, mac) and `seq` are never compared, and recorded events a
replay does not produce (e.g. a server's `request` annotation) are skipped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

from tracelm.audit.policy import Policy, key_policy
from tracelm.audit.trust import TrustVerdict, judge
from tracelm.audit.verify import Trace, read_trace
from tracelm.io.registry import path_sha256
from tracelm.io.run_config import record_from_dict, run_config_from_dict
from tracelm.pipeline.runner import GenerationStats, common_prefix
from tracelm.pipeline.trace import CHAIN_FIELDS, Tracer, is_timing_field, tokenizer_sha256
from tracelm.session import Session
from tracelm.state.errors import TracelmError
from tracelm.state.records import SamplingParams
from tracelm.state.run_config import AttestOptions, RunConfig, TraceOptions

STATS_RTOL = 1e-3
STATS_ATOL = 1e-6
STATS = ("mean", "rms", "maxabs")
REPLAYED = ("generate", "stage", "token")  # the events a replay produces (the rest are not compared)
REPRODUCED, DIVERGED = 0, 1  # the comparison's outcome; 2 (cannot replay) is a TracelmError


class _Diverged(Exception):
    pass


class _Reached(Exception):
    """The replay passed the last recorded event of an interrupted run: everything recorded was compared."""


@attrs.define
class Difference:
    """One recorded event and what the replay produced in its place."""

    line: int  # 1-based line of the recorded trace
    kind: str  # event kind: stage, token, generate, ...
    token: int | None  # index of the generated token whose pass it belongs to
    layer: int | None
    stage: str | None
    recorded: dict[str, Any]
    replayed: dict[str, Any] | None
    reason: str

    def describe(self) -> str:
        where = [f"line {self.line}", self.kind]
        if self.token is not None:
            where.append(f"token {self.token}")
        if self.layer is not None:
            where.append(f"layer {self.layer}")
        if self.stage:
            where.append(f"stage {self.stage}")
        rec = {k: v for k, v in self.recorded.items() if k in _SHOWN}
        rep = {k: v for k, v in (self.replayed or {}).items() if k in _SHOWN}
        return f"{', '.join(where)}: {self.reason}\n  recorded {json.dumps(rec)}\n  replayed {json.dumps(rep)}"

    def as_dict(self) -> dict[str, Any]:
        """The difference as `tracelm replay --json` reports it (the compared fields of both events)."""
        shown = lambda e: {k: v for k, v in (e or {}).items() if k in _SHOWN}  # noqa: E731
        return {"line": self.line, "kind": self.kind, "token": self.token, "layer": self.layer, "stage": self.stage,
                "reason": self.reason, "recorded": shown(self.recorded), "replayed": shown(self.replayed)}


_SHOWN = ("start", "n", "shape", "dtype", "mean", "rms", "maxabs", "digest", "id", "piece", "prob", "event",
          "prompt_ids", "prompt_text", "sampling", "status", "last_token", "output_ids", "output_text", "n_generated",
          "finish_reason")


@attrs.define
class ReplayReport:
    status: int  # REPRODUCED or DIVERGED
    compared: int = 0  # events compared
    bit_exact: int = 0  # stage events with equal digests
    within_tolerance: int = 0  # stage events whose bits differ but whose statistics agree
    first_bit_difference: Difference | None = None
    divergence: Difference | None = None
    notes: list[str] = attrs.Factory(list)
    checked: list[str] = attrs.Factory(list)  # what was recomputed and compared with the recording
    interrupted_at: int | None = None  # a trace of an interrupted run: replayed up to its last complete token
    trust: TrustVerdict | None = None  # who wrote the trace, under the auditor's policy

    @property
    def exit_status(self) -> int:
        """DIVERGED when the runs part; else the trust verdict's (0 when it meets the policy's requirement)."""
        if self.status != REPRODUCED or self.trust is None:
            return self.status
        return self.trust.exit_status

    def describe(self) -> str:
        lines = list(self.notes)
        if self.trust is not None:
            headline, *steps = self.trust.lines()
            lines += ["trust: " + headline, *steps]
        if self.checked:
            lines.append("checked: " + "; ".join(self.checked))
        if self.divergence is None:
            exact = self.first_bit_difference is None
            upto = "" if self.interrupted_at is None else f" up to the interruption at token {self.interrupted_at}"
            lines.append(f"reproduced{upto}: {self.compared} events compared, "
                         + ("every stage output bit-identical" if exact else
                            f"{self.bit_exact} stage outputs bit-identical, {self.within_tolerance} differ in bits "
                            f"but agree within rtol {STATS_RTOL}"))
        else:
            lines.append(f"diverged after {self.compared} matching events; first divergence:")
            lines.append("  " + self.divergence.describe().replace("\n", "\n  "))
        if self.first_bit_difference is not None and self.first_bit_difference != self.divergence:
            lines.append("first bit-level difference (within tolerance):")
            lines.append("  " + self.first_bit_difference.describe().replace("\n", "\n  "))
        if self.divergence is None and self.trust is not None and not self.trust.ok:
            what = ("nothing was authenticated: the values reproduce, but who recorded them is unknown"
                    if self.trust.level == "intact" else "the values reproduce, but the trace does not meet the "
                    f"required trust level {self.trust.require!r}")
            lines.append(f"exit {self.exit_status}: {self.trust.level}: {what}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """`tracelm replay --json`: the verdict, the counts, and where the runs part (null when they do not)."""
        part = lambda d: d.as_dict() if d is not None else None  # noqa: E731
        return {"status": "reproduced" if self.status == REPRODUCED else "diverged", "exit_status": self.exit_status,
                "trust": None if self.trust is None else self.trust.as_dict(),
                "compared": self.compared, "bit_exact": self.bit_exact, "within_tolerance": self.within_tolerance,
                "divergence": part(self.divergence), "first_bit_difference": part(self.first_bit_difference),
                "notes": list(self.notes), "message": self.describe()}


def _close(a: Any, b: Any, scale: float) -> bool:
    if isinstance(a, str) or isinstance(b, str):  # "nan" / "inf"
        return a == b
    if a is None or b is None:
        return a is b
    return abs(float(a) - float(b)) <= STATS_RTOL * scale + STATS_ATOL


def _stats_agree(rec: dict[str, Any], rep: dict[str, Any]) -> str | None:
    """None if the statistics agree within the tolerance, else which one does not."""
    def mag(k: str) -> float:
        vals = [v for v in (rec.get(k), rep.get(k)) if isinstance(v, int | float)]
        return max((abs(v) for v in vals), default=0.0)

    if not _close(rec.get("mean"), rep.get("mean"), mag("rms")):
        return "mean"
    for k in ("rms", "maxabs"):
        if not _close(rec.get(k), rep.get(k), mag(k)):
            return k
    return None


class _Comparer:
    """A text stream for a Tracer: parses each line the replay writes and compares it with the recording."""

    def __init__(self, trace: Trace, report: ReplayReport, interrupted: bool = False):
        self.trace = trace
        self.report = report
        self.interrupted = interrupted  # the recorded run stopped early: its events end before the replay's
        self.i = 1  # the next recorded line to compare (0 is the header)
        self._buf = ""

    def write(self, text: str) -> None:
        self._buf += text
        *lines, self._buf = self._buf.split("\n")
        for line in lines:
            if line:
                self.compare(json.loads(line))

    def flush(self) -> None:
        pass

    def _diff(self, rec: dict[str, Any], rep: dict[str, Any] | None, reason: str) -> Difference:
        src = rec if rec else (rep or {})
        return Difference(self.i + 1, str(src.get("event")), src.get("tok"), src.get("layer"), src.get("stage"),
                          rec, rep, reason)

    def diverge(self, rec: dict[str, Any], rep: dict[str, Any] | None, reason: str) -> None:
        self.report.divergence = self._diff(rec, rep, reason)
        self.report.status = DIVERGED
        raise _Diverged

    def compare(self, rep: dict[str, Any]) -> None:
        events = self.trace.events
        while self.i < len(events) and (events[self.i] or {}).get("event") not in REPLAYED:
            self.i += 1  # an annotation the caller wrote (e.g. a server's request event): nothing to compare
        if self.i >= len(events) or (events[self.i] or {}).get("event") == "footer":
            if self.interrupted:
                raise _Reached
            self.diverge({}, rep, "the replay produced an event the recorded run does not have")
        rec = events[self.i] or {}
        plain = lambda e: {k: v for k, v in e.items()  # noqa: E731
                           if k not in CHAIN_FIELDS and not is_timing_field(k) and k not in STATS + ("digest", "seq")}
        a, b = plain(rec), plain(rep)
        if rec.get("event") == "token" and rep.get("event") == "token":
            a.pop("prob", None), b.pop("prob", None)
            if a == b and not _close(rec.get("prob"), rep.get("prob"), 1.0):
                self.diverge(rec, rep, "same token, different probability")
        if a != b:
            keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            self.diverge(rec, rep, "different " + ", ".join(keys))
        if rec.get("event") == "stage":
            if "digest" in rec and rec.get("digest") == rep.get("digest"):
                edited = [k for k in STATS if rec.get(k) != rep.get(k)]
                if edited:  # the same bits give the same statistics: the recorded ones were not computed from them
                    self.diverge(rec, rep, f"{', '.join(edited)} differ from the statistics of the identical output "
                                           "bits (the recorded statistics were edited)")
                self.report.bit_exact += 1
            else:
                bad = _stats_agree(rec, rep)
                if bad is not None:
                    self.diverge(rec, rep, f"outputs differ: {bad} outside rtol {STATS_RTOL}")
                if "digest" in rec:
                    self.report.within_tolerance += 1
                    if self.report.first_bit_difference is None:
                        self.report.first_bit_difference = self._diff(rec, rep, "bits differ, statistics agree")
        self.report.compared += 1
        self.i += 1


def replay(path: str | Path, model: str | None = None, allow_model_change: bool = False,
           key: bytes | None = None, public_key: Any = None, policy: Policy | None = None,
           key_name: str | None = None) -> ReplayReport:
    """Re-run the trace at `path` and compare event by event, then the header's and the footer's recomputable
    fields. TracelmError when it cannot be replayed (not a trace, a broken chain, no model).

    The run is opened as recorded: a Session on the header's config (its compute, weights, context,
    speculation and thread count), against `model` when given instead of the recorded file. A trace of an
    interrupted run (footer status "interrupted") is replayed up to its last recorded event. The trace is judged
    first (tracelm/audit/trust.py) under `policy` (by default: the keys `public_key` names, an Ed25519 public key,
    trusted; `key`: the HMAC secret, named `key_name`); the report's `trust` and `exit_status` say how far it is
    trusted."""
    trace = read_trace(path)
    trust = judge(trace, policy or key_policy([public_key] if public_key is not None else []), key, key_name)
    verdict = trust.chain
    if not verdict.intact:
        raise TracelmError(f"{trace.path}: cannot replay a trace that is not intact ({verdict.message})")
    cfg, level = _recorded_config(trace)
    if model is None:
        recorded_file = trace.header.get("model_file")
        model = recorded_file if isinstance(recorded_file, str) and Path(recorded_file).exists() else cfg.model
    calls = [(i, e) for i, e in enumerate(trace.events) if e is not None and e.get("event") == "generate"]
    if not calls:
        raise TracelmError(f"{trace.path}: the trace has no generate event: nothing to replay")
    footer_line = len(trace.events) - 1
    footer = trace.events[footer_line] or {}
    with Session(model, cfg) as session:
        report = ReplayReport(REPRODUCED, notes=_model_notes(trace, session.path, allow_model_change),
                              interrupted_at=verdict.interrupted_at, trust=trust)
        same_model = not report.notes
        comparer = _Comparer(trace, report, interrupted=verdict.interrupted_at is not None)
        tracer = Tracer(comparer, level)  # type: ignore[arg-type]
        tracer.seq = 1
        try:
            _check_header(trace, session, calls[0][1], comparer, same_model)
            text = ""
            for line, call in calls:
                text = _replay_call(session, trace, line, call, tracer, report.notes)
        except _Diverged:
            return report
        except _Reached:
            pass
        report.checked.append("every generate, stage and token event: kind, token, layer, stage, positions, shape, "
                              "dtype, statistics, digests, token ids, pieces, texts, probabilities")
        rest = trace.events[min(comparer.i, footer_line)]
        if rest is not None and rest.get("event") != "footer":
            report.divergence = comparer._diff(rest, None, "the recorded run has more events than the replay")
            report.status = DIVERGED
            return report
        comparer.i = footer_line
        try:
            if verdict.interrupted_at is None:
                _check_footer(footer, session.runner.stats, text, tracer.counts, comparer)
            else:
                _check_interrupted_footer(trace, footer, comparer)
        except _Diverged:
            pass
    return report


def _check_header(trace: Trace, session: Session, first_call: dict[str, Any], comparer: _Comparer,
                  same_model: bool) -> None:
    """The header's recomputable fields: its prompt (ids as the first generate call's, text as they decode) and,
    on the recorded model, the ModelConfig and the tokenizer hash."""
    h, comparer.i = trace.header, 0
    recomputed: dict[str, Any] = {"prompt_ids": first_call.get("prompt_ids")}
    try:
        recomputed["prompt_text"] = session.tokenizer.decode([int(i) for i in h.get("prompt_ids") or []])
    except (TracelmError, TypeError, ValueError):
        recomputed["prompt_text"] = None
    if same_model:
        recomputed["model_config"] = json.loads(json.dumps(attrs.asdict(session.model.cfg)))
        recomputed["tokenizer_sha256"] = tokenizer_sha256(session.model.tokenizer_path or session.model.path)
    for k, v in recomputed.items():
        if h.get(k) != v:
            comparer.diverge(h, {**h, k: v}, f"header {k} differs from the recomputed one")
    comparer.report.checked.append("header " + ", ".join(recomputed))
    comparer.i = 1


def _check_footer(footer: dict[str, Any], stats: GenerationStats, text: str, counts: dict[str, int],
                  comparer: _Comparer) -> None:
    """The footer's recomputable fields against the replay's last call (as `write_footer` records them)."""
    recomputed: dict[str, Any] = {
        "status": "complete", "output_ids": list(stats.tokens), "n_prompt": stats.n_prompt,
        "n_reused": stats.n_reused, "n_generated": stats.n_generated, "finish_reason": stats.finish_reason,
        "decode_passes": stats.n_passes, "draft_tokens": stats.n_drafted, "draft_accepted": stats.n_accepted,
        **{f"counts.{k}": counts.get(k, 0) for k in REPLAYED},
    }
    if footer.get("output_text") is not None:  # a server's footer holds none
        recomputed["output_text"] = text
    recorded = {**footer, "status": footer.get("status", "complete"),
                **{f"counts.{k}": (footer.get("counts") or {}).get(k, 0) for k in REPLAYED}}
    for k, v in recomputed.items():
        if recorded.get(k) != v:
            comparer.diverge(footer, {**footer, k: v}, f"footer {k} differs from the replay's")
    comparer.report.checked.append("footer " + ", ".join(recomputed))


def _check_interrupted_footer(trace: Trace, footer: dict[str, Any], comparer: _Comparer) -> None:
    """An interrupted run's footer: its last_token is the last token event recorded (all of which were replayed)."""
    tokens = [e for e in trace.events if e is not None and e.get("event") == "token"]
    last = tokens[-1].get("tok") if tokens else None
    if footer.get("last_token") != last:
        comparer.diverge(footer, {**footer, "last_token": last}, "footer last_token is not the last token recorded")
    comparer.report.checked.append("footer status, last_token")


def _recorded_config(trace: Trace) -> tuple[RunConfig, str]:
    """The header's run config (numpy's products for traces recorded before the kernels; no trace file of its
    own) and its trace level."""
    h = trace.header
    recorded = h.get("config")
    if isinstance(recorded, dict) and "compute" not in recorded:  # recorded before the kernels: numpy's products
        recorded = {**recorded, "compute": "reference"}
    cfg = run_config_from_dict(recorded, f"{trace.path}: header config")
    level = h.get("level")
    if level not in ("summary", "digest"):
        raise TracelmError(f"{trace.path}: header level {level!r} is not summary or digest")
    return attrs.evolve(cfg, trace=TraceOptions(), attest=AttestOptions()), level  # a replay signs and attests nothing


def _model_notes(trace: Trace, path: Path, allow_model_change: bool) -> list[str]:
    """Nothing when the model file is the one recorded (sha256); else a refusal, or a warning when allowed."""
    sha = path_sha256(path)
    if sha == trace.header.get("model_sha256"):
        return []
    msg = (f"the model's sha256 differs: the trace was recorded with {trace.header.get('model_sha256')} "
           f"({trace.header.get('model_file')}), {path} has {sha}")
    if not allow_model_change:
        raise TracelmError(f"cannot replay: {msg}; pass --allow-model-change to replay against it anyway "
                           f"and find where the runs part")
    return [f"warning: {msg}; replaying anyway"]


def _replay_call(session: Session, trace: Trace, line: int, call: dict[str, Any], tracer: Tracer,
                 notes: list[str]) -> str:
    """One recorded generate call, run again with its events going to the comparer; the text it streamed."""
    sampling = record_from_dict(SamplingParams, call.get("sampling"), f"line {line + 1}: sampling.")
    try:
        ids = [int(i) for i in call["prompt_ids"]]
        max_tokens, stop = int(call["max_tokens"]), [str(s) for s in call.get("stop", [])]
    except (KeyError, TypeError, ValueError):
        raise TracelmError(f"{trace.path}: line {line + 1}: generate event lacks prompt_ids or max_tokens") from None
    reused = int(call.get("reused", 0))
    runner = session.runner
    if min(common_prefix(runner.cache.tokens, ids), len(ids) - 1) < reused:
        # the recorded run found these prompt tokens already in its Cache (e.g. a server session that began
        # before the trace): compute them untraced first, so the traced passes match
        runner.prefill(ids[:reused])
        notes.append(f"line {line + 1}: computed the {reused} prompt tokens the recorded run had cached, "
                     f"untraced (their chunking may round differently)")
    fields = attrs.asdict(sampling, recurse=False)  # the constraint stays a record
    text = "".join(session.stream(ids, max_tokens=max_tokens, stop=stop, trace=tracer, **fields))
    tracer.flush()
    return text
