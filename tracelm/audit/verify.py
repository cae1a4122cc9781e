"""Reading a trace back: check its hash chain and signature (`tracelm trace verify`), and summarise it
(`tracelm trace show`), without the model. The format is in docs/trace.md and tracelm/pipeline/trace.py."""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
from pathlib import Path
from typing import Any

import attrs

from tracelm.io.files import GiB, read_regular
from tracelm.pipeline.trace import (
    FOOTER_STATUSES,
    FORMAT,
    GENESIS,
    READABLE_VERSIONS,
    TRACE_VERSION,
    decode_rate,
)
from tracelm.state.errors import TracelmError

_LINE = re.compile(rb'^(\{.*),"hash":"([0-9a-f]{64})"(?:,"mac":"([0-9a-f]{64})")?(?:,"sig":"([0-9a-f]{128})")?\}$',
                   re.DOTALL)

INTACT, TAMPERED = 0, 1  # exit statuses of `trace verify`; 2 (not a trace) is a TracelmError
MAX_TRACE_BYTES = 4 * GiB  # a larger trace file is refused before it is read (a generated token is ~40-80 KB of it)


@attrs.define
class Verdict:
    """The result of checking a trace: intact or not, where it first breaks and why."""

    intact: bool
    n_lines: int
    message: str
    bad_line: int | None = None  # 1-based
    signed: bool = False  # the header says the lines carry a mac
    mac_checked: bool = False
    interrupted_at: int | None = None  # an intact trace of an interrupted run: its last complete token (-1: none)
    signature_algorithm: str | None = None  # the header says the footer carries a signature ("ed25519")
    key_fingerprint: str | None = None  # sha256 of the public key the header names
    signature_checked: bool = False  # the signature was checked with a public key the caller gave


@attrs.define
class _Signature:
    """A signed trace's header facts: its algorithm, the public key it names and that key's fingerprint; `given`:
    the caller's public key (checked to be the header's), or None."""

    algorithm: str | None
    key: Any = None
    fingerprint: str | None = None
    given: bool = False

    @property
    def short(self) -> str:
        return str(self.fingerprint)[:16]

    def describe(self) -> str:
        if self.algorithm is None:
            return ""
        how = ("signature checked with the public key given" if self.given else "signature checked against the key "
               "the header names (whether that key is trusted is the policy's call)")
        return f"signed ({self.algorithm}, key {self.short}); {how}"


@attrs.define
class Trace:
    path: Path
    lines: list[bytes]  # raw lines without their newline
    events: list[dict[str, Any] | None]  # parsed lines (None where a line is not JSON)
    truncated_tail: bool  # the file does not end with a newline

    @property
    def header(self) -> dict[str, Any]:
        return self.events[0]  # type: ignore[return-value]


def read_trace(path: str | Path) -> Trace:
    """Read a trace file; raise TracelmError if it is not a trace at all (unreadable, empty, no header,
    or a format version this tracelm does not read)."""
    p = Path(path)
    return parse_trace(read_regular(p, "trace", MAX_TRACE_BYTES), p)


def parse_trace(data: bytes, p: Path) -> Trace:
    """A trace from the bytes of a file named `p` (read_trace's checks; an uploaded trace has no file)."""
    if not data.strip():
        raise TracelmError(f"{p}: empty file, not a tracelm trace")
    lines = data.split(b"\n")
    truncated_tail = lines[-1] != b""
    if not truncated_tail:
        lines.pop()
    events: list[dict[str, Any] | None] = []
    for raw in lines:
        try:
            obj = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: JSON nested too deeply
            obj = None
        events.append(obj if isinstance(obj, dict) else None)
    head = events[0]
    if head is None and lines[0].startswith(b'{"seq":0,"event":"header"'):
        raise TracelmError(f"{p}: truncated inside its header (line 1 is cut off): nothing to verify")
    if head is None or head.get("event") != "header":
        raise TracelmError(f"{p}: not a tracelm trace (line 1 is not a JSON trace header)")
    version = head.get("trace_version")
    if not isinstance(version, int):
        raise TracelmError(f"{p}: not a tracelm trace (the header has no integer trace_version)")
    if version > TRACE_VERSION:
        raise TracelmError(f"{p}: trace format version {version} is newer than this tracelm reads "
                           f"(up to {TRACE_VERSION}); upgrade tracelm to read it")
    if version < min(READABLE_VERSIONS) or head.get("format") != FORMAT:
        raise TracelmError(f"{p}: trace format version {version} has no hash chain and cannot be verified or "
                           f"replayed (this tracelm reads format {FORMAT!r} version {TRACE_VERSION})")
    return Trace(p, lines, events, truncated_tail)


