"""TPM 2.0 structures of a quote (TPM 2.0 Library spec, part 2: Structures), read by hand:

- TPMS_ATTEST of a TPM2_Quote: magic TPM_GENERATED_VALUE, type TPM_ST_ATTEST_QUOTE, qualifiedSigner (TPM2B_NAME),
  extraData (TPM2B_DATA: the qualifying data the caller gave), clockInfo, firmwareVersion, then TPMS_QUOTE_INFO:
  the PCR selection (TPML_PCR_SELECTION) and the digest of the selected PCR values (TPM2B_DIGEST);
- TPMT_SIGNATURE: RSASSA / RSAPSS (hash, TPM2B signature) or ECDSA (hash, TPM2B r, TPM2B s);
- TPM2B_PUBLIC / TPMT_PUBLIC of the attestation key (AK): RSA or ECC, its attributes and its key, as a
  `cryptography` public key.

All integers are big-endian. The selected PCR values are hashed in selection order (banks as listed, PCRs in
ascending order) into pcrDigest with the signature's hash.
"""

from __future__ import annotations

import hashlib

import attrs
from cryptography.hazmat.primitives.asymmetric import ec, rsa, utils

from tracelm.io.attest.reader import Reader
from tracelm.state.errors import EvidenceFormatError

GENERATED_VALUE = 0xFF544347  # TPM_GENERATED_VALUE: only the TPM writes this into what a restricted key signs
ST_ATTEST_QUOTE = 0x8018
HASHES = {0x0004: "sha1", 0x000B: "sha256", 0x000C: "sha384", 0x000D: "sha512"}
ALG_RSA, ALG_ECC, ALG_NULL = 0x0001, 0x0023, 0x0010
ALG_RSASSA, ALG_RSAPSS, ALG_ECDSA, ALG_ECDAA = 0x0014, 0x0016, 0x0018, 0x001A
CURVES = {0x0003: ec.SECP256R1, 0x0004: ec.SECP384R1, 0x0005: ec.SECP521R1}
# TPMA_OBJECT bits of a key that only the TPM holds and that signs only what the TPM itself produced
FIXED_TPM, FIXED_PARENT, SENSITIVE_DATA_ORIGIN = 1 << 1, 1 << 4, 1 << 5
RESTRICTED, DECRYPT, SIGN = 1 << 16, 1 << 17, 1 << 18
AK_ATTRIBUTES = FIXED_TPM | FIXED_PARENT | SENSITIVE_DATA_ORIGIN | RESTRICTED | SIGN


@attrs.frozen
class Quote:
    """A TPMS_ATTEST of type quote."""

    signer_name: bytes
    extra_data: bytes  # the qualifying data
    clock: int
    reset_count: int
    restart_count: int
    safe: bool
    firmware_version: int
    selection: tuple[tuple[str, tuple[int, ...]], ...]  # (bank hash, PCR indices ascending), in order
    pcr_digest: bytes


@attrs.frozen
class Signature:
    scheme: str  # "rsassa", "rsapss" or "ecdsa"
    hash: str
    value: bytes  # RSA: the signature; ECDSA: DER (r, s), as `cryptography` verifies it


@attrs.frozen
class PublicArea:
    """A TPMT_PUBLIC: its raw bytes (what the key's name hashes), name hash, attributes and key."""

    raw: bytes
    name_alg: str
    attributes: int
    key: rsa.RSAPublicKey | ec.EllipticCurvePublicKey

    @property
    def restricted_signing(self) -> bool:
        return self.attributes & AK_ATTRIBUTES == AK_ATTRIBUTES and not self.attributes & DECRYPT

    def name(self) -> bytes:
        """The key's TPM name: nameAlg (2 bytes) || H_nameAlg(TPMT_PUBLIC)."""
        alg = next(k for k, v in HASHES.items() if v == self.name_alg)
        return alg.to_bytes(2, "big") + hashlib.new(self.name_alg, self.raw).digest()


def _hash(r: Reader, field: str) -> str:
    alg = r.uint(2, field)
    if alg not in HASHES:
        raise EvidenceFormatError(f"{r.what}: {field} 0x{alg:04x} is not a hash tracelm knows")
    return HASHES[alg]


def parse_attest(data: bytes) -> Quote:
    r = Reader(data, "TPMS_ATTEST")
    magic = r.uint(4, "magic")
    if magic != GENERATED_VALUE:
        raise EvidenceFormatError(f"TPMS_ATTEST: magic 0x{magic:08x} is not TPM_GENERATED_VALUE: not made by a TPM")
    kind = r.uint(2, "type")
    if kind != ST_ATTEST_QUOTE:
        raise EvidenceFormatError(f"TPMS_ATTEST: type 0x{kind:04x} is not a quote (0x{ST_ATTEST_QUOTE:04x})")
    signer, extra = r.sized("qualifiedSigner"), r.sized("extraData")
    clock, resets, restarts, safe = r.uint(8, "clock"), r.uint(4, "resetCount"), r.uint(4, "restartCount"), \
        r.uint(1, "safe")
    firmware = r.uint(8, "firmwareVersion")
    selection = []
    for i in range(r.uint(4, "pcrSelect count")):
        bank = _hash(r, f"pcrSelect[{i}].hash")
        bits = r.take(r.uint(1, f"pcrSelect[{i}].sizeofSelect"), f"pcrSelect[{i}].pcrSelect")
        selection.append((bank, tuple(8 * k + b for k, byte in enumerate(bits) for b in range(8) if byte >> b & 1)))
    digest = r.sized("pcrDigest")
    r.end()
    return Quote(signer, extra, clock, resets, restarts, bool(safe), firmware, tuple(selection), digest)


