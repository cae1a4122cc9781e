"""A small DER reader for the certificate extensions `cryptography` leaves raw: Intel's SGX extension of a PCK
certificate (a SEQUENCE of (OID, value) pairs, some nested) and AMD's VCEK extensions (an INTEGER or OCTET STRING
each)."""

from __future__ import annotations

from typing import Any

from tracelm.state.errors import EvidenceFormatError

INTEGER, OCTET_STRING, OID, ENUMERATED, SEQUENCE = 0x02, 0x04, 0x06, 0x0A, 0x30


def items(data: bytes, what: str) -> list[tuple[int, bytes]]:
    """The (tag, contents) of each DER element in `data`, one after another."""
    return [(tag, contents) for tag, contents, _whole in _elements(data, what)]


def split(data: bytes, what: str) -> list[bytes]:
    """Each DER element in `data` whole (tag, length and contents): certificates back to back."""
    return [whole for _tag, _contents, whole in _elements(data, what)]


def _elements(data: bytes, what: str) -> list[tuple[int, bytes, bytes]]:
    out, at = [], 0
    while at < len(data):
        start = at
        if at + 2 > len(data):
            raise EvidenceFormatError(f"{what}: DER cut off at byte {at}")
        tag, size = data[at], data[at + 1]
        at += 2
        if size & 0x80:
            n = size & 0x7F
            if n == 0 or n > 4 or at + n > len(data):
                raise EvidenceFormatError(f"{what}: bad DER length at byte {at}")
            size, at = int.from_bytes(data[at:at + n], "big"), at + n
        if at + size > len(data):
            raise EvidenceFormatError(f"{what}: DER element at byte {at} runs past the end")
        out.append((tag, data[at:at + size], data[start:at + size]))
        at += size
    return out


def oid_text(contents: bytes) -> str:
    arcs, value = [], 0
    for b in contents:
        value = value << 7 | b & 0x7F
        if not b & 0x80:
            arcs.append(value)
            value = 0
    first = min(arcs[0] // 40, 2) if arcs else 0
    return ".".join(map(str, [first, arcs[0] - 40 * first, *arcs[1:]])) if arcs else ""


def value(tag: int, contents: bytes) -> Any:
    """An INTEGER or ENUMERATED as int, an OCTET STRING as bytes, anything else as its raw contents."""
    if tag in (INTEGER, ENUMERATED):
        return int.from_bytes(contents, "big", signed=True)
    return contents


def single(data: bytes, what: str) -> Any:
    """The value of a lone DER element (a VCEK extension's)."""
    found = items(data, what)
    if len(found) != 1:
        raise EvidenceFormatError(f"{what}: {len(found)} DER elements where one was expected")
    return value(*found[0])


def oid_map(data: bytes, what: str) -> dict[str, Any]:
    """A SEQUENCE OF SEQUENCE {OID, value} (Intel's SGX extension), flattened: OID -> value, with a nested
    sequence's pairs under their own OIDs."""
    out: dict[str, Any] = {}
    for tag, body in items(data, what):
        if tag != SEQUENCE:
            raise EvidenceFormatError(f"{what}: an element that is not a SEQUENCE")
        pair = items(body, what)
        if len(pair) != 2 or pair[0][0] != OID:
            raise EvidenceFormatError(f"{what}: a SEQUENCE that is not (OID, value)")
        key = oid_text(pair[0][1])
        if pair[1][0] == SEQUENCE:
            out.update(oid_map(pair[1][1], what))
        else:
            out[key] = value(*pair[1])
    return out
