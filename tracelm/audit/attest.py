"""Verifying attestation evidence against an auditor's policy (docs/trust.md), offline, with `cryptography`:

- `check_binding`: a trace's (or an attestation document's) evidence binds the key that signed it: the binding
  names that key, the header's tracelm version and model, the evidence's report data is the binding's (its nonce
  half first, so a replayed quote is named as such);
- `verify_tpm`: a TPM 2.0 quote signed by a restricted attestation key that the policy names (or whose certificate
  chains to the policy's CA), its PCR values hashing to the signed digest and equal to the policy's;
- `verify_snp`: an SEV-SNP report signed by a VCEK that chains to AMD's ARK (via the ASK), issued for the report's
  chip and TCB, with the measurement, VMPL, debug bit and TCB the policy names;
- `verify_tdx`: a TDX quote signed by an attestation key that the quoting enclave's report binds, that report
  signed by a PCK certificate chaining to Intel's root (CRLs checked), the TCB status from Intel's signed TCB info,
  optionally the QE identity, and the TD measurements the policy names.

Every check is a named `Step`; the first that fails stops the verification with a `Refusal`, whose kind (one of
REFUSALS) decides the exit status (tracelm/audit/trust.py).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import warnings
from collections.abc import Callable
from typing import Any

import attrs
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa

from tracelm.audit.policy import Policy, SnpPolicy, TdxPolicy, TpmPolicy
from tracelm.io.attest import certs, snp, tdx, tpm
from tracelm.io.attest.binding import Binding, binding_from_dict
from tracelm.state.errors import EvidenceFormatError

# why attestation was refused -> the exit status of `trace verify` / `replay` / `attest verify`
REFUSALS = {
    "no_evidence": 5,  # the trace carries no evidence (a key signing for itself)
    "evidence_invalid": 6,  # evidence that does not parse, or whose signature or certificate chain fails
    "other_platform": 7,  # evidence from another TPM (another AK) or chip than the policy names
    "measurement": 8,  # a PCR, measurement, TCB or debug setting other than the policy's
    "stale_nonce": 9,  # evidence made for another nonce: replayed
    "other_key": 10,  # evidence over another key (or version, or model): its report data is not this binding
    "key_not_in_evidence": 11,  # the trace is signed by another key than the one the evidence binds
}
HASH = {"sha1": hashes.SHA1, "sha256": hashes.SHA256, "sha384": hashes.SHA384, "sha512": hashes.SHA512}


@attrs.frozen
class Step:
    name: str
    ok: bool | None  # None: a fact shown, neither passed nor failed (e.g. a key the policy does not name, when
    detail: str = ""  # the evidence may still attest it)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "detail": self.detail}


class Refusal(Exception):
    """A failed step: its refusal kind (REFUSALS) and the one line that says why."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind, self.message = kind, message


class Checks:
    """The steps of one verification, in order; `check` records one and raises a Refusal when it fails."""

    def __init__(self) -> None:
        self.steps: list[Step] = []

    def check(self, name: str, ok: bool, detail: str, kind: str) -> None:
        self.steps.append(Step(name, ok, detail))
        if not ok:
            raise Refusal(kind, f"{name}: {detail}")

    def note(self, name: str, detail: str) -> None:
        self.steps.append(Step(name, True, detail))

    def parse(self, name: str, fn: Callable[[], Any]) -> Any:
        """fn() (a parser); its EvidenceFormatError fails the step as evidence_invalid."""
        try:
            value = fn()
        except EvidenceFormatError as e:
            self.steps.append(Step(name, False, str(e)))
            raise Refusal("evidence_invalid", f"{name}: {e}") from None
        self.note(name, "parsed")
        return value


def _signed(key: Any, signature: bytes, data: bytes, digest: str = "sha256", pss: bool = False) -> bool:
    """Whether `signature` over `data` verifies with `key` (ECDSA, or RSA PKCS#1 v1.5 / PSS)."""
    try:
        if isinstance(key, ec.EllipticCurvePublicKey):
            key.verify(signature, data, ec.ECDSA(HASH[digest]()))
        elif isinstance(key, rsa.RSAPublicKey):
            pad = padding.PSS(padding.MGF1(HASH[digest]()), padding.PSS.AUTO) if pss else padding.PKCS1v15()
            key.verify(signature, data, pad, HASH[digest]())
        else:
            return False
    except (InvalidSignature, ValueError):
        return False
    return True


