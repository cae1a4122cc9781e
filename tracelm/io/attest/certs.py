"""Certificate, CRL and public-key files of attestation (an auditor's policy names them; evidence carries some):
PEM or DER, read into `cryptography` objects, or an EvidenceFormatError naming the file."""

from __future__ import annotations

import os
import warnings
from typing import Any

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization

from tracelm.io.attest import der
from tracelm.io.files import read_regular
from tracelm.state.errors import EvidenceFormatError

MAX_FILE_BYTES = 16 << 20  # collateral is kilobytes; a policy naming /dev/zero is refused, not read forever


def certificates(data: bytes, what: str) -> list[x509.Certificate]:
    """The certificates in PEM text, or DER certificates back to back. (AMD's VCEKs have a serial number that is
    not positive: `cryptography` warns that a future release will refuse them; the warning is silenced here and
    the tested versions are pinned in pyproject.toml.)"""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            if b"-----BEGIN" in data:
                return x509.load_pem_x509_certificates(data)
            return [x509.load_der_x509_certificate(whole) for whole in der.split(data, what)]
        except ValueError as e:
            raise EvidenceFormatError(f"{what}: not certificates ({str(e).splitlines()[0][:120]})") from None


def read_file(path: str | os.PathLike, what: str) -> bytes:
    """A regular file's bytes (at most MAX_FILE_BYTES)."""
    return read_regular(path, f"the {what}", MAX_FILE_BYTES, EvidenceFormatError)


def load_certificates(path: str | os.PathLike, what: str = "certificate") -> list[x509.Certificate]:
    found = certificates(read_file(path, what), f"{path}")
    if not found:
        raise EvidenceFormatError(f"{path}: no certificate in the {what} file")
    return found


def load_crl(path: str | os.PathLike) -> x509.CertificateRevocationList:
    data = read_file(path, "CRL")
    try:
        return (x509.load_pem_x509_crl(data) if b"-----BEGIN" in data else x509.load_der_x509_crl(data))
    except ValueError:
        raise EvidenceFormatError(f"{path}: not a certificate revocation list (PEM or DER)") from None


def load_public_key(path: str | os.PathLike, what: str = "public key") -> Any:
    """A public key (PEM) of any type, e.g. a TPM attestation key as `tpm2_createak -f pem` writes it."""
    data = read_file(path, what)
    try:
        return serialization.load_pem_public_key(data)
    except (ValueError, UnsupportedAlgorithm):
        raise EvidenceFormatError(f"{path}: the {what} is not a PEM public key") from None


def public_der(key: Any) -> bytes:
    """A public key as DER SubjectPublicKeyInfo: what two keys are compared by (and fingerprinted)."""
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
