"""The verdict an auditor acts on (docs/trust.md): how far a trace is to be trusted, under the auditor's policy.

Levels, worst to best (policy.LEVELS):

    broken     the hash chain breaks (the first bad line is named)
    intact     the chain is whole, but nothing authenticated who wrote it (unsigned; or HMAC-signed and the macs not
               checked, without the secret)
    signed     signed (Ed25519) by a key the policy does not name: whoever holds that key wrote it
    trusted    signed by a key the policy names, or HMAC-signed and every mac checked with the secret the auditor gave
    attested   signed by a key that attestation evidence binds, the evidence meeting the policy (the key never left a
               TEE that measured what the policy expects)

A verdict at or above the policy's `require` exits 0; below it, each verdict has its own exit status (EXIT), and a
refused attestation its refusal's (attest.REFUSALS). Exit 2 stays "not a trace" (or bad input).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import attrs

from tracelm.audit.attest import REFUSALS, Checks, Refusal, Step, check_binding, check_report_data, verify_evidence
from tracelm.audit.policy import LEVELS, Policy
from tracelm.audit.verify import Trace, Verdict, verify
from tracelm.io.attest import certs
from tracelm.io.attest.binding import parse_nonce
from tracelm.state.errors import EvidenceFormatError, PolicyError

EXIT = {"broken": 1, "intact": 3, "signed": 4}  # below the required level; "trusted" below "attested": its refusal


@attrs.frozen
class TrustVerdict:
    """A trace's level under a policy, whether it meets the policy's requirement, the exit status, the one line that
    says so, and every step checked."""

    level: str
    require: str
    exit_status: int
    headline: str
    steps: tuple[Step, ...]
    chain: Verdict | None  # None: a verdict on evidence alone (`attest verify`)
    refusal: str | None = None  # the attestation refusal's kind (attest.REFUSALS), when one was refused
    basis: str = ""  # what a trusted verdict rests on: "key" (the policy names it) or "hmac" (the secret given)

    @property
    def ok(self) -> bool:
        return self.exit_status == 0

    def lines(self) -> list[str]:
        """The headline, then each step: [ok], [FAIL], or [--] for a fact that neither passes nor fails."""
        mark = {True: "ok", False: "FAIL", None: "--"}
        return [self.headline, *(f"  [{mark[s.ok]}] {s.name}" + (f": {s.detail}" if s.detail else "")
                                 for s in self.steps)]

    def describe(self) -> str:
        """`lines`, then what the exit status means when it is not 0."""
        lines = self.lines()
        if not self.ok:
            lines.append(f"exit {self.exit_status}: {self.level}, below the required level {self.require!r}"
                         if self.level in LEVELS[1:] else f"exit {self.exit_status}: {self.level}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {"level": self.level, "require": self.require, "ok": self.ok, "exit_status": self.exit_status,
                "headline": self.headline, "refusal": self.refusal, "basis": self.basis,
                "steps": [s.as_dict() for s in self.steps]}


def judge(trace: Trace, policy: Policy, hmac_key: bytes | None = None, hmac_name: str | None = None) -> TrustVerdict:
    """The verdict on `trace` under `policy`: its chain (with `hmac_key`, every mac), its signature, whether the
    policy trusts the key, and (when the policy names attestation requirements) the evidence in its header."""
    header = trace.header
    hmac_signed = header.get("mac_algorithm") is not None
    chain = verify(trace, hmac_key if hmac_signed else None)
    steps = [Step("hash chain", chain.intact, chain.message)]
    if not chain.intact:
        return _verdict("broken", policy, f"broken at line {chain.bad_line}: {chain.message}", steps, chain)
    mac_checked = hmac_signed and hmac_key is not None
    steps += _signing_steps(chain, policy, hmac_signed, mac_checked, hmac_key is not None, hmac_name)
    what, refusal = None, None
    if policy.attests and chain.key_fingerprint is not None:
        checks = Checks()
        try:
            what = _attest(checks, header, policy)
        except Refusal as r:
            refusal = r
        steps += checks.steps
    elif header.get("attestation") is not None:
        steps.append(Step("attestation", None, "the trace carries evidence; not checked: the policy names no "
                                               "attestation requirements"))
    key = f"key {str(chain.key_fingerprint)[:16]}"
    if what is not None:
        return _verdict("attested", policy, f"attested ({what}): signed by {key}, which the evidence binds", steps,
                        chain, basis="evidence")
    level, basis, line = _unattested(chain, policy, hmac_signed, mac_checked, hmac_name)
    if refusal is not None:
        line += f"; not attested: {refusal.message}"
    return _verdict(level, policy, line, steps, chain, refusal, basis)


def _signing_steps(chain: Verdict, policy: Policy, hmac_signed: bool, mac_checked: bool, secret_given: bool,
                   hmac_name: str | None) -> list[Step]:
    """The steps that say what signed an intact trace: its macs, its Ed25519 signature, whether the policy names
    the key."""
    steps = []
    if hmac_signed:
        steps.append(Step("HMAC", True if mac_checked else None, f"every mac checked with the secret in "
                          f"{hmac_name or 'the key given'}" if mac_checked else "macs not checked: no secret given "
                          "(--key-env)"))
    elif secret_given:
        steps.append(Step("HMAC", None, "the trace carries no macs: the secret given authenticates nothing"))
    fp = chain.key_fingerprint
    if fp is None:
        return [*steps, Step("signature", None, "none (no signature_algorithm in the header)")]
    named = policy.keys.get(fp)
    return [*steps, Step("signature", True, f"{chain.signature_algorithm}, key {fp[:16]}, verified over the footer's "
                                            "chain hash"),
            Step("key trusted by the policy", True if named else None, f"named by {named}" if named else
                 f"key {fp[:16]} is not named by {policy.source}")]


def _unattested(chain: Verdict, policy: Policy, hmac_signed: bool, mac_checked: bool,
                hmac_name: str | None) -> tuple[str, str, str]:
    """An intact trace's level short of attested, what it rests on, and its headline."""
    fp, key = chain.key_fingerprint, f"key {str(chain.key_fingerprint)[:16]}"
    if fp is not None and fp in policy.keys:
        return "trusted", "key", f"trusted: signed by {key} ({chain.signature_algorithm}), named by {policy.keys[fp]}"
    if mac_checked:
        return "trusted", "hmac", f"trusted: HMAC-signed, every mac checked with the secret in {hmac_name or 'the key'}"
    if fp is not None:
        return "signed", "", (f"signed by {key} ({chain.signature_algorithm}), which {policy.source} does not trust: "
                              "it shows who holds that key wrote it, not who that is")
    return "intact", "", ("intact but unsigned: the hash chain shows the trace is whole, not who wrote it; "
                          + ("its macs were not checked (no secret given): " if hmac_signed else "")
                          + "nothing was authenticated")