def _issued_by(child: x509.Certificate, parent: x509.Certificate) -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            child.verify_directly_issued_by(parent)
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True


def _is_ca(cert: x509.Certificate) -> bool:
    try:
        return bool(cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca)
    except x509.ExtensionNotFound:
        return False


def _valid_at(cert: x509.Certificate, at: dt.datetime) -> bool:
    return cert.not_valid_before_utc <= at <= cert.not_valid_after_utc


def _name(cert: x509.Certificate) -> str:
    cn = cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
    return str(cn[0].value) if cn else cert.subject.rfc4514_string()


def _chain(checks: Checks, name: str, chain: list[x509.Certificate], root: x509.Certificate, at: dt.datetime) -> None:
    """chain[0] issued by chain[1], ..., the last one issued by `root` (the policy's anchor, self-signed), each
    valid at `at`."""
    path = [*chain, root]
    checks.check(f"{name}: root self-signed", _issued_by(root, root), _name(root), "evidence_invalid")
    for child, parent in zip(path, path[1:], strict=False):
        ok = _issued_by(child, parent)
        checks.check(f"{name}: {_name(child)} issued by {_name(parent)}", ok,
                     "signature verified" if ok else "not signed by it", "evidence_invalid")
        checks.check(f"{name}: {_name(parent)} is a CA", _is_ca(parent), "basic constraints: CA" if _is_ca(parent)
                     else "not a CA certificate: it may not issue others", "evidence_invalid")
    for cert in path:
        checks.check(f"{name}: {_name(cert)} valid", _valid_at(cert, at),
                     f"{cert.not_valid_before_utc:%Y-%m-%d} to {cert.not_valid_after_utc:%Y-%m-%d}, checked at "
                     f"{at:%Y-%m-%d}", "evidence_invalid")


# -- the binding -----------------------------------------------------------------------------------------------------


def check_binding(checks: Checks, document: Any, signing_key: str | None, header: dict[str, Any] | None,
                  nonce: bytes | None) -> tuple[Binding, dict[str, Any]]:
    """The binding of an attestation document ({"binding", "evidence"}: a trace header's `attestation`, or GET
    /v1/attestation's answer), before the evidence itself: present, naming `signing_key` (hex, the trace's key),
    the header's tracelm version and model, and `nonce` when the caller asked with one."""
    present = isinstance(document, dict) and isinstance(document.get("evidence"), dict)
    checks.check("evidence present", present, "attestation evidence and its binding" if present else
                 "the attestation holds no evidence object" if isinstance(document, dict) else
                 "the trace carries no attestation evidence: its key vouches only for itself", "no_evidence")
    binding = checks.parse("binding", lambda: binding_from_dict(document.get("binding")))
    if signing_key is not None:
        same = binding.public_key.hex() == signing_key
        signer = _fingerprint(signing_key)
        checks.check("binding names the signing key", same, f"key {signer}" if same else
                     f"the trace is signed by key {signer}, the evidence binds key "
                     f"{hashlib.sha256(binding.public_key).hexdigest()[:16]}", "key_not_in_evidence")
    if header is not None:
        for field in ("tracelm_version", "model_sha256"):
            same = getattr(binding, field) == header.get(field)
            checks.check(f"binding names the run's {field}", same, str(header.get(field)) if same else
                         f"the evidence binds {getattr(binding, field)}, the trace ran {header.get(field)}",
                         "other_key")
    if nonce is not None:
        same = binding.nonce == nonce
        checks.check("binding names your nonce", same, nonce.hex() if same else
                     f"the evidence answers nonce {binding.nonce.hex()[:32]}, you sent {nonce.hex()[:32]}: replayed",
                     "stale_nonce")
    return binding, document["evidence"]


def check_report_data(checks: Checks, report_data: bytes, binding: Binding) -> None:
    """The evidence's report data is the binding's: the nonce half first (a quote made for another nonce is a
    replay), then the half that commits to key, version, model and nonce."""
    want = binding.report_data()
    checks.check("report data: nonce", hmac.compare_digest(report_data[32:], want[32:]),
                 f"sha256 of nonce {binding.nonce.hex()[:32]}" if report_data[32:] == want[32:] else
                 "the evidence was made for another nonce (a replayed quote)", "stale_nonce")
    checks.check("report data: key, version, model", hmac.compare_digest(report_data[:32], want[:32]),
                 f"sha256 of the binding of key {hashlib.sha256(binding.public_key).hexdigest()[:16]}"
                 if report_data[:32] == want[:32]
                 else "the evidence is over another key, tracelm version or model than the binding names",
                 "other_key")


