"""An auditor's trust policy (`--policy FILE`, YAML; docs/trust.md): the keys it trusts, the level it requires, and
what attestation evidence must show. Trust comes only from here: a trace never vouches for itself.

    require: attested             # intact | signed | trusted | attested (default: attested with an
                                  # attestation section, else trusted)
    trusted_keys:                 # Ed25519 public keys: a PEM file (relative to this file) or a fingerprint
      - ops.pub                   # (sha256 of the raw key, 64 hex digits, as `tracelm trace keygen` prints it)
    time: 2025-09-01T00:00:00Z    # check certificates and collateral as of this time (default: now)
    attestation:
      tpm: {ak: ak.pem, ak_ca: [ca.pem], pcrs: {sha256: {23: HEX}}}
      snp: {ark: ark.pem, ask: ask.pem, vcek: vcek.pem, measurement: HEX, vmpl: 0, debug: false,
            min_tcb: {bootloader: 4, tee: 0, snp: 27, microcode: 222}, chip_id: HEX, host_data: HEX, ...}
      tdx: {root: root.pem, crls: [a.der], tcb_info: tcbInfo.json, qe_identity: qeIdentity.json,
            tcb_sign_chain: chain.pem, pck_chain: [pck.pem], mrtd: HEX, rtmr0: HEX, ..., tcb_status: [UpToDate]}
"""

from __future__ import annotations

import datetime as dt
import os
import re
from pathlib import Path
from typing import Any

import attrs
import yaml
from cryptography import x509

from tracelm.io.attest import certs
from tracelm.io.attest.snp import Tcb
from tracelm.io.trace_keys import fingerprint, load_public_key
from tracelm.state.errors import EvidenceFormatError, PolicyError

LEVELS = ("broken", "intact", "signed", "trusted", "attested")  # from worst to best
HEX64 = re.compile(r"[0-9a-f]{64}")
SNP_FIELDS = {"measurement": 48, "host_data": 32, "id_key_digest": 48, "author_key_digest": 48, "chip_id": 64,
              "family_id": 16, "image_id": 16}
TDX_FIELDS = {"mrtd": 48, "mrconfigid": 48, "mrowner": 48, "mrownerconfig": 48, "mrseam": 48, "rtmr0": 48,
              "rtmr1": 48, "rtmr2": 48, "rtmr3": 48}


@attrs.frozen
class TpmPolicy:
    ak: tuple[Any, ...] = ()  # the attestation keys (public) the quote may be signed by
    ak_ca: tuple[x509.Certificate, ...] = ()  # or: CA certificates an AK certificate in the evidence chains to
    pcrs: dict[str, dict[int, bytes]] = attrs.Factory(dict)  # bank -> PCR -> expected value


@attrs.frozen
class SnpPolicy:
    ark: x509.Certificate  # AMD's root key certificate: the trust anchor
    ask: x509.Certificate | None = None  # else the evidence's certificate table must carry it
    vcek: x509.Certificate | None = None  # else the evidence's certificate table must carry it
    fields: dict[str, bytes] = attrs.Factory(dict)  # SNP_FIELDS the report must hold exactly
    vmpl: int | None = None
    debug: bool = False  # may the guest policy allow debugging (a hypervisor could read its memory)
    min_tcb: Tcb | None = None


@attrs.frozen
class TdxPolicy:
    root: x509.Certificate  # Intel's SGX root CA: the trust anchor
    tcb_info: bytes  # the TCB info file as signed (JSON)
    tcb_sign_chain: tuple[x509.Certificate, ...]
    crls: tuple[x509.CertificateRevocationList, ...] = ()
    qe_identity: bytes | None = None  # the QE identity file, when the policy checks the quoting enclave
    pck_chain: tuple[x509.Certificate, ...] = ()  # for a quote that carries no certificates
    fields: dict[str, bytes] = attrs.Factory(dict)  # TDX_FIELDS the TD report must hold exactly
    tcb_status: tuple[str, ...] = ("UpToDate",)
    debug: bool = False


@attrs.frozen
class Policy:
    keys: dict[str, str] = attrs.Factory(dict)  # trusted Ed25519 fingerprint -> where it was named
    require: str = "trusted"
    tpm: TpmPolicy | None = None
    snp: SnpPolicy | None = None
    tdx: TdxPolicy | None = None
    time: dt.datetime | None = None  # certificates are checked as of this time (None: now)
    source: str = "the default policy"

    @property
    def attests(self) -> bool:
        return any(p is not None for p in (self.tpm, self.snp, self.tdx))

    def at(self) -> dt.datetime:
        return self.time or dt.datetime.now(dt.UTC)


