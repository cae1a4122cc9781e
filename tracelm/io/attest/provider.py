"""Evidence providers: ask the TEE the run is in to sign 64 bytes of report data (binding.py).

- `tpm`: a TPM 2.0 quote through tpm2-tools (Debian's `tpm2-tools`): TPM2_Quote by the persistent attestation key
  over the configured PCR selection, qualifying data = the report data; the evidence holds the quote (TPMS_ATTEST),
  its signature (TPMT_SIGNATURE), the AK's public area (TPM2B_PUBLIC) and the PCR values, hex. tpm2-tools rather
  than tpm2-pytss: a Debian package with no build step, where tpm2-pytss has no wheel and builds against
  libtss2-dev with a C compiler (docs/trust.md). Calls are serialized: without a resource manager a TPM serves one
  session at a time.
- `tsm`: Linux's configfs-tsm (/sys/kernel/config/tsm/report): make an entry, write `inblob` (the report data),
  read `outblob` (an SEV-SNP report or a TDX quote), `provider` (sev_guest, tdx_guest), `auxblob` (SEV-SNP: the
  certificate table, when the host supplies it) and `generation` (which must have moved by exactly one: else
  another writer raced this one), then remove the entry.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import attrs
from cryptography.hazmat.primitives.serialization import Encoding

from tracelm.io.attest import tpm
from tracelm.io.attest.certs import certificates, read_file
from tracelm.state.errors import TracelmError
from tracelm.state.run_config import AttestOptions

EK_HANDLE = "0x81010001"
TOOL_TIMEOUT_S = 60
_TPM = threading.Lock()


@attrs.frozen
class TpmOptions:
    tcti: str | None = None
    ak_handle: str = "0x81010002"
    pcrs: str = "sha256:0,1,2,3,4,5,6,7,23"
    ak_cert: str | None = None


def evidence(opts: AttestOptions, report_data: bytes) -> dict[str, Any]:
    """The provider's evidence over `report_data` (64 bytes), as a JSON object."""
    if opts.provider == "tpm":
        return tpm_quote(TpmOptions(opts.tpm_tcti, opts.tpm_ak_handle, opts.tpm_pcrs, opts.tpm_ak_cert), report_data)
    if opts.provider == "tsm":
        return tsm_report(Path(opts.tsm_dir), report_data)
    raise TracelmError(f"attest.provider {opts.provider!r}: no evidence to make")


def _tpm2(args: list[str], opts: TpmOptions) -> str:
    """Run a tpm2-tools command against the TPM; its stdout, or a TracelmError with its last line of stderr."""
    env = {**os.environ, **({"TPM2TOOLS_TCTI": opts.tcti} if opts.tcti else {})}
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, env=env, check=False)
    except FileNotFoundError:
        raise TracelmError(f"attest tpm: {args[0]} not found: apt-get install tpm2-tools") from None
    except subprocess.TimeoutExpired:
        raise TracelmError(f"attest tpm: {args[0]} did not answer in {TOOL_TIMEOUT_S} s (is the TPM there? "
                           f"TCTI {env.get('TPM2TOOLS_TCTI', 'default')})") from None
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise TracelmError(f"attest tpm: {' '.join(args[:3])} failed ({why}); TCTI "
                           f"{env.get('TPM2TOOLS_TCTI', 'default')}")
    return done.stdout


def tpm_quote(opts: TpmOptions, report_data: bytes) -> dict[str, Any]:
    """A TPM2_Quote by the AK at opts.ak_handle over opts.pcrs, qualifying data `report_data`."""
    with tempfile.TemporaryDirectory(prefix="tracelm-quote-") as d, _TPM:
        msg, sig, pcrs, ak = (str(Path(d) / n) for n in ("quote", "sig", "pcrs", "ak"))
        _tpm2(["tpm2_quote", "-c", opts.ak_handle, "-l", opts.pcrs, "-q", report_data.hex(), "-m", msg, "-s", sig,
               "-o", pcrs, "-F", "values", "-g", "sha256"], opts)
        _tpm2(["tpm2_readpublic", "-c", opts.ak_handle, "-f", "tss", "-o", ak], opts)
        quote_raw, sig_raw, values, ak_raw = (Path(p).read_bytes() for p in (msg, sig, pcrs, ak))
    quote = tpm.parse_attest(quote_raw)
    banks = tpm.split_pcr_values(values, quote.selection)
    out: dict[str, Any] = {"provider": "tpm", "quote": quote_raw.hex(), "signature": sig_raw.hex(),
                           "ak_public": ak_raw.hex(),
                           "pcrs": {bank: {str(i): v.hex() for i, v in pcr.items()} for bank, pcr in banks.items()}}
    if opts.ak_cert:
        chain = certificates(read_file(opts.ak_cert, "AK certificate"), opts.ak_cert)
        out["ak_certificates"] = [c.public_bytes(Encoding.PEM).decode("ascii") for c in chain]
    return out


