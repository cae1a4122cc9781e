"""A cursor over a binary structure: fixed-width integers and sized buffers, each read naming the structure and
offset when the bytes run out (an EvidenceFormatError, never an IndexError)."""

from __future__ import annotations

from tracelm.state.errors import EvidenceFormatError


class Reader:
    def __init__(self, data: bytes, what: str, byteorder: str = "big"):
        self.data, self.what, self.order, self.at = bytes(data), what, byteorder, 0

    def take(self, n: int, field: str) -> bytes:
        if n < 0 or self.at + n > len(self.data):
            raise EvidenceFormatError(f"{self.what}: {field} at byte {self.at} needs {n} bytes, "
                                      f"{len(self.data) - self.at} left")
        out = self.data[self.at:self.at + n]
        self.at += n
        return out

    def uint(self, n: int, field: str) -> int:
        return int.from_bytes(self.take(n, field), self.order)  # type: ignore[arg-type]

    def sized(self, field: str, width: int = 2) -> bytes:
        """A buffer prefixed by its size (a TPM2B: 2 bytes, big-endian)."""
        return self.take(self.uint(width, f"{field} size"), field)

    def rest(self) -> bytes:
        out = self.data[self.at:]
        self.at = len(self.data)
        return out

    def end(self) -> None:
        """Nothing may follow the structure."""
        if self.at != len(self.data):
            raise EvidenceFormatError(f"{self.what}: {len(self.data) - self.at} bytes after the end of the structure")