def load_policy(path: str | os.PathLike | None = None, public_keys: tuple[str, ...] = (),
                require: str | None = None) -> Policy:
    """The auditor's policy: the YAML file (when given), plus each `--public-key FILE` as a trusted key, and
    `--require LEVEL` over the file's `require`. Without any of them: the default policy, which trusts no key and
    requires "trusted", so only a trace signed by a key you named passes."""
    tree: dict[str, Any] = {}
    base = Path(".")
    if path is not None:
        base = Path(path).parent
        try:
            tree = yaml.safe_load(certs.read_file(path, "policy").decode("utf-8")) or {}
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise PolicyError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None
        except EvidenceFormatError as e:
            raise PolicyError(str(e)) from None
        if not isinstance(tree, dict):
            raise PolicyError(f"{path}: a policy is a mapping of keys, got {type(tree).__name__}")
    where = str(path) if path is not None else "policy"
    _known(tree, ("require", "trusted_keys", "attestation", "time"), where)
    keys = _trusted_keys(tree.get("trusted_keys") or [], base, where)
    for p in public_keys:
        keys[fingerprint(load_public_key(p))] = p
    attest = tree.get("attestation") or {}
    if not isinstance(attest, dict):
        raise PolicyError(f"{where}: attestation: a mapping of providers (tpm, snp, tdx)")
    _known(attest, ("tpm", "snp", "tdx"), f"{where}: attestation")
    try:
        tpm = _tpm(attest["tpm"], base, f"{where}: attestation.tpm") if "tpm" in attest else None
        snp = _snp(attest["snp"], base, f"{where}: attestation.snp") if "snp" in attest else None
        tdx = _tdx(attest["tdx"], base, f"{where}: attestation.tdx") if "tdx" in attest else None
    except EvidenceFormatError as e:
        raise PolicyError(f"{where}: {e}") from None
    level = require or tree.get("require") or ("attested" if tpm or snp or tdx else "trusted")
    if level not in LEVELS[1:]:
        raise PolicyError(f"{where}: require {level!r} is not one of {', '.join(LEVELS[1:])}")
    if level == "attested" and not (tpm or snp or tdx):
        raise PolicyError(f"{where}: require attested, but the policy names no attestation requirements "
                          "(attestation: tpm, snp or tdx)")
    source = str(path) if path is not None else ("--public-key " + ", ".join(public_keys) if public_keys
                                                 else "the default policy")
    return Policy(keys, level, tpm, snp, tdx, _time(tree.get("time"), where), source)


def key_policy(public_keys: list[Any], source: str = "--public-key") -> Policy:
    """A policy that trusts these Ed25519 public keys (none: the default policy, which trusts no key)."""
    if not public_keys:
        return Policy()
    return Policy({fingerprint(k): source for k in public_keys}, source=source)


def _known(tree: dict[str, Any], known: tuple[str, ...], where: str) -> None:
    for key in tree:
        if key not in known:
            raise PolicyError(f"{where}: unknown key {key!r} (known: {', '.join(known)})")


def _time(value: Any, where: str) -> dt.datetime | None:
    if value is None:
        return None
    if isinstance(value, dt.datetime):
        return value if value.tzinfo else value.replace(tzinfo=dt.UTC)
    try:
        parsed = dt.datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        raise PolicyError(f"{where}: time {value!r} is not an ISO 8601 date and time") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)


def _trusted_keys(items: Any, base: Path, where: str) -> dict[str, str]:
    if not isinstance(items, list):
        raise PolicyError(f"{where}: trusted_keys: a list of public key files or fingerprints")
    keys = {}
    for item in items:
        text = str(item).strip().lower()
        if HEX64.fullmatch(text):
            keys[text] = f"{where} (fingerprint)"
        else:
            keys[fingerprint(load_public_key(base / str(item)))] = str(item)
    return keys


def _file(base: Path, value: Any, where: str) -> Path:
    if not isinstance(value, str) or not value:
        raise PolicyError(f"{where}: expected a file name, got {value!r}")
    return base / value


def _files(base: Path, value: Any, where: str) -> list[Path]:
    return [_file(base, v, where) for v in (value if isinstance(value, list) else [value])]


def _hex(value: Any, size: int, where: str) -> bytes:
    text = str(value).strip().lower().removeprefix("0x")
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raise PolicyError(f"{where}: not hex: {str(value)[:80]!r}") from None
    if len(raw) != size:
        raise PolicyError(f"{where}: {len(raw)} bytes, expected {size}")
    return raw


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise PolicyError(f"{where}: expected true or false, got {value!r}")
    return value


def _tpm(tree: Any, base: Path, where: str) -> TpmPolicy:
    if not isinstance(tree, dict):
        raise PolicyError(f"{where}: a mapping (ak, ak_ca, pcrs)")
    _known(tree, ("ak", "ak_ca", "pcrs"), where)
    aks = tuple(certs.load_public_key(p, "attestation key") for p in _files(base, tree["ak"], f"{where}.ak")) \
        if "ak" in tree else ()
    cas = tuple(c for p in _files(base, tree["ak_ca"], f"{where}.ak_ca") for c in certs.load_certificates(p)) \
        if "ak_ca" in tree else ()
    if not aks and not cas:
        raise PolicyError(f"{where}: name the attestation key (ak: FILE) or the CA its certificate chains to "
                          "(ak_ca: [FILE]): without either, any TPM (or a software one) would do")
    pcrs: dict[str, dict[int, bytes]] = {}
    banks = tree.get("pcrs") or {}
    if not isinstance(banks, dict):
        raise PolicyError(f"{where}.pcrs: a mapping of banks (sha256: {{PCR: HEX}})")
    sizes = {"sha1": 20, "sha256": 32, "sha384": 48, "sha512": 64}
    for bank, values in banks.items():
        if bank not in sizes or not isinstance(values, dict):
            raise PolicyError(f"{where}.pcrs.{bank}: a bank is one of {', '.join(sizes)}, mapping PCRs to values")
        for index, value in values.items():
            index = int(index) if isinstance(index, str) and index.isdigit() else index  # "23" (JSON) or 23
            if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < 24:
                raise PolicyError(f"{where}.pcrs.{bank}: PCR {index!r} is not 0..23")
            pcrs.setdefault(bank, {})[index] = _hex(value, sizes[bank], f"{where}.pcrs.{bank}.{index}")
    return TpmPolicy(aks, cas, pcrs)


