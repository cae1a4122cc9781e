"""The binding of a trace signing key to attestation evidence: what a TEE's 64 bytes of report data commit to.

    message     = b"tracelm-attestation-v1\\n" || field(public key) || field(tracelm version) || field(model sha256)
                  || field(nonce)
    field(x)    = len(x) as 4 bytes big-endian || x
    report data = sha256(message) || sha256(nonce)                                   (32 + 32 = 64 bytes)

The public key is the Ed25519 key's 32 raw bytes, the version its UTF-8 text, the model sha256 its 32 raw bytes
(of the model file, as a trace header's `model_sha256`), the nonce 0 to 64 bytes: a client's (GET
/v1/attestation?nonce=HEX) or, for the evidence made when a run starts, the start time (`start_nonce`). The first
half commits to all four; the second repeats the nonce alone, so a verifier can tell a quote made for another
nonce (replayed) from one over another key. On a TPM the 64 bytes are the quote's qualifying data; on SEV-SNP and
TDX its REPORT_DATA.
"""

from __future__ import annotations

import hashlib
from typing import Any

import attrs

from tracelm.state.errors import EvidenceFormatError

DOMAIN = b"tracelm-attestation-v1\n"
MAX_NONCE = 64


def _field(x: bytes) -> bytes:
    return len(x).to_bytes(4, "big") + x


@attrs.frozen
class Binding:
    """What the evidence binds: the signing key (32 raw bytes), tracelm's version, the model's sha256 (hex) and a
    nonce."""

    public_key: bytes
    tracelm_version: str
    model_sha256: str
    nonce: bytes

    def message(self) -> bytes:
        return DOMAIN + b"".join(_field(x) for x in (self.public_key, self.tracelm_version.encode("utf-8"),
                                                     bytes.fromhex(self.model_sha256), self.nonce))

    def report_data(self) -> bytes:
        """The 64 bytes of report data: sha256(message) || sha256(nonce)."""
        return hashlib.sha256(self.message()).digest() + nonce_digest(self.nonce)

    def as_dict(self) -> dict[str, str]:
        return {"public_key": self.public_key.hex(), "tracelm_version": self.tracelm_version,
                "model_sha256": self.model_sha256, "nonce": self.nonce.hex()}


def nonce_digest(nonce: bytes) -> bytes:
    return hashlib.sha256(nonce).digest()


def start_nonce(unix_ms: int) -> bytes:
    """The nonce of evidence made when a run starts: the start time, Unix milliseconds as 8 bytes big-endian."""
    return unix_ms.to_bytes(8, "big")


def parse_nonce(text: object, what: str = "nonce") -> bytes:
    """A nonce from hex (0 to 64 bytes); EvidenceFormatError naming `what` otherwise."""
    try:
        nonce = bytes.fromhex(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise EvidenceFormatError(f"{what}: not hex: {str(text)[:80]!r}") from None
    if len(nonce) > MAX_NONCE:
        raise EvidenceFormatError(f"{what}: {len(nonce)} bytes; a nonce has at most {MAX_NONCE}")
    return nonce


def binding_from_dict(d: Any, what: str = "binding") -> Binding:
    """A Binding from its JSON form (as `Binding.as_dict` writes it); EvidenceFormatError naming the field."""
    if not isinstance(d, dict):
        raise EvidenceFormatError(f"{what}: not a JSON object")

    def hexfield(name: str, size: int | None) -> bytes:
        try:
            raw = bytes.fromhex(d.get(name))  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise EvidenceFormatError(f"{what}.{name}: not hex") from None
        if size is not None and len(raw) != size:
            raise EvidenceFormatError(f"{what}.{name}: {len(raw)} bytes, not {size}")
        return raw

    version = d.get("tracelm_version")
    if not isinstance(version, str) or len(version) > 200:
        raise EvidenceFormatError(f"{what}.tracelm_version: not a version string")
    return Binding(hexfield("public_key", 32), version, hexfield("model_sha256", 32).hex(),
                   parse_nonce(d.get("nonce"), f"{what}.nonce"))