def verify(trace: Trace, key: bytes | None = None, public_key: Any = None) -> Verdict:
    """Check every line's hash, its link to the previous line, its sequence number, the footer, (with `key`)
    every line's HMAC, and a signed trace's footer signature (with `public_key`, an Ed25519PublicKey, which must be
    the key the header names; without it, against the header's key). Stops at the first bad line."""
    signed = trace.header.get("mac_algorithm") is not None
    n = len(trace.lines)
    sig = _Signature(None)

    def bad(i: int, why: str) -> Verdict:
        return Verdict(False, n, f"line {i + 1}: {why}", i + 1, signed, key is not None, None, sig.algorithm,
                       sig.fingerprint, sig.given)

    if key is not None and not signed:
        return bad(0, "the trace is not signed (its header names no mac_algorithm), so it cannot be "
                      "authenticated with a key")
    header_sig = _header_signature(trace.header, public_key)
    if isinstance(header_sig, str):
        return bad(0, header_sig)
    sig = header_sig
    prev = GENESIS
    footer_at = None
    for i, (raw, event) in enumerate(zip(trace.lines, trace.events, strict=True)):
        if footer_at is not None:
            return bad(i, f"a line after the footer (line {footer_at + 1}): lines were appended")
        if trace.truncated_tail and i == n - 1:
            return bad(i, "cut off (no newline at the end of the file): the trace is truncated")
        m = _LINE.match(raw)
        if event is None or m is None:
            return bad(i, "not a trace event (not a JSON line ending in a hash): garbage or a damaged line")
        body, h, mac, signature = m.group(1), m.group(2).decode(), m.group(3), m.group(4)
        if hashlib.sha256(body).hexdigest() != h:
            return bad(i, f"content does not match its hash: the {event.get('event', '?')} event was edited")
        if event.get("prev") != prev:
            what = "line 1 is not the start of a chain" if i == 0 else f"does not follow line {i}"
            return bad(i, f"{what} (prev hash differs): a line was deleted, inserted, moved or rewritten "
                          f"before it")
        if event.get("seq") != i:
            return bad(i, f"sequence number {event.get('seq')} where {i} was expected: lines were reordered")
        if key is not None:
            if mac is None:
                return bad(i, "no signature (mac) on a signed trace: the line was re-chained without the key")
            want = hmac.new(key, h.encode("ascii"), "sha256").hexdigest()
            if not hmac.compare_digest(want, mac.decode()):
                return bad(i, "signature (mac) does not match with this key: the line was re-chained or signed "
                              "with another key")
        elif signed and mac is None:
            return bad(i, "no mac on a line of a signed trace: the line was re-chained")
        if i > 0 and event.get("event") == "header":
            return bad(i, "a second header")
        if (why := _signature_problem(sig, event, h, signature)) is not None:
            return bad(i, why)
        if event.get("event") == "footer":
            footer_at = i
            if event.get("events") != i + 1:
                return bad(i, f"the footer counts {event.get('events')} events but it is event {i + 1}")
            if footer_status(event) not in FOOTER_STATUSES:
                return bad(i, f"the footer's status {event.get('status')!r} is not one of {FOOTER_STATUSES}")
        prev = h
    if footer_at is None:
        return Verdict(False, n, f"line {n}: the trace ends without a footer: it is truncated after line {n}",
                       n, signed, key is not None)
    mac = ("HMAC-signed; every mac checked with the key" if key is not None
           else "HMAC-signed; macs NOT checked (give --key-env)" if signed else "")
    how = "; ".join(x for x in (mac, sig.describe()) if x) or "unsigned"
    footer = trace.events[footer_at] or {}
    last = interrupted_at(footer)
    end = "" if last is None else f"; the run was interrupted at token {last} (its last complete token)"
    return Verdict(True, n, f"intact: {n} lines, hash chain unbroken, {how}{end}", None, signed, key is not None,
                   last, sig.algorithm, sig.fingerprint, sig.given)