def _one_cert(base: Path, tree: dict[str, Any], key: str, where: str) -> x509.Certificate | None:
    if key not in tree:
        return None
    found = certs.load_certificates(_file(base, tree[key], f"{where}.{key}"))
    if len(found) != 1:
        raise PolicyError(f"{where}.{key}: {len(found)} certificates in the file; name one")
    return found[0]


def _snp(tree: Any, base: Path, where: str) -> SnpPolicy:
    if not isinstance(tree, dict):
        raise PolicyError(f"{where}: a mapping (ark, ask, vcek, measurement, ...)")
    _known(tree, ("ark", "ask", "cert_chain", "vcek", "vmpl", "debug", "min_tcb", *SNP_FIELDS), where)
    ark, ask = _one_cert(base, tree, "ark", where), _one_cert(base, tree, "ask", where)
    if "cert_chain" in tree:  # AMD's cert_chain file: the ASK then the ARK
        chain = certs.load_certificates(_file(base, tree["cert_chain"], f"{where}.cert_chain"))
        if len(chain) != 2:
            raise PolicyError(f"{where}.cert_chain: {len(chain)} certificates; AMD's chain is the ASK then the ARK")
        ask, ark = ask or chain[0], ark or chain[1]
    if ark is None:
        raise PolicyError(f"{where}: name AMD's root key certificate (ark: FILE, or cert_chain: FILE)")
    fields = {k: _hex(tree[k], n, f"{where}.{k}") for k, n in SNP_FIELDS.items() if k in tree}
    vmpl = tree.get("vmpl")
    if vmpl is not None and (not isinstance(vmpl, int) or isinstance(vmpl, bool) or not 0 <= vmpl <= 3):
        raise PolicyError(f"{where}.vmpl: 0..3, got {vmpl!r}")
    tcb = tree.get("min_tcb")
    if tcb is not None:
        if not isinstance(tcb, dict) or set(tcb) != {"bootloader", "tee", "snp", "microcode"}:
            raise PolicyError(f"{where}.min_tcb: bootloader, tee, snp and microcode, each an integer")
        tcb = Tcb(**{k: int(v) for k, v in tcb.items()})
    return SnpPolicy(ark, ask, _one_cert(base, tree, "vcek", where), fields, vmpl,
                     _bool(tree.get("debug", False), f"{where}.debug"), tcb)


def _tdx(tree: Any, base: Path, where: str) -> TdxPolicy:
    if not isinstance(tree, dict):
        raise PolicyError(f"{where}: a mapping (root, tcb_info, tcb_sign_chain, ...)")
    _known(tree, ("root", "crls", "tcb_info", "qe_identity", "tcb_sign_chain", "pck_chain", "tcb_status", "debug",
                  *TDX_FIELDS), where)
    for key in ("root", "tcb_info", "tcb_sign_chain"):
        if key not in tree:
            raise PolicyError(f"{where}: {key} is required (Intel's root CA, the TCB info and its signing chain)")
    status = tree.get("tcb_status", ["UpToDate"])
    if not isinstance(status, list) or not all(isinstance(s, str) for s in status):
        raise PolicyError(f"{where}.tcb_status: a list of accepted TCB statuses (UpToDate, SWHardeningNeeded, ...)")
    return TdxPolicy(
        _one_cert(base, tree, "root", where),  # type: ignore[arg-type]
        certs.read_file(_file(base, tree["tcb_info"], f"{where}.tcb_info"), "TCB info"),
        tuple(certs.load_certificates(_file(base, tree["tcb_sign_chain"], f"{where}.tcb_sign_chain"))),
        tuple(certs.load_crl(p) for p in _files(base, tree["crls"], f"{where}.crls")) if "crls" in tree else (),
        certs.read_file(_file(base, tree["qe_identity"], f"{where}.qe_identity"), "QE identity")
        if "qe_identity" in tree else None,
        tuple(c for p in _files(base, tree["pck_chain"], f"{where}.pck_chain") for c in certs.load_certificates(p))
        if "pck_chain" in tree else (),
        {k: _hex(tree[k], n, f"{where}.{k}") for k, n in TDX_FIELDS.items() if k in tree},
        tuple(status), _bool(tree.get("debug", False), f"{where}.debug"))