def parse_signature(data: bytes) -> Signature:
    r = Reader(data, "TPMT_SIGNATURE")
    alg = r.uint(2, "sigAlg")
    if alg in (ALG_RSASSA, ALG_RSAPSS):
        scheme, digest, value = "rsassa" if alg == ALG_RSASSA else "rsapss", _hash(r, "hash"), r.sized("sig")
    elif alg == ALG_ECDSA:
        scheme, digest = "ecdsa", _hash(r, "hash")
        sig_r, sig_s = r.sized("signatureR"), r.sized("signatureS")
        value = utils.encode_dss_signature(int.from_bytes(sig_r, "big"), int.from_bytes(sig_s, "big"))
    else:
        raise EvidenceFormatError(f"TPMT_SIGNATURE: sigAlg 0x{alg:04x} is not RSASSA, RSAPSS or ECDSA")
    r.end()
    return Signature(scheme, digest, value)


def _skip_scheme(r: Reader, field: str) -> None:
    """A TPMT_SYM_DEF_OBJECT / TPMT_*_SCHEME / TPMT_KDF_SCHEME: an algorithm, then its details unless it is NULL."""
    alg = r.uint(2, field)
    if alg != ALG_NULL:  # symmetric: keyBits and mode; ECDAA: hash and count; any other scheme: its hash
        r.take(4 if field == "symmetric" or alg == ALG_ECDAA else 2, f"{field} details")


def parse_public(data: bytes) -> PublicArea:
    """A TPM2B_PUBLIC (size-prefixed, as `tpm2_readpublic -f tss` writes it) or a bare TPMT_PUBLIC."""
    if len(data) >= 2 and int.from_bytes(data[:2], "big") == len(data) - 2:
        data = data[2:]
    r = Reader(data, "TPMT_PUBLIC")
    kind, name_alg, attributes = r.uint(2, "type"), _hash(r, "nameAlg"), r.uint(4, "objectAttributes")
    r.sized("authPolicy")
    _skip_scheme(r, "symmetric")
    _skip_scheme(r, "scheme")
    if kind == ALG_RSA:
        bits, exponent = r.uint(2, "keyBits"), r.uint(4, "exponent") or 65537
        n = int.from_bytes(r.sized("unique"), "big")
        if n.bit_length() != bits:
            raise EvidenceFormatError(f"TPMT_PUBLIC: RSA modulus of {n.bit_length()} bits, keyBits says {bits}")
        key: rsa.RSAPublicKey | ec.EllipticCurvePublicKey = rsa.RSAPublicNumbers(exponent, n).public_key()
    elif kind == ALG_ECC:
        curve = r.uint(2, "curveID")
        _skip_scheme(r, "kdf")
        x, y = r.sized("unique.x"), r.sized("unique.y")
        if curve not in CURVES:
            raise EvidenceFormatError(f"TPMT_PUBLIC: ECC curve 0x{curve:04x} is not P-256, P-384 or P-521")
        try:
            key = ec.EllipticCurvePublicNumbers(int.from_bytes(x, "big"), int.from_bytes(y, "big"),
                                                CURVES[curve]()).public_key()
        except ValueError:
            raise EvidenceFormatError("TPMT_PUBLIC: the ECC point is not on its curve") from None
    else:
        raise EvidenceFormatError(f"TPMT_PUBLIC: type 0x{kind:04x} is neither RSA nor ECC")
    r.end()
    return PublicArea(data, name_alg, attributes, key)


def pcr_digest(values: list[bytes], hash_name: str) -> bytes:
    """The quote's pcrDigest of these PCR values (in selection order): H(value_1 || ... || value_n)."""
    return hashlib.new(hash_name, b"".join(values)).digest()


def extend(value: bytes, digest: bytes, hash_name: str = "sha256") -> bytes:
    """TPM2_PCR_Extend: the PCR's new value H(old value || digest)."""
    return hashlib.new(hash_name, value + digest).digest()


def selection_text(selection: tuple[tuple[str, tuple[int, ...]], ...]) -> str:
    """"sha256:0,1,2,23" (tpm2-tools' notation), banks joined by '+'."""
    return "+".join(f"{bank}:{','.join(map(str, pcrs))}" for bank, pcrs in selection)


def split_pcr_values(blob: bytes, selection: tuple[tuple[str, tuple[int, ...]], ...]) -> dict[str, dict[int, bytes]]:
    """The PCR values `tpm2_quote --pcrs_format values` writes (digests back to back in selection order), per bank
    and index."""
    out: dict[str, dict[int, bytes]] = {}
    at = 0
    for bank, pcrs in selection:
        size = hashlib.new(bank).digest_size
        for i in pcrs:
            if at + size > len(blob):
                raise EvidenceFormatError(f"PCR values: {len(blob)} bytes, too few for the selection "
                                          f"{selection_text(selection)}")
            out.setdefault(bank, {})[i] = blob[at:at + size]
            at += size
    if at != len(blob):
        raise EvidenceFormatError(f"PCR values: {len(blob) - at} bytes more than the selection holds")
    return out
