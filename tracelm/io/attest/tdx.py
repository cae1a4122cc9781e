"""Intel TDX quotes, version 4 (Intel TDX DCAP Quote Generation Library and Quote Verification Library, "Quote
Format"), the SGX extension of a PCK certificate, and Intel's signed collateral (TCB info, QE identity).

A quote is little-endian:

    header (48)     version (2) = 4, attestation key type (2) = 2 (ECDSA P-256), TEE type (4) = 0x81 (TDX),
                    QE SVN (2), PCE SVN (2), QE vendor id (16), user data (20)
    TD report (584) TEE_TCB_SVN (16), MRSEAM (48), MRSIGNERSEAM (48), SEAMATTRIBUTES (8), TDATTRIBUTES (8),
                    XFAM (8), MRTD (48), MRCONFIGID (48), MROWNER (48), MROWNERCONFIG (48), RTMR0-3 (48 each),
                    REPORTDATA (64)
    signature data length (4), then: the quote signature (64: r, s big-endian, ECDSA P-256 over header and TD
                    report), the attestation key (64: x, y), certification data of type 6: the QE report (384, an SGX
                    report body), its signature by the PCK key (64), QE auth data (2-byte size, data), certification
                    data of type 5: the PCK certificate chain (PEM, or DER certificates back to back)

The QE report binds the attestation key: its REPORTDATA begins with sha256(attestation key || QE auth data).
"""

from __future__ import annotations

import json
import re
from typing import Any

import attrs
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec, utils

from tracelm.io.attest import der
from tracelm.io.attest.reader import Reader
from tracelm.state.errors import EvidenceFormatError

HEADER_SIZE, BODY_SIZE = 48, 584
SIGNED_SIZE = HEADER_SIZE + BODY_SIZE
TEE_TDX, ATT_KEY_ECDSA_P256 = 0x81, 2
CERT_QE_REPORT, CERT_PCK_CHAIN = 6, 5
BODY_FIELDS = (("tee_tcb_svn", 16), ("mrseam", 48), ("mrsignerseam", 48), ("seam_attributes", 8),
               ("td_attributes", 8), ("xfam", 8), ("mrtd", 48), ("mrconfigid", 48), ("mrowner", 48),
               ("mrownerconfig", 48), ("rtmr0", 48), ("rtmr1", 48), ("rtmr2", 48), ("rtmr3", 48), ("report_data", 64))
SGX_EXTENSION = "1.2.840.113741.1.13.1"
_PCK = SGX_EXTENSION + ".2"  # its TCB: components 1-16, then PCESVN (17) and CPUSVN (18)


@attrs.frozen
class QeReport:
    """The quoting enclave's SGX report body (384 bytes)."""

    raw: bytes
    cpusvn: bytes
    miscselect: bytes  # as stored (Intel's QE identity writes it in the same byte order)
    attributes: bytes
    mrenclave: bytes
    mrsigner: bytes
    isvprodid: int
    isvsvn: int
    report_data: bytes


@attrs.frozen
class TdxQuote:
    version: int
    qe_svn: int
    pce_svn: int
    qe_vendor_id: bytes
    body: dict[str, bytes]  # the TD report's fields, as BODY_FIELDS names them
    signed: bytes  # header and TD report: what the quote signature covers
    signature: bytes  # DER (r, s)
    attestation_key: ec.EllipticCurvePublicKey
    attestation_key_raw: bytes  # x || y (64)
    qe_report: QeReport
    qe_report_signature: bytes  # DER (r, s)
    qe_auth_data: bytes
    pck_chain: bytes  # the certification data of type 5 as carried (may be empty)


@attrs.frozen
class PckInfo:
    """What a PCK certificate's SGX extension says of its platform."""

    components: tuple[int, ...]  # the 16 SGX TCB component SVNs
    pcesvn: int
    cpusvn: bytes
    pceid: bytes
    fmspc: bytes


def ecdsa_raw(sig: bytes, size: int = 32) -> bytes:
    """A raw r || s signature (big-endian) as the DER `cryptography` verifies."""
    return utils.encode_dss_signature(int.from_bytes(sig[:size], "big"), int.from_bytes(sig[size:2 * size], "big"))


def parse_qe_report(raw: bytes) -> QeReport:
    r = Reader(raw, "QE report", "little")
    cpusvn, misc = r.take(16, "CPUSVN"), r.take(4, "MISCSELECT")
    r.take(28, "reserved, ISVEXTPRODID")
    attributes, mrenclave = r.take(16, "ATTRIBUTES"), r.take(32, "MRENCLAVE")
    r.take(32, "reserved")
    mrsigner = r.take(32, "MRSIGNER")
    r.take(96, "reserved, CONFIGID")
    prodid, svn = r.uint(2, "ISVPRODID"), r.uint(2, "ISVSVN")
    r.take(60, "CONFIGSVN, reserved, ISVFAMILYID")
    report_data = r.take(64, "REPORTDATA")
    r.end()
    return QeReport(raw, cpusvn, misc, attributes, mrenclave, mrsigner, prodid, svn, report_data)