def verify_evidence(checks: Checks, evidence: dict[str, Any], policy: Policy) -> tuple[bytes, str]:
    """The evidence's own checks under the policy; returns the report data it attests and a short description
    ("tpm, AK 1b20..., PCRs sha256:0,23")."""
    provider = evidence.get("provider")
    if provider == "tpm" and policy.tpm is not None:
        return verify_tpm(checks, evidence, policy.tpm, policy.at())
    if provider == "tsm":
        kind = evidence.get("tsm_provider")
        blob = checks.parse("evidence encoding", lambda: _hex_bytes(evidence.get("outblob"), "outblob"))
        if kind == "sev_guest" and policy.snp is not None:
            aux = checks.parse("certificate table", lambda: snp.cert_table(_hex_bytes(evidence.get("auxblob") or "",
                                                                                      "auxblob")))
            return verify_snp(checks, blob, policy.snp, policy.at(), aux)
        if kind == "tdx_guest" and policy.tdx is not None:
            return verify_tdx(checks, blob, policy.tdx, policy.at())
        provider = f"tsm ({kind})"
    names = [n for n, p in (("tpm", policy.tpm), ("snp", policy.snp), ("tdx", policy.tdx)) if p is not None]
    checks.check("evidence kind", False, f"{provider} evidence; the policy accepts {', '.join(names) or 'none'}",
                 "other_platform")
    raise AssertionError  # unreachable: the check above raised


def _fingerprint(public_key_hex: str) -> str:
    """A raw public key's fingerprint as messages show it (sha256, first 16 hex digits)."""
    try:
        return hashlib.sha256(bytes.fromhex(public_key_hex)).hexdigest()[:16]
    except ValueError:
        return public_key_hex[:16]


def _hex_bytes(text: Any, what: str) -> bytes:
    try:
        return bytes.fromhex(text)
    except (TypeError, ValueError):
        raise EvidenceFormatError(f"evidence {what}: not hex") from None


# -- TPM 2.0 ---------------------------------------------------------------------------------------------------------


def verify_tpm(checks: Checks, evidence: dict[str, Any], policy: TpmPolicy, at: dt.datetime) -> tuple[bytes, str]:
    quote_raw = checks.parse("quote encoding", lambda: _hex_bytes(evidence.get("quote"), "quote"))
    quote = checks.parse("quote (TPMS_ATTEST)", lambda: tpm.parse_attest(quote_raw))
    sig = checks.parse("quote signature (TPMT_SIGNATURE)",
                       lambda: tpm.parse_signature(_hex_bytes(evidence.get("signature"), "signature")))
    ak = checks.parse("attestation key (TPMT_PUBLIC)",
                      lambda: tpm.parse_public(_hex_bytes(evidence.get("ak_public"), "ak_public")))
    checks.check("AK is a restricted signing key", ak.restricted_signing,
                 f"attributes 0x{ak.attributes:08x}: fixedTPM, fixedParent, sensitiveDataOrigin, restricted, sign"
                 if ak.restricted_signing else f"attributes 0x{ak.attributes:08x} lack fixedTPM, restricted or sign: "
                 "such a key can sign anything, not only what the TPM made", "evidence_invalid")
    ok = _signed(ak.key, sig.value, quote_raw, sig.hash, sig.scheme == "rsapss")
    checks.check("quote signed by the AK", ok, f"{sig.scheme}/{sig.hash} signature verified" if ok else
                 "the signature does not match the quote: the quote or its signature was changed", "evidence_invalid")
    ak_id = hashlib.sha256(certs.public_der(ak.key)).hexdigest()[:16]
    _tpm_ak_identity(checks, ak, evidence, policy, at, ak_id)
    values = checks.parse("PCR values", lambda: _pcr_values(evidence.get("pcrs"), quote.selection))
    listed = [values[bank][i] for bank, pcrs in quote.selection for i in pcrs]
    digest = tpm.pcr_digest(listed, sig.hash)
    checks.check("PCR digest", hmac.compare_digest(digest, quote.pcr_digest),
                 f"{tpm.selection_text(quote.selection)} hash to the quoted digest" if digest == quote.pcr_digest
                 else "the PCR values given do not hash to the digest the TPM signed", "evidence_invalid")
    for bank, expected in sorted(policy.pcrs.items()):
        for i, value in sorted(expected.items()):
            got = values.get(bank, {}).get(i)
            checks.check(f"PCR {bank}:{i}", got == value,
                         "as the policy names" if got == value else "not in the quote" if got is None else
                         f"{got.hex()[:16]}..., the policy names {value.hex()[:16]}...", "measurement")
    checks.check("qualifying data", len(quote.extra_data) == 64, f"{len(quote.extra_data)} bytes"
                 if len(quote.extra_data) == 64 else f"{len(quote.extra_data)} bytes, not tracelm's 64 of report data",
                 "other_key")
    pcr_text = ",".join(f"{b}:{i}" for b, v in sorted(policy.pcrs.items()) for i in sorted(v)) or "none pinned"
    return quote.extra_data, f"tpm, AK {ak_id}, PCRs {pcr_text}"


