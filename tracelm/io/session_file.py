"""Session files: a saved conversation (`Session.save`, `tracelm chat --session`, `tracelm serve --sessions`).

A session file holds a `CacheSnapshot` (the token ids and each layer's keys/values of the positions it holds)
with what it was made with, so that it is resumed only where its numbers are the ones the engine would
compute again. Layout (little-endian):

    MAGIC                 16 bytes, b"tracelm-session\\n"
    header length H       8 bytes, unsigned
    header                H bytes of UTF-8 JSON (below)
    zero padding          to a multiple of ALIGN bytes from the start of the file
    arrays                each at `offset` (from the end of the padding, a multiple of ALIGN), C order, raw
    sha256                32 bytes: sha256 of every byte before it

The header: `format` ("tracelm-session"), `format_version` (1), `tracelm_version`, `model_file` (its name, for
messages), `model_sha256` (as a trace header has it), `model_config` (the ModelConfig as a dict), `compute`
(kernels or reference: their keys and values differ), `kind` ("chat" or "server"), `session_id`, `messages`
(a chat's conversation, or null), `trace_hash` (the last line hash of the conversation's latest trace, which
the next trace's header names: docs/trace.md), `tokens`, `first` (per layer the oldest position held),
`arrays` (per layer its keys then its values: `dtype`, `shape`, `offset`), `data_bytes`, and the timing field
`created_unix_seconds`. No pickle: arrays are read with numpy.frombuffer in the dtypes listed in DTYPES only.

Written to a temporary file beside the target, fsync'ed and renamed over it (`os.replace`), so a reader sees
the old file or the new one, never half of one. Reading checks, in order, and raises a named error
(tracelm.state.errors) naming the file: not a session file (`SessionFileError`), a newer or older format
(`SessionIncompatible`), cut short (`SessionFileTruncated`), bytes that do not match the sha256
(`SessionFileTampered`); `check_session` then refuses another model or ModelConfig (`SessionModelMismatch`)
and another tracelm version or compute mode (`SessionIncompatible`).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import struct
import time
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from tracelm.io import checks
from tracelm.io.files import GiB, read_regular
from tracelm.state.cache import CacheSnapshot, kv_row_bytes
from tracelm.state.errors import (
    SessionFileError,
    SessionFileTampered,
    SessionFileTruncated,
    SessionIncompatible,
    SessionModelMismatch,
)
from tracelm.version import __version__

MAGIC = b"tracelm-session\n"
FORMAT = "tracelm-session"
FORMAT_VERSION = 1
ALIGN = 64
DIGEST_BYTES = 32
DTYPES = ("<f4", "<f2", "|u1")  # what a Cache's keys/values are held in (|u1: kv_cache q8_0's blocks)
SUFFIX = ".tlsession"
MAX_SESSION_BYTES = 16 * GiB  # a larger session file is refused before it is read (it is read whole, then hashed)


@attrs.frozen(eq=False)
class SavedSession:
    """A session file's content (see the module docstring for the fields)."""

    snapshot: CacheSnapshot
    model_sha256: str
    model_config: dict[str, Any]
    compute: str
    kind: str = "chat"
    messages: list[dict[str, Any]] | None = None
    trace_hash: str | None = None
    session_id: str | None = None
    model_file: str = ""
    tracelm_version: str = __version__


def config_dict(cfg: Any) -> dict[str, Any]:
    """A ModelConfig as the header holds it (JSON's types: tuples are lists)."""
    return json.loads(json.dumps(attrs.asdict(cfg)))