def _present(handle: str, opts: TpmOptions) -> bool:
    """Whether the TPM holds a persistent object at `handle`."""
    if shutil.which("tpm2_readpublic") is None:
        raise TracelmError("attest tpm: tpm2_readpublic not found: install tpm2-tools (apt-get install tpm2-tools)")
    try:
        _tpm2(["tpm2_readpublic", "-c", handle], opts)
    except TracelmError:
        return False
    return True


def tpm_setup(opts: TpmOptions, out: str) -> str:
    """`tracelm attest tpm-setup`: an endorsement key (RSA, at 0x81010001) and an attestation key (ECC P-256,
    restricted signing, at opts.ak_handle) made persistent unless present, and the AK's public key written to
    `out` (PEM) for the auditor's policy (attestation.tpm.ak)."""
    if Path(out).exists():
        raise TracelmError(f"{out}: already exists; tpm-setup never overwrites a file")
    made = []
    with tempfile.TemporaryDirectory(prefix="tracelm-tpm-") as d, _TPM:
        if not _present(opts.ak_handle, opts):
            if not _present(EK_HANDLE, opts):
                _tpm2(["tpm2_createek", "-c", EK_HANDLE, "-G", "rsa", "-u", str(Path(d) / "ek.pub")], opts)
                made.append(f"EK at {EK_HANDLE}")
            ctx = str(Path(d) / "ak.ctx")
            _tpm2(["tpm2_createak", "-C", EK_HANDLE, "-c", ctx, "-G", "ecc", "-g", "sha256", "-s", "ecdsa",
                   "-u", str(Path(d) / "ak.pub"), "-n", str(Path(d) / "ak.name")], opts)
            _tpm2(["tpm2_evictcontrol", "-C", "o", "-c", ctx, opts.ak_handle], opts)
            made.append(f"AK at {opts.ak_handle}")
        _tpm2(["tpm2_readpublic", "-c", opts.ak_handle, "-f", "pem", "-o", out], opts)
    return (f"{'made ' + ', '.join(made) if made else 'the AK was already at ' + opts.ak_handle}; its public key "
            f"is in {out}: the auditor's policy names it (attestation: tpm: ak: {Path(out).name})")


def tsm_report(root: Path, report_data: bytes) -> dict[str, Any]:
    """A configfs-tsm report over `report_data` from the directory `root` (/sys/kernel/config/tsm/report)."""
    if not root.is_dir():
        raise TracelmError(f"attest tsm: {root} is not a directory: no configfs-tsm here (a Linux 6.7+ SEV-SNP or TDX "
                           "guest, with configfs mounted at /sys/kernel/config)")
    entry = root / f"tracelm-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        entry.mkdir()
        before = _generation(entry)
        (entry / "inblob").write_bytes(report_data)
        outblob = (entry / "outblob").read_bytes()
        provider = (entry / "provider").read_text(encoding="ascii").strip()
        aux = entry / "auxblob"
        auxblob = aux.read_bytes() if aux.exists() else b""
        after = _generation(entry)
    except OSError as e:
        raise TracelmError(f"attest tsm: {entry}: {e.strerror or e}") from None
    finally:
        try:
            entry.rmdir()  # configfs removes the entry's attributes with it
        except OSError:
            pass
    if after != before + 1:
        raise TracelmError(f"attest tsm: {entry}: generation went from {before} to {after}: another writer changed "
                           "the request while it was read; try again")
    if not outblob:
        raise TracelmError(f"attest tsm: {entry}: empty outblob (the TEE gave no report)")
    return {"provider": "tsm", "tsm_provider": provider, "outblob": outblob.hex(),
            "auxblob": auxblob.hex() or None, "generation": after}


def _generation(entry: Path) -> int:
    path = entry / "generation"
    if not path.exists():
        return 0
    text = path.read_text(encoding="ascii").strip()
    if not text.isdigit():
        raise TracelmError(f"attest tsm: {path}: {text[:40]!r} is not a generation count")
    return int(text)