def _header_signature(header: dict[str, Any], public_key: Any) -> _Signature | str:
    """The header's signature facts, checked (and against `public_key` when given); a string says what is wrong."""
    algorithm = header.get("signature_algorithm")
    if algorithm is None:
        if public_key is not None:
            return ("the trace is not signed (its header names no signature_algorithm), so it cannot be "
                    "authenticated with a public key")
        return _Signature(None)
    from tracelm.io.trace_keys import ALGORITHM, fingerprint, public_key_from_hex

    if algorithm != ALGORITHM:
        return f"signature_algorithm {str(algorithm)[:40]!r} is not one this tracelm checks ({ALGORITHM!r})"
    named = public_key_from_hex(header.get("public_key"))
    if named is None or fingerprint(named) != header.get("public_key_sha256"):
        return "the header's public_key is not a 32-byte Ed25519 key whose sha256 is its public_key_sha256"
    sig = _Signature(algorithm, named, fingerprint(named), public_key is not None)
    if public_key is not None and fingerprint(public_key) != sig.fingerprint:
        return (f"signed with key {sig.short}, not with the given public key {fingerprint(public_key)[:16]}: "
                "the trace was signed by someone else (or re-signed after an edit)")
    return sig


def _signature_problem(sig: _Signature, event: dict[str, Any], chain_hash: str, signature: bytes | None
                       ) -> str | None:
    """What is wrong with a line's signature (only a signed trace's footer carries one, over its hash), or None."""
    footer = event.get("event") == "footer"
    if signature is not None and not (footer and sig.algorithm):
        return "a signature (sig) where none belongs: only a signed trace's footer carries one"
    if not footer or sig.algorithm is None:
        return None
    if signature is None:
        return "the footer of a signed trace has no signature (sig): it was re-chained without the key"
    from tracelm.io.trace_keys import signature_valid

    if not signature_valid(sig.key, chain_hash, signature.decode("ascii")):
        return (f"the footer's signature does not match its chain hash with key {sig.short}: a line was edited "
                "and the chain recomputed, or the signature was copied from another trace")
    return None


def footer_status(footer: dict[str, Any]) -> str:
    """A footer's status: "complete" (also a version 2 footer, which has none) or "interrupted"."""
    return footer.get("status", "complete")


def interrupted_at(footer: dict[str, Any]) -> int | None:
    """The last complete token of an interrupted run's footer (-1 when it stopped before the first), else None."""
    if footer_status(footer) != "interrupted":
        return None
    last = footer.get("last_token")
    return last if isinstance(last, int) and not isinstance(last, bool) else -1