def _tpm_ak_identity(checks: Checks, ak: tpm.PublicArea, evidence: dict[str, Any], policy: TpmPolicy,
                     at: dt.datetime, ak_id: str) -> None:
    """The AK is one the policy names, or its certificate (in the evidence) chains to the policy's CA."""
    der = certs.public_der(ak.key)
    if any(certs.public_der(k) == der for k in policy.ak):
        checks.note("AK is the policy's", f"AK {ak_id}")
        return
    if not policy.ak_ca:
        checks.check("AK is the policy's", False, f"the quote is signed by AK {ak_id}, which the policy does not "
                     "name: evidence from another TPM", "other_platform")
    chain = checks.parse("AK certificate", lambda: [c for pem in evidence.get("ak_certificates") or []
                                                    for c in certs.certificates(str(pem).encode(), "AK certificate")])
    checks.check("AK certificate present", bool(chain), f"{len(chain)} certificates" if chain else
                 f"AK {ak_id} is not the policy's and the evidence carries no AK certificate", "other_platform")
    checks.check("AK certificate names the AK", certs.public_der(chain[0].public_key()) == der,
                 "its public key is the AK's" if certs.public_der(chain[0].public_key()) == der else
                 "the certificate is for another key", "other_platform")
    root = next((ca for ca in policy.ak_ca if _issued_by(chain[-1], ca) or chain[-1] == ca), None)
    checks.check("AK certificate chains to the policy's CA", root is not None, _name(root) if root else
                 f"{_name(chain[-1])} is not issued by a CA the policy names", "other_platform")
    _chain(checks, "AK certificate", [c for c in chain if c != root], root, at)  # type: ignore[arg-type]


def _pcr_values(given: Any, selection: tuple[tuple[str, tuple[int, ...]], ...]) -> dict[str, dict[int, bytes]]:
    """The evidence's PCR values ({"sha256": {"0": HEX, ...}}), exactly the quote's selection."""
    if not isinstance(given, dict):
        raise EvidenceFormatError("evidence pcrs: not a mapping of banks")
    out: dict[str, dict[int, bytes]] = {}
    for bank, pcrs in selection:
        values = given.get(bank)
        if not isinstance(values, dict):
            raise EvidenceFormatError(f"evidence pcrs: no {bank} bank, which the quote selects")
        for i in pcrs:
            out.setdefault(bank, {})[i] = _hex_bytes(values.get(str(i)), f"pcrs.{bank}.{i}")
    return out


# -- AMD SEV-SNP -----------------------------------------------------------------------------------------------------


