"""AMD SEV-SNP attestation reports (SEV Secure Nested Paging Firmware ABI Specification, ATTESTATION_REPORT
structure), the VCEK certificate's extensions, and the certificate table a configfs-tsm `auxblob` carries.

A report is 0x4A0 bytes, little-endian. The fields read here, by offset:

    0x000 VERSION (4)        0x004 GUEST_SVN (4)      0x008 POLICY (8)        0x010 FAMILY_ID (16)
    0x020 IMAGE_ID (16)      0x030 VMPL (4)           0x034 SIGNATURE_ALGO (4) 0x038 CURRENT_TCB (8)
    0x040 PLATFORM_INFO (8)  0x048 signing key flags (4)                      0x050 REPORT_DATA (64)
    0x090 MEASUREMENT (48)   0x0C0 HOST_DATA (32)     0x0E0 ID_KEY_DIGEST (48) 0x110 AUTHOR_KEY_DIGEST (48)
    0x140 REPORT_ID (32)     0x160 REPORT_ID_MA (32)  0x180 REPORTED_TCB (8)   0x1A0 CHIP_ID (64)
    0x1E0 COMMITTED_TCB (8)  0x1F0 LAUNCH_TCB (8)     0x2A0 SIGNATURE: R, S (72 bytes each, little-endian)

The signature (ECDSA P-384 with SHA-384, SIGNATURE_ALGO 1) covers bytes 0x000-0x29F. A TCB_VERSION (Milan, Genoa)
is BOOT_LOADER (byte 0), TEE (1), SNP (6), MICROCODE (7).
"""

from __future__ import annotations

import uuid

import attrs
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import utils

from tracelm.io.attest import der
from tracelm.io.attest.reader import Reader
from tracelm.state.errors import EvidenceFormatError

REPORT_SIZE = 0x4A0
SIGNED_END = 0x2A0
ECDSA_P384_SHA384 = 1
POLICY_BITS = {"smt": 16, "migrate_ma": 18, "debug": 19, "single_socket": 20}
# the VCEK's extensions (AMD's VCEK certificate specification): its chip's TCB and HWID
VCEK_TCB_OIDS = {"bootloader": "1.3.6.1.4.1.3704.1.3.1", "tee": "1.3.6.1.4.1.3704.1.3.2",
                 "snp": "1.3.6.1.4.1.3704.1.3.3", "microcode": "1.3.6.1.4.1.3704.1.3.8"}
VCEK_HWID_OID = "1.3.6.1.4.1.3704.1.4"
# the GUIDs of the certificate table (GHCB extended guest request; the auxblob of configfs-tsm)
CERT_GUIDS = {"vcek": "63da758d-e664-4564-adc5-f4b93be8accd", "vlek": "a8074bc2-a25a-483e-aae6-39c045a0b8a1",
              "ask": "4ab7b379-bbac-4fe4-a02f-05aef327c782", "ark": "c0b406a4-a803-4952-9743-3fb6014cd0ae"}


@attrs.frozen
class Tcb:
    bootloader: int
    tee: int
    snp: int
    microcode: int

    def text(self) -> str:
        return f"bootloader {self.bootloader}, tee {self.tee}, snp {self.snp}, microcode {self.microcode}"


@attrs.frozen
class SnpReport:
    version: int
    guest_svn: int
    policy: int
    family_id: bytes
    image_id: bytes
    vmpl: int
    signature_algo: int
    current_tcb: Tcb
    platform_info: int
    report_data: bytes
    measurement: bytes
    host_data: bytes
    id_key_digest: bytes
    author_key_digest: bytes
    report_id: bytes
    reported_tcb: Tcb
    chip_id: bytes
    committed_tcb: Tcb
    launch_tcb: Tcb
    signed: bytes  # bytes 0x000-0x29F, what the signature covers
    signature: bytes  # DER (r, s), as `cryptography` verifies it

    def policy_bit(self, name: str) -> bool:
        return bool(self.policy >> POLICY_BITS[name] & 1)


def _tcb(raw: bytes) -> Tcb:
    return Tcb(raw[0], raw[1], raw[6], raw[7])