def summary(trace: Trace, top_layers: int = 5) -> str:
    """A readable summary: prompt, output, time per stage kind and the hottest layers."""
    h = trace.header
    events = [e for e in trace.events if e is not None]
    stages = [e for e in events if e.get("event") == "stage"]
    tokens = [e for e in events if e.get("event") == "token"]
    footer = next((e for e in events if e.get("event") == "footer"), None)
    s = _mapping(_mapping(h.get("config")).get("sampling"))
    blas = [b for b in h.get("blas") or [] if isinstance(b, dict)] if isinstance(h.get("blas"), list) else []
    prompt_ids = h.get("prompt_ids")
    out = [
        f"trace      {trace.path} (format {h.get('format')} v{h.get('trace_version')}, level {h.get('level')}, "
        f"{'signed' if h.get('mac_algorithm') or h.get('signature_algorithm') else 'unsigned'})",
        f"integrity  {verify(trace).message}",
        f"model      {h.get('model_file')}  sha256 {str(h.get('model_sha256'))[:16]}...",
        f"tracelm    {h.get('tracelm_version')}  numpy {_mapping(h.get('packages')).get('numpy')}  "
        f"{_mapping(h.get('platform')).get('machine')}  BLAS "
        + ", ".join(f"{b.get('internal_api')} {b.get('version')} x{b.get('num_threads')}" for b in blas),
        f"sampling   temperature {s.get('temperature')} top_k {s.get('top_k')} top_p {s.get('top_p')} "
        f"min_p {s.get('min_p')} seed {h.get('seed')} ({_mapping(h.get('rng')).get('generator')})",
        f"prompt     {len(prompt_ids) if isinstance(prompt_ids, list) else 0} tokens: {h.get('prompt_text')!r}",
    ]
    c = s.get("constraint")
    if isinstance(c, dict):  # a constrained run: the grammar, and the digest its token events name
        digest = next((t.get("constraint") for t in tokens if t.get("constraint")), None)
        out.insert(-1, f"constraint {c.get('kind')} ({len(str(c.get('source', '')))} characters, digest {digest}): "
                       f"{str(c.get('source', ''))[:60]!r}")
    if s.get("logit_bias"):
        out.insert(-1, f"logit_bias {s.get('logit_bias')}")
    text = footer.get("output_text") if footer else None
    if text is None:
        text = "".join(str(t.get("text", t.get("piece", ""))) for t in tokens)
    finish = footer.get("finish_reason") if footer else "unknown (no footer)"
    out.append(f"output     {len(tokens)} tokens ({finish}): {text!r}")
    if footer:
        n_gen, dec = _real(footer.get("n_generated")), _real(footer.get("decode_seconds"))
        rate = f", decode {decode_rate(n_gen, dec):.1f} tok/s" if dec else ""
        out.append(f"time       prefill {_real(footer.get('prefill_seconds')):.3f} s, decode {dec:.3f} s{rate} "
                   f"(with tracing)")
    if not stages:
        return "\n".join(out)
    by_stage: dict[str, list[float]] = {}
    by_layer: dict[int, float] = {}
    for e in stages:
        us = _real(e.get("dur_us"))
        by_stage.setdefault(str(e.get("stage")), []).append(us)
        if isinstance(e.get("layer"), int):
            by_layer[e["layer"]] = by_layer.get(e["layer"], 0.0) + us
    total = sum(sum(v) for v in by_stage.values()) or 1.0
    out += ["", f"{'stage':16s} {'calls':>7s} {'total ms':>10s} {'mean us':>9s} {'share':>7s}"]
    for name, v in sorted(by_stage.items(), key=lambda kv: -sum(kv[1])):
        out.append(f"{name:16s} {len(v):7d} {sum(v) / 1000:10.2f} {sum(v) / len(v):9.1f} {sum(v) / total:7.1%}")
    out.append(f"{'all stages':16s} {len(stages):7d} {total / 1000:10.2f}")
    if by_layer:
        out += ["", f"hottest layers (of {len(by_layer)}):"]
        for layer, us in sorted(by_layer.items(), key=lambda kv: -kv[1])[:top_layers]:
            out.append(f"  layer {layer:3d}  {us / 1000:9.2f} ms  {us / total:6.1%}")
    return "\n".join(out)


def _mapping(value: Any) -> dict[str, Any]:
    """A header field that should be a JSON object, or {} (a summary shows what an edited trace holds, never fails)."""
    return value if isinstance(value, dict) else {}


def _real(value: Any) -> float:
    """A numeric field as a float; 0.0 when it is not a finite number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0.0
    return float(value) if math.isfinite(value) else 0.0