def verify_snp(checks: Checks, raw: bytes, policy: SnpPolicy, at: dt.datetime,
               table: dict[str, bytes] | None = None) -> tuple[bytes, str]:
    """An SEV-SNP report: its VCEK (the policy's, or from the evidence's certificate table) chains to the policy's
    ARK, signs the report, and was issued for its chip and TCB; then the fields the policy names."""
    report = checks.parse("SEV-SNP report", lambda: snp.parse_report(raw))
    table = table or {}
    vcek = policy.vcek or checks.parse("VCEK", lambda: _table_cert(table, "vcek"))
    ask = policy.ask or checks.parse("ASK", lambda: _table_cert(table, "ask"))
    _chain(checks, "VCEK", [vcek, ask], policy.ark, at)
    checks.check("signature algorithm", report.signature_algo == snp.ECDSA_P384_SHA384,
                 "ECDSA P-384 with SHA-384" if report.signature_algo == 1 else
                 f"SIGNATURE_ALGO {report.signature_algo}, not ECDSA P-384 (1)", "evidence_invalid")
    ok = _signed(vcek.public_key(), report.signature, report.signed, "sha384")
    checks.check("report signed by the VCEK", ok, "ECDSA P-384 signature over bytes 0x000-0x29F verified" if ok
                 else "the signature does not match the report: the report or its signature was changed",
                 "evidence_invalid")
    hwid = checks.parse("VCEK chip id", lambda: snp.vcek_hwid(vcek))
    checks.check("VCEK issued for the report's chip", hwid == report.chip_id,
                 f"CHIP_ID {report.chip_id.hex()[:16]}..." if hwid == report.chip_id else
                 f"the VCEK is for chip {hwid.hex()[:16]}..., the report names {report.chip_id.hex()[:16]}...",
                 "other_platform")
    tcb = checks.parse("VCEK TCB", lambda: snp.vcek_tcb(vcek))
    checks.check("VCEK issued for the reported TCB", tcb == report.reported_tcb, tcb.text() if tcb ==
                 report.reported_tcb else f"the VCEK is for {tcb.text()}, the report says "
                 f"{report.reported_tcb.text()}", "evidence_invalid")
    for field, want in policy.fields.items():
        got = getattr(report, field)
        checks.check(f"{field.upper()}", got == want, "as the policy names" if got == want else
                     f"{got.hex()[:24]}..., the policy names {want.hex()[:24]}...",
                     "other_platform" if field == "chip_id" else "measurement")
    if policy.vmpl is not None:
        checks.check("VMPL", report.vmpl == policy.vmpl, f"{report.vmpl}" if report.vmpl == policy.vmpl else
                     f"{report.vmpl}, the policy names {policy.vmpl}", "measurement")
    debug = report.policy_bit("debug")
    checks.check("guest policy: debugging", policy.debug or not debug, "not allowed" if not debug else
                 "allowed (the host could read the guest's memory)" + ("" if policy.debug else
                                                                       "; the policy refuses it"), "measurement")
    if policy.min_tcb is not None:
        low = [k for k in ("bootloader", "tee", "snp", "microcode")
               if getattr(report.reported_tcb, k) < getattr(policy.min_tcb, k)]
        checks.check("TCB at least the policy's", not low, report.reported_tcb.text() if not low else
                     f"{', '.join(low)} below the policy's {policy.min_tcb.text()}", "measurement")
    return report.report_data, f"SEV-SNP, measurement {report.measurement.hex()[:16]}..., VMPL {report.vmpl}"


def _table_cert(table: dict[str, bytes], name: str) -> x509.Certificate:
    if name not in table:
        raise EvidenceFormatError(f"no {name.upper()} certificate: the policy names none and the evidence's "
                                  "certificate table has none")
    return certs.certificates(table[name], f"the evidence's {name.upper()}")[0]


# -- Intel TDX -------------------------------------------------------------------------------------------------------


def verify_tdx(checks: Checks, raw: bytes, policy: TdxPolicy, at: dt.datetime) -> tuple[bytes, str]:
    quote = checks.parse("TDX quote", lambda: tdx.parse_quote(raw))
    carried = checks.parse("PCK certificates", lambda: certs.certificates(quote.pck_chain, "PCK certificate chain")
                           if quote.pck_chain else [])
    chain = _leaf_first([c for c in [*carried, *policy.pck_chain] if c != policy.root])
    checks.check("PCK certificate present", bool(chain), _name(chain[0]) if chain else
                 "the quote carries no PCK certificate and the policy names none (pck_chain)", "evidence_invalid")
    _chain(checks, "PCK", chain, policy.root, at)
    _crls(checks, [*chain, policy.root], policy.crls, at)
    pck = checks.parse("PCK SGX extension", lambda: tdx.pck_info(chain[0]))
    ok = _signed(chain[0].public_key(), quote.qe_report_signature, quote.qe_report.raw)
    checks.check("QE report signed by the PCK key", ok, "ECDSA P-256 verified" if ok else
                 "the QE report or its signature was changed", "evidence_invalid")
    bound = hashlib.sha256(quote.attestation_key_raw + quote.qe_auth_data).digest()
    checks.check("QE report binds the attestation key", hmac.compare_digest(quote.qe_report.report_data[:32], bound)
                 and not any(quote.qe_report.report_data[32:]), "sha256(attestation key || QE auth data)"
                 if quote.qe_report.report_data[:32] == bound else "the QE report data is not the attestation key's "
                 "hash", "evidence_invalid")
    ok = _signed(quote.attestation_key, quote.signature, quote.signed)
    checks.check("quote signed by the attestation key", ok, "ECDSA P-256 over header and TD report verified" if ok
                 else "the quote or its signature was changed", "evidence_invalid")
    status = _tdx_tcb(checks, quote, pck, policy, at)
    if policy.qe_identity is not None:
        _qe_identity(checks, quote.qe_report, policy, at)
    for field, want in policy.fields.items():
        got = quote.body["mrseam" if field == "mrseam" else field]
        checks.check(field.upper(), got == want, "as the policy names" if got == want else
                     f"{got.hex()[:24]}..., the policy names {want.hex()[:24]}...", "measurement")
    debug = bool(quote.body["td_attributes"][0] & 1)
    checks.check("TD attributes: debugging", policy.debug or not debug, "off" if not debug else
                 "on (the host could read the TD's memory)" + ("" if policy.debug else "; the policy refuses it"),
                 "measurement")
    return quote.body["report_data"], f"TDX, MRTD {quote.body['mrtd'].hex()[:16]}..., TCB {status}"


