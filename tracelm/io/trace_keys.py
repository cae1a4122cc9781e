"""Ed25519 keys for signing traces (`tracelm trace keygen`, `--sign-key FILE`, `trace verify --public-key FILE`):
the key files (PEM), a public key's fingerprint, and the signature over a trace's chain head.

A signed trace carries one signature, on its footer line, over the footer's chain hash H (which commits to every
line before it): Ed25519(private key, SIGNED_PREFIX + H as ASCII). docs/trace.md describes the format.
The `cryptography` package is imported here only, so commands that never sign stay light.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from tracelm.io.files import MiB, read_regular
from tracelm.state.errors import TracelmError

MAX_KEY_BYTES = MiB  # a PEM key is a few hundred bytes

ALGORITHM = "ed25519"
SIGNED_PREFIX = b"tracelm-trace "  # what a signature covers: this, then the footer's hash (64 hex digits)
SIGNATURE_HEX = 128  # an Ed25519 signature (64 bytes) as hex
_RAW = serialization.Encoding.Raw, serialization.PublicFormat.Raw


def public_hex(key: Ed25519PublicKey) -> str:
    """The raw public key (32 bytes) as hex: what a trace header records."""
    return key.public_bytes(*_RAW).hex()


def public_raw(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(*_RAW)


def ephemeral_key() -> Ed25519PrivateKey:
    """A new Ed25519 key held in memory only (`trace.key: ephemeral`): nothing writes it anywhere."""
    return Ed25519PrivateKey.generate()


def fingerprint(key: Ed25519PublicKey) -> str:
    """sha256 of the raw public key, hex (64 digits; messages show the first 16)."""
    return hashlib.sha256(key.public_bytes(*_RAW)).hexdigest()


def public_key_from_hex(text: object) -> Ed25519PublicKey | None:
    """A public key from a header's hex, or None when it is not 32 bytes of hex."""
    try:
        return Ed25519PublicKey.from_public_bytes(bytes.fromhex(text))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def sign(key: Ed25519PrivateKey, chain_hash: str) -> str:
    return key.sign(SIGNED_PREFIX + chain_hash.encode("ascii")).hex()


def signature_valid(key: Ed25519PublicKey, chain_hash: str, signature_hex: str) -> bool:
    try:
        key.verify(bytes.fromhex(signature_hex), SIGNED_PREFIX + chain_hash.encode("ascii"))
    except (InvalidSignature, ValueError):
        return False
    return True


def _read_pem(path: str | os.PathLike, what: str) -> bytes:
    return read_regular(path, f"the {what}", MAX_KEY_BYTES)


def load_private_key(path: str | os.PathLike) -> Ed25519PrivateKey:
    """The Ed25519 private key in a PEM file (as `tracelm trace keygen` writes it); TracelmError otherwise."""
    data = _read_pem(path, "signing key")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError:
        raise TracelmError(f"{path}: the signing key is encrypted; tracelm reads unencrypted PEM keys") from None
    except (ValueError, UnsupportedAlgorithm):
        hint = " (this is a public key: sign with the private one)" if b"PUBLIC KEY" in data else ""
        raise TracelmError(f"{path}: not a PEM private key{hint}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise TracelmError(f"{path}: a {type(key).__name__.removeprefix('_')} key, not Ed25519 (make one with "
                           f"`tracelm trace keygen --out FILE`)")
    return key


def load_public_key(path: str | os.PathLike) -> Ed25519PublicKey:
    """The Ed25519 public key in a PEM file (keygen's FILE.pub); TracelmError otherwise."""
    data = _read_pem(path, "public key")
    if b"PRIVATE KEY" in data:
        raise TracelmError(f"{path}: a private key; verify with the public key (the .pub file keygen wrote)")
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, UnsupportedAlgorithm):
        raise TracelmError(f"{path}: not a PEM public key") from None
    if not isinstance(key, Ed25519PublicKey):
        raise TracelmError(f"{path}: a {type(key).__name__.removeprefix('_')} key, not Ed25519")
    return key


def keygen(out: str | os.PathLike) -> tuple[Path, Path, str]:
    """A new key pair: the private key to `out` (PEM, mode 0600) and the public key to `out`.pub (PEM). Refuses to
    overwrite either file. Returns both paths and the public key's fingerprint."""
    private, public = Path(out), Path(f"{out}.pub")
    for p in (private, public):
        if p.exists() or p.is_symlink():
            raise TracelmError(f"{p}: already exists; keygen never overwrites a key file")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    pub = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    _write_new(private, pem, 0o600)
    _write_new(public, pub, 0o644)
    return private, public, fingerprint(key.public_key())


def _write_new(path: Path, data: bytes, mode: int) -> None:
    """Create `path` (never an existing one: O_EXCL) with `mode`, whatever the umask, and write `data`."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except OSError as e:
        raise TracelmError(f"{path}: cannot create: {e.strerror or e}") from None
    with os.fdopen(fd, "wb") as f:
        os.fchmod(fd, mode)
        f.write(data)
