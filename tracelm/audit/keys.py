"""The key files of the trace commands (tracelm/io/trace_keys.py): `tracelm trace keygen`, and the keys that
`--sign-key` and `--public-key` name, read up front so a bad file is one line (exit 2) before any work."""

from __future__ import annotations

from typing import Any

from tracelm.io import trace_keys


def keygen(out: str) -> str:
    """Write a new Ed25519 key pair (`out`, `out`.pub) and say where, with the public key's fingerprint."""
    private, public, fp = trace_keys.keygen(out)
    return (f"private key  {private}  (PEM, mode 0600: keep it secret; sign with --sign-key {private})\n"
            f"public key   {public}  (PEM: give it to whoever verifies, --public-key {public})\n"
            f"fingerprint  {fp[:16]}  (sha256 of the raw public key: {fp})")


def check_sign_key(path: str | None) -> None:
    """A TracelmError unless `path` (when given) holds an Ed25519 private key."""
    if path is not None:
        trace_keys.load_private_key(path)


def public_key(path: str | None) -> Any:
    """The Ed25519 public key in `path`, or None without a path."""
    return None if path is None else trace_keys.load_public_key(path)