def _leaf_first(chain: list[x509.Certificate]) -> list[x509.Certificate]:
    """Certificates ordered from the leaf (issuer of none of the others) up, each followed by its issuer."""
    unique = list(dict.fromkeys(chain))
    issuers = {c.issuer for c in unique}
    leaf = next((c for c in unique if c.subject not in issuers), None)
    ordered = [leaf] if leaf is not None else []
    while ordered:
        parent = next((c for c in unique if c.subject == ordered[-1].issuer and c not in ordered), None)
        if parent is None:
            break
        ordered.append(parent)
    return ordered


def _crls(checks: Checks, path: list[x509.Certificate], crls: tuple[x509.CertificateRevocationList, ...],
          at: dt.datetime) -> None:
    for crl in crls:
        issuer = next((c for c in path if c.subject == crl.issuer), None)
        checks.check(f"CRL of {crl.issuer.rfc4514_string()[-40:]}", issuer is not None and
                     crl.is_signature_valid(issuer.public_key()),  # type: ignore[arg-type]
                     "signed by its issuer" if issuer is not None else "its issuer is not in the chain",
                     "evidence_invalid")
        if crl.next_update_utc is not None and crl.next_update_utc < at:
            checks.check(f"CRL of {_name(issuer)} current", False,  # type: ignore[arg-type]
                         f"next update {crl.next_update_utc:%Y-%m-%d} is past", "evidence_invalid")
        for cert in path:
            revoked = crl.get_revoked_certificate_by_serial_number(cert.serial_number)
            if cert.issuer == crl.issuer and revoked is not None:
                checks.check(f"{_name(cert)} not revoked", False, f"revoked on {revoked.revocation_date_utc:%Y-%m-%d}",
                             "evidence_invalid")
    if crls:
        checks.note("revocation", f"{len(crls)} CRLs checked, no certificate of the chain revoked")


def _signed_collateral(checks: Checks, data: bytes, key: str, name: str, policy: TdxPolicy,
                       at: dt.datetime) -> dict[str, Any]:
    """Intel's signed JSON: its signature by the TCB signing certificate, which chains to the root."""
    doc = checks.parse(name, lambda: tdx.signed_json(data, key, name))
    signer = _leaf_first([c for c in policy.tcb_sign_chain if c != policy.root])
    checks.check(f"{name} signing certificate", bool(signer), _name(signer[0]) if signer else "none in the chain",
                 "evidence_invalid")
    _chain(checks, f"{name} signer", signer, policy.root, at)
    ok = _signed(signer[0].public_key(), doc.signature, doc.body)
    checks.check(f"{name} signed by Intel", ok, f"signed by {_name(signer[0])}" if ok else
                 f"the {name} or its signature was changed", "evidence_invalid")
    return doc.value


def _svn(component: Any) -> int:
    """A TCB component's SVN as one byte (TEE_TCB_SVN and the PCK certificate hold bytes; Intel's sample
    collateral writes a byte of 128 or more sign-extended to 16 bits, e.g. 193 as 65473)."""
    return int(component.get("svn", 0)) & 0xFF if isinstance(component, dict) else 0