def verify_document(path: str | os.PathLike, policy: Policy, nonce_hex: str | None = None) -> TrustVerdict:
    """`tracelm attest verify FILE`: an attestation document (GET /v1/attestation's answer: binding and evidence)
    checked as a trace's header evidence is, its binding naming `nonce_hex` when given; or raw evidence (an SEV-SNP
    report, a TDX quote), checked alone (its report data shown, no binding)."""
    if not policy.attests:
        raise PolicyError(f"attest verify: {policy.source} names no attestation requirements (attestation: tpm, snp "
                          "or tdx)")
    data = certs.read_file(path, "evidence")
    nonce = parse_nonce(nonce_hex, "--nonce") if nonce_hex is not None else None
    checks = Checks()
    try:
        if data.lstrip()[:1] == b"{":
            try:
                document = json.loads(data)
            except (ValueError, UnicodeDecodeError, RecursionError):
                raise EvidenceFormatError(f"{path}: not JSON (an attestation document is GET /v1/attestation's "
                                          "answer)") from None
            binding, evidence = check_binding(checks, document, None, None, nonce)
            report_data, what = verify_evidence(checks, evidence, policy)
            check_report_data(checks, report_data, binding)
            line = (f"attested ({what}): trace key {hashlib.sha256(binding.public_key).hexdigest()[:16]} is bound to "
                    "this evidence" + (", made for your nonce" if nonce is not None else ""))
        else:
            kind = "tdx_guest" if data[:2] == b"\x04\x00" and data[4:5] == b"\x81" else "sev_guest"
            report_data, what = verify_evidence(checks, {"provider": "tsm", "tsm_provider": kind,
                                                         "outblob": data.hex()}, policy)
            checks.note("report data", report_data.hex())
            line = f"evidence verified ({what}); its report data binds no tracelm key (raw evidence)"
    except Refusal as r:
        return TrustVerdict("refused", "attested", REFUSALS[r.kind], f"not attested: {r.message}",
                            tuple(checks.steps), None, r.kind)
    return TrustVerdict("attested", "attested", 0, line, tuple(checks.steps), None)


def _attest(checks: Checks, header: dict[str, Any], policy: Policy) -> str:
    binding, evidence = check_binding(checks, header.get("attestation"), header.get("public_key"), header, None)
    report_data, what = verify_evidence(checks, evidence, policy)
    check_report_data(checks, report_data, binding)
    return what


def _verdict(level: str, policy: Policy, headline: str, steps: list[Step], chain: Verdict,
             refusal: Refusal | None = None, basis: str = "") -> TrustVerdict:
    meets = LEVELS.index(level) >= LEVELS.index(policy.require)
    if meets:
        status = 0
    elif refusal is not None:
        status = REFUSALS[refusal.kind]
    else:
        status = EXIT.get(level, REFUSALS["no_evidence"])
    return TrustVerdict(level, policy.require, status, headline, tuple(steps), chain,
                        None if refusal is None else refusal.kind, basis)
