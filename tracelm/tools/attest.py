"""`tracelm attest tpm-setup` and `tracelm attest pcr`: the operator's side of TPM attestation (docs/trust.md) --
a persistent attestation key, and the PCR value the files it measures extend to."""

from __future__ import annotations

import os

from tracelm.io.attest.provider import TpmOptions, tpm_setup
from tracelm.io.attest.tpm import extend
from tracelm.io.registry import path_sha256
from tracelm.state.errors import TracelmError


def setup(tcti: str | None, out: str) -> str:
    """A persistent EK and AK in the TPM at `tcti` (unless present); the AK's public key written to `out`."""
    return tpm_setup(TpmOptions(tcti=tcti), out)


def pcr_after(files: list[str]) -> list[str]:
    """Each file's sha256 (a model folder's as a trace header's model_sha256 is), then the value of a sha256 PCR that
    starts at zero and is extended with them in order: what an operator's boot script extends into PCR 23, what the
    auditor's policy then expects. One line each, as `sha256sum` prints."""
    if not files:
        raise TracelmError("attest pcr: give the files extended into the PCR, in order (e.g. the tracelm wheel, the "
                           "model file)")
    value, lines = bytes(32), []
    for f in files:
        if not os.path.exists(f):
            raise TracelmError(f"{f}: no such file")
        digest = path_sha256(f)
        value = extend(value, bytes.fromhex(digest))
        lines.append(f"{digest}  {f}")
    return [*lines, f"{value.hex()}  PCR value after extending a zero sha256 PCR with these, in order"]