def _tdx_tcb(checks: Checks, quote: tdx.TdxQuote, pck: tdx.PckInfo, policy: TdxPolicy, at: dt.datetime) -> str:
    """The TCB status: the first level of the signed TCB info that the platform (the PCK certificate's SGX
    components and PCESVN) and the TDX module (TEE_TCB_SVN) meet."""
    info = _signed_collateral(checks, policy.tcb_info, "tcbInfo", "TCB info", policy, at)
    fmspc, pceid = str(info.get("fmspc", "")).lower(), str(info.get("pceId", "")).lower()
    checks.check("TCB info is for this platform", fmspc == pck.fmspc.hex() and pceid == pck.pceid.hex(),
                 f"FMSPC {fmspc}, PCE id {pceid}" if fmspc == pck.fmspc.hex() else
                 f"the TCB info is for FMSPC {fmspc}, the PCK certificate names {pck.fmspc.hex()}", "evidence_invalid")
    svn = quote.body["tee_tcb_svn"]
    module = info.get("tdxModule") or {}
    seam_ok = (str(module.get("mrsigner", "")).lower() in ("", quote.body["mrsignerseam"].hex()))
    checks.check("TDX module signer", seam_ok, "MRSIGNERSEAM as the TCB info names" if seam_ok else
                 "MRSIGNERSEAM is not the TDX module signer the TCB info names", "measurement")
    for level in info.get("tcbLevels") or []:
        tcb = level.get("tcb") or {}
        sgx_ok = all(pck.components[i] >= _svn(c) for i, c in enumerate((tcb.get("sgxtcbcomponents") or [])[:16]))
        tdx_ok = all(svn[i] >= _svn(c) for i, c in enumerate((tcb.get("tdxtcbcomponents") or [])[:16]))
        if sgx_ok and tdx_ok and pck.pcesvn >= int(tcb.get("pcesvn", 0)):
            status = str(level.get("tcbStatus"))
            checks.check("TCB status", status in policy.tcb_status, f"{status} (level of {level.get('tcbDate')})"
                         if status in policy.tcb_status else f"{status}; the policy accepts "
                         f"{', '.join(policy.tcb_status)}", "measurement")
            return status
    checks.check("TCB status", False, "no TCB level of the TCB info matches the platform: not supported",
                 "measurement")
    raise AssertionError  # unreachable


def _qe_identity(checks: Checks, qe: tdx.QeReport, policy: TdxPolicy, at: dt.datetime) -> None:
    """The quoting enclave is Intel's: its report matches the signed QE identity (MISCSELECT, ATTRIBUTES under
    their masks, MRSIGNER, ISVPRODID), and its ISVSVN has a level with an UpToDate status."""
    ident = _signed_collateral(checks, policy.qe_identity or b"", "enclaveIdentity", "QE identity", policy, at)

    def masked(value: bytes, want: str, mask: str) -> bool:
        try:
            w, m = bytes.fromhex(want), bytes.fromhex(mask)
        except ValueError:
            return False
        return len(w) == len(m) == len(value) and all(a & c == b & c for a, b, c in zip(value, w, m, strict=True))

    fields = {"MISCSELECT": masked(qe.miscselect, ident.get("miscselect", ""),
                                   ident.get("miscselectMask", "")),
              "ATTRIBUTES": masked(qe.attributes, ident.get("attributes", ""), ident.get("attributesMask", "")),
              "MRSIGNER": qe.mrsigner.hex() == str(ident.get("mrsigner", "")).lower(),
              "ISVPRODID": qe.isvprodid == ident.get("isvprodid")}
    bad = [k for k, ok in fields.items() if not ok]
    checks.check("QE report matches the QE identity", not bad, "MISCSELECT, ATTRIBUTES, MRSIGNER, ISVPRODID"
                 if not bad else f"{', '.join(bad)} differ" + (f" (the QE's MRSIGNER is {qe.mrsigner.hex()[:16]}..., "
                                                               f"the identity names {str(ident.get('mrsigner'))[:16]}"
                                                               "...)" if "MRSIGNER" in bad else ""),
                 "evidence_invalid")
    level = next((lv for lv in ident.get("tcbLevels") or [] if qe.isvsvn >= int((lv.get("tcb") or {}).get("isvsvn",
                                                                                                          0))), None)
    status = str(level.get("tcbStatus")) if level else "no matching level"
    checks.check("QE TCB status", status == "UpToDate", f"ISVSVN {qe.isvsvn}: {status}", "measurement")