def parse_quote(data: bytes) -> TdxQuote:
    r = Reader(data, "TDX quote", "little")
    version, key_type, tee = r.uint(2, "version"), r.uint(2, "attestation key type"), r.uint(4, "TEE type")
    if version != 4:
        raise EvidenceFormatError(f"TDX quote: version {version}; tracelm reads version 4")
    if tee != TEE_TDX or key_type != ATT_KEY_ECDSA_P256:
        raise EvidenceFormatError(f"TDX quote: TEE type 0x{tee:x}, key type {key_type}: not a TDX quote signed "
                                  "with ECDSA P-256")
    qe_svn, pce_svn, vendor = r.uint(2, "QE SVN"), r.uint(2, "PCE SVN"), r.take(16, "QE vendor id")
    r.take(20, "user data")
    body = {name: r.take(size, name.upper()) for name, size in BODY_FIELDS}
    sig_data = Reader(r.sized("signature data", 4), "TDX quote signature data", "little")
    r.end()
    signature, key = sig_data.take(64, "quote signature"), sig_data.take(64, "attestation key")
    cert_type = sig_data.uint(2, "certification data type")
    if cert_type != CERT_QE_REPORT:
        raise EvidenceFormatError(f"TDX quote: certification data of type {cert_type}, not the QE report (6)")
    cert = Reader(sig_data.sized("certification data", 4), "TDX QE certification data", "little")
    sig_data.end()
    qe_raw, qe_sig, auth = cert.take(384, "QE report"), cert.take(64, "QE report signature"), cert.sized("QE auth data")
    chain_type = cert.uint(2, "PCK certification data type")
    if chain_type != CERT_PCK_CHAIN:
        raise EvidenceFormatError(f"TDX quote: PCK certification data of type {chain_type}, not a chain (5)")
    chain = cert.sized("PCK certificate chain", 4)
    cert.end()
    try:
        ak = ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256R1(), b"\x04" + key)
    except ValueError:
        raise EvidenceFormatError("TDX quote: the attestation key is not a P-256 point") from None
    return TdxQuote(version, qe_svn, pce_svn, vendor, body, data[:SIGNED_SIZE], ecdsa_raw(signature), ak, key,
                    parse_qe_report(qe_raw), ecdsa_raw(qe_sig), auth, chain)


def pck_info(cert: x509.Certificate) -> PckInfo:
    """The SGX extension of a PCK certificate (Intel's "SGX PCK Certificate and CRL Profile")."""
    try:
        raw = cert.extensions.get_extension_for_oid(x509.ObjectIdentifier(SGX_EXTENSION)).value.value  # type: ignore
    except x509.ExtensionNotFound:
        raise EvidenceFormatError("PCK certificate: no SGX extension (1.2.840.113741.1.13.1)") from None
    outer = der.items(raw, "PCK SGX extension")
    if len(outer) != 1 or outer[0][0] != der.SEQUENCE:
        raise EvidenceFormatError("PCK SGX extension: not one SEQUENCE")
    values = der.oid_map(outer[0][1], "PCK SGX extension")
    try:
        return PckInfo(tuple(int(values[f"{_PCK}.{i}"]) for i in range(1, 17)), int(values[f"{_PCK}.17"]),
                       bytes(values[f"{_PCK}.18"]), bytes(values[SGX_EXTENSION + ".3"]),
                       bytes(values[SGX_EXTENSION + ".4"]))
    except KeyError as e:
        raise EvidenceFormatError(f"PCK SGX extension: no {e.args[0]}") from None


@attrs.frozen
class SignedJson:
    """Intel collateral: the JSON body as signed (its exact bytes), parsed, and its signature (DER)."""

    body: bytes
    value: dict[str, Any]
    signature: bytes


def signed_json(data: bytes, key: str, what: str) -> SignedJson:
    """A TCB info (`key` "tcbInfo") or QE identity ("enclaveIdentity") file: {"KEY": {...}, "signature": "HEX"}.
    The signature (r || s, P-256) is over the body's bytes exactly as they appear in the file."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise EvidenceFormatError(f"{what}: not JSON") from None
    m = re.fullmatch(rb'\s*\{\s*"' + key.encode() + rb'"\s*:\s*(\{.*\})\s*,\s*"signature"\s*:\s*"[0-9a-fA-F]+"\s*\}\s*',
                     data, re.DOTALL)
    if not isinstance(doc, dict) or m is None or not isinstance(doc.get(key), dict):
        raise EvidenceFormatError(f"{what}: not {{\"{key}\": {{...}}, \"signature\": HEX}}")
    try:
        sig = bytes.fromhex(doc["signature"])
    except ValueError:
        raise EvidenceFormatError(f"{what}: signature is not hex") from None
    if len(sig) != 64:
        raise EvidenceFormatError(f"{what}: signature of {len(sig)} bytes, not 64")
    return SignedJson(m.group(1), doc[key], ecdsa_raw(sig))