def _layout(snap: CacheSnapshot) -> tuple[list[dict[str, Any]], list[np.ndarray], int]:
    """The arrays table, the arrays in file order (C-contiguous, little-endian) and their bytes with padding."""
    table, arrays, offset = [], [], 0
    for k, v in zip(snap.keys, snap.values, strict=True):
        for a in (k, v):
            a = np.ascontiguousarray(a, a.dtype.newbyteorder("<"))
            table.append({"dtype": a.dtype.str, "shape": list(a.shape), "offset": offset})
            arrays.append(a)
            offset += -(-a.nbytes // ALIGN) * ALIGN
    return table, arrays, offset


def _header(saved: SavedSession, table: list[dict[str, Any]], data_bytes: int) -> bytes:
    snap = saved.snapshot
    head = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "tracelm_version": saved.tracelm_version,
        "model_file": saved.model_file, "model_sha256": saved.model_sha256, "model_config": saved.model_config,
        "compute": saved.compute, "kind": saved.kind, "session_id": saved.session_id, "messages": saved.messages,
        "trace_hash": saved.trace_hash, "tokens": list(snap.tokens), "first": list(snap.first), "arrays": table,
        "data_bytes": data_bytes, "created_unix_seconds": round(time.time(), 3),
    }
    return json.dumps(head, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def write_session(path: str | os.PathLike, saved: SavedSession) -> int:
    """Write `saved` to `path` atomically (temporary file, fsync, rename); return the file's size in bytes."""
    path = Path(path)
    table, arrays, data_bytes = _layout(saved.snapshot)
    header = _header(saved, table, data_bytes)
    start = len(MAGIC) + 8 + len(header)
    pieces = [MAGIC, struct.pack("<Q", len(header)), header, bytes(-start % ALIGN)]
    for a in arrays:
        pieces += [memoryview(a).cast("B"), bytes(-a.nbytes % ALIGN)]
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.part")
    h = hashlib.sha256()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "xb") as f:
            for piece in pieces:
                h.update(piece)
                f.write(piece)
            f.write(h.digest())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise SessionFileError(f"{path}: cannot write session file: {e.strerror or e}") from None
    _fsync_dir(path.parent)
    return start + -start % ALIGN + data_bytes + DIGEST_BYTES