def parse_report(data: bytes) -> SnpReport:
    if len(data) != REPORT_SIZE:
        raise EvidenceFormatError(f"SEV-SNP report: {len(data)} bytes, not {REPORT_SIZE}")
    r = Reader(data, "SEV-SNP report", "little")
    version, guest_svn, policy = r.uint(4, "VERSION"), r.uint(4, "GUEST_SVN"), r.uint(8, "POLICY")
    if version < 2:
        raise EvidenceFormatError(f"SEV-SNP report: VERSION {version} is not an SNP report (2 or later)")
    family, image, vmpl, algo = r.take(16, "FAMILY_ID"), r.take(16, "IMAGE_ID"), r.uint(4, "VMPL"), \
        r.uint(4, "SIGNATURE_ALGO")
    current, platform = _tcb(r.take(8, "CURRENT_TCB")), r.uint(8, "PLATFORM_INFO")
    r.take(8, "signing key flags, reserved")
    fields: dict[str, bytes] = {name: r.take(size, name) for name, size in (
        ("REPORT_DATA", 64), ("MEASUREMENT", 48), ("HOST_DATA", 32), ("ID_KEY_DIGEST", 48),
        ("AUTHOR_KEY_DIGEST", 48), ("REPORT_ID", 32), ("REPORT_ID_MA", 32))}
    reported = _tcb(r.take(8, "REPORTED_TCB"))
    r.take(0x1A0 - 0x188, "CPUID, reserved")
    chip, committed = r.take(64, "CHIP_ID"), _tcb(r.take(8, "COMMITTED_TCB"))
    r.take(8, "build numbers")
    launch = _tcb(r.take(8, "LAUNCH_TCB"))
    sig_r = int.from_bytes(data[SIGNED_END:SIGNED_END + 72], "little")
    sig_s = int.from_bytes(data[SIGNED_END + 72:SIGNED_END + 144], "little")
    return SnpReport(version, guest_svn, policy, family, image, vmpl, algo, current, platform,
                     fields["REPORT_DATA"], fields["MEASUREMENT"], fields["HOST_DATA"], fields["ID_KEY_DIGEST"],
                     fields["AUTHOR_KEY_DIGEST"], fields["REPORT_ID"], reported, chip, committed, launch,
                     data[:SIGNED_END], utils.encode_dss_signature(sig_r, sig_s))


def _extension(cert: x509.Certificate, oid: str) -> bytes:
    try:
        ext = cert.extensions.get_extension_for_oid(x509.ObjectIdentifier(oid))
    except x509.ExtensionNotFound:
        raise EvidenceFormatError(f"VCEK certificate: no extension {oid}") from None
    return ext.value.value  # type: ignore[attr-defined]


def vcek_tcb(cert: x509.Certificate) -> Tcb:
    """The TCB a VCEK certificate was issued for (its SPL extensions)."""
    return Tcb(**{name: int(der.single(_extension(cert, oid), f"VCEK extension {oid}"))
                  for name, oid in VCEK_TCB_OIDS.items()})


def vcek_hwid(cert: x509.Certificate) -> bytes:
    """The chip id a VCEK certificate was issued for (its HWID extension: the report's CHIP_ID; AMD's KDS writes its 64
    bytes raw, others as a DER OCTET STRING)."""
    raw = _extension(cert, VCEK_HWID_OID)
    return raw if len(raw) == 64 else bytes(der.single(raw, f"VCEK extension {VCEK_HWID_OID}"))


def cert_table(auxblob: bytes) -> dict[str, bytes]:
    """The certificates in an extended report's table (entries of GUID, offset, length; an all-zero entry ends
    it): name (vcek, vlek, ask, ark) -> DER."""
    out: dict[str, bytes] = {}
    if not auxblob:  # the host supplied no certificates
        return out
    at = 0
    names = {v: k for k, v in CERT_GUIDS.items()}
    while at + 24 <= len(auxblob):
        guid, offset, length = auxblob[at:at + 16], int.from_bytes(auxblob[at + 16:at + 20], "little"), \
            int.from_bytes(auxblob[at + 20:at + 24], "little")
        if not any(guid):
            return out
        if offset + length > len(auxblob):
            raise EvidenceFormatError(f"SEV-SNP certificate table: entry {at // 24} runs past the end")
        # the GUID as its 16 bytes in order (as the kernel's and virtee's tables write it) or in EFI's mixed-endian
        plain, mixed = str(uuid.UUID(bytes=guid)), str(uuid.UUID(bytes_le=guid))
        name = names.get(plain) or names.get(mixed, plain)
        out[name] = auxblob[offset:offset + length]
        at += 24
    raise EvidenceFormatError("SEV-SNP certificate table: no terminating entry")