def _fsync_dir(folder: Path) -> None:
    """Make the rename itself durable (where the system allows opening a folder)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_session(path: str | os.PathLike) -> SavedSession:
    """Read and check a session file (see the module docstring); raise its named error when it is not whole."""
    path = Path(path)
    data = read_regular(path, "session file", MAX_SESSION_BYTES, SessionFileError)
    head, start = _read_header(path, data)
    expected = start + head["data_bytes"] + DIGEST_BYTES
    if len(data) < expected:
        raise SessionFileTruncated(f"{path}: session file truncated: {len(data)} bytes of the {expected} its header "
                                   "declares")
    if len(data) > expected:
        raise SessionFileTampered(f"{path}: session file damaged: {len(data) - expected} bytes past the end its "
                                  "header declares")
    if hashlib.sha256(memoryview(data)[: expected - DIGEST_BYTES]).digest() != data[expected - DIGEST_BYTES :]:
        raise SessionFileTampered(f"{path}: session file tampered or damaged: its bytes do not match its sha256")
    return _saved(path, head, _arrays(path, head, memoryview(data)[start : expected - DIGEST_BYTES]))


def _read_header(path: Path, data: bytes) -> tuple[dict[str, Any], int]:
    """The header as a dict (format checked) and where the arrays begin."""
    if not MAGIC.startswith(data[: len(MAGIC)]):
        raise SessionFileError(f"{path}: not a tracelm session file (it does not begin with {MAGIC!r})")
    if len(data) < len(MAGIC) + 8:
        raise SessionFileTruncated(f"{path}: session file truncated: {len(data)} bytes, inside its first 24")
    (n,) = struct.unpack_from("<Q", data, len(MAGIC))
    end = len(MAGIC) + 8 + n
    if end > len(data):
        raise SessionFileTruncated(f"{path}: session file truncated inside its header ({len(data)} of {end} bytes)")
    head = checks.json_value(data[len(MAGIC) + 8 : end], f"{path}: session file damaged: its header",
                             SessionFileTampered)
    if not isinstance(head, dict) or head.get("format") != FORMAT:
        raise SessionFileTampered(f"{path}: session file damaged: its header has no format {FORMAT!r}")
    if head.get("format_version") != FORMAT_VERSION:
        raise SessionIncompatible(f"{path}: session format version {head.get('format_version')!r}; this tracelm "
                                  f"reads version {FORMAT_VERSION}")
    if not isinstance(head.get("data_bytes"), int) or head["data_bytes"] < 0:
        raise SessionFileTampered(f"{path}: session file damaged: data_bytes {head.get('data_bytes')!r}")
    return head, end + -end % ALIGN


def _arrays(path: Path, head: dict[str, Any], data: memoryview) -> list[np.ndarray]:
    """The arrays the header lists, read from `data` (the hash already matched: only a writer's bug fails here)."""
    out = []
    try:
        for entry in head["arrays"]:
            if entry["dtype"] not in DTYPES:
                raise ValueError(f"dtype {entry['dtype']!r} is not one of {', '.join(DTYPES)}")
            dtype, shape = np.dtype(entry["dtype"]), tuple(int(d) for d in entry["shape"])
            count, offset = int(np.prod(shape)), int(entry["offset"])
            if offset < 0 or offset + count * dtype.itemsize > len(data):
                raise ValueError(f"array at {offset} runs past the data")
            out.append(np.frombuffer(data, dtype, count, offset).reshape(shape))
    except (KeyError, TypeError, ValueError) as e:
        raise SessionFileTampered(f"{path}: session file damaged: arrays table: {e}") from None
    return out


def _saved(path: Path, head: dict[str, Any], arrays: list[np.ndarray]) -> SavedSession:
    try:
        snap = CacheSnapshot(head["tokens"], head["first"], arrays[0::2], arrays[1::2])
        if len(snap.first) != len(arrays) // 2:
            raise ValueError(f"{len(snap.first)} layers listed, {len(arrays) // 2} layers of arrays")
        return SavedSession(snap, str(head["model_sha256"]), dict(head["model_config"]), str(head["compute"]),
                            str(head["kind"]), _messages(head.get("messages")), _text(head, "trace_hash"),
                            _text(head, "session_id"), str(head.get("model_file", "")), str(head["tracelm_version"]))
    except (KeyError, TypeError, ValueError) as e:
        raise SessionFileTampered(f"{path}: session file damaged: {e}") from None


def _messages(value: Any) -> list[dict[str, str]] | None:
    """The header's messages: null, or an array of {"role", "content"} strings (a ValueError naming what is not)."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise ValueError(f"messages: expected an array of messages, got {checks.kind(value)}")
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"messages[{i}]: expected an object with a string role and content, got {checks.kind(m)}")
    return value


def _text(head: dict[str, Any], key: str) -> str | None:
    value = head.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{key}: expected a string or null, got {checks.kind(value)}")
    return value


def check_session(path: str | os.PathLike, saved: SavedSession, model_sha256: str, model_config: Any,
                  compute: str) -> None:
    """Refuse a file made with another model or ModelConfig, another tracelm version or compute mode."""
    theirs = saved.model_file or "another model"
    if saved.model_sha256 != model_sha256:
        raise SessionModelMismatch(f"{path}: session saved with another model ({theirs}, sha256 "
                                   f"{saved.model_sha256[:16]}...), not this one (sha256 {model_sha256[:16]}...)")
    mine = config_dict(model_config)
    if saved.model_config != mine:
        diff = sorted(k for k in mine.keys() | saved.model_config.keys() if mine.get(k) != saved.model_config.get(k))
        raise SessionModelMismatch(f"{path}: session saved with another ModelConfig (differs in {', '.join(diff)})")
    if saved.tracelm_version != __version__:
        raise SessionIncompatible(f"{path}: session saved by tracelm {saved.tracelm_version}, this is {__version__}: "
                                  "its keys and values may not be the ones this version computes")
    if saved.compute != compute:
        raise SessionIncompatible(f"{path}: session saved with compute {saved.compute}, this run uses {compute}: "
                                  "their keys and values differ")
    arrays = (*saved.snapshot.keys, *saved.snapshot.values)
    shapes = {tuple(k.shape[::2]) for k in arrays}
    q8_row = kv_row_bytes("q8_0", model_config.head_dim)  # kv_cache q8_0: a position's blocks, in bytes
    rows = {(model_config.n_head_kv, q8_row if k.dtype == np.uint8 else model_config.head_dim) for k in arrays}
    if shapes - rows or len(saved.snapshot.keys) != model_config.n_layer:
        raise SessionFileTampered(f"{path}: session file damaged: {len(saved.snapshot.keys)} layers of keys/values of "
                                  f"[kv heads, head dim] {sorted(shapes)} for a model of {model_config.n_layer} "
                                  f"layers of {[model_config.n_head_kv, model_config.head_dim]}")
