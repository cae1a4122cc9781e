"""Sessions: conversations whose KV cache the server keeps between requests.

A session is one `Runner` (so one `Cache`) on the shared, read-only `LoadedModel`. A follow-up request
on the same session reuses the common prefix of what that Cache already holds, so only the new tokens
are prefilled. Sessions never share a Cache. The store is bounded by a count and by the bytes of every array
the sessions' runners hold (`session.held_bytes`: each Cache's keys and values allocated whole for the context, its
RoPE tables, masks and pass buffers); the least recently used session not decoding is dropped to make room, and
the freed memory is handed back to the OS. Used from the one worker thread only (`nbytes` also from /health).

With `server.sessions_dir` (`tracelm serve --sessions DIR`) each session is also a session file in that
folder (tracelm/io/session_file.py), written atomically after each of its requests and read when a request
names a session not in memory: a session survives its eviction from memory and a restart. The folder's
session files take at most `server.sessions_max_mb`: the least recently used (by modification time, which a
read refreshes) are deleted first. A file that cannot be resumed (damaged, truncated, another model or
version) is deleted with a warning in the log, and its session starts empty.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from pathlib import Path

from tracelm.session import SUFFIX, Runner, load_conversation, save_conversation
from tracelm.state.errors import TracelmError

log = logging.getLogger("tracelm.server")


class SessionFiles:
    """The session files of one folder: one per session id, bounded in bytes, least recently used out."""

    def __init__(self, folder: str | os.PathLike, max_bytes: int, model_sha256: str, compute: str):
        self.folder, self.max_bytes = Path(folder), max_bytes
        self.model_sha256, self.compute = model_sha256, compute
        self.evicted = 0  # files deleted to keep the folder within max_bytes
        self.dropped = 0  # files that could not be resumed
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TracelmError(f"server.sessions_dir {self.folder}: cannot create: {e.strerror}") from None

    def path(self, session_id: str) -> Path:
        """The session's file: named by a hash of its id (any string), which the file's header repeats."""
        return self.folder / f"{hashlib.sha256(session_id.encode()).hexdigest()[:32]}{SUFFIX}"

    def load(self, session_id: str, runner: Runner) -> bool:
        """Restore the session's saved positions into `runner`'s empty Cache; False when there is no file, or
        one that cannot be resumed (deleted, with a warning)."""
        path = self.path(session_id)
        if not path.is_file():
            return False
        try:
            saved = load_conversation(path, runner, self.model_sha256, self.compute)
            if saved.session_id != session_id:
                raise TracelmError(f"{path}: holds session {saved.session_id!r}, not {session_id!r}")
        except (TracelmError, OSError, ValueError) as e:
            log.warning("session %r: its saved file is dropped: %s", session_id, e)
            runner.cache.reset()
            path.unlink(missing_ok=True)
            self.dropped += 1
            return False
        _touch(path)  # now the most recently used
        return True

    def save(self, session_id: str, runner: Runner) -> None:
        """Write the session's file (atomically), then delete the least recently used files past max_bytes; a
        failure to write is a warning: the request it follows has been answered."""
        try:
            save_conversation(self.path(session_id), runner, self.model_sha256, self.compute, kind="server",
                              session_id=session_id)
        except TracelmError as e:
            log.warning("session %r: not saved: %s", session_id, e)
            return
        _touch(self.path(session_id))
        self.bound(self.path(session_id))

    def bound(self, newest: Path | None = None) -> None:
        """Delete the least recently used session files until the folder holds at most max_bytes of them."""
        _total, deleted = prune_oldest(self.folder, f"*{SUFFIX}", self.max_bytes)
        self.evicted += len(deleted)
        for f, size in deleted:
            if f == newest:
                log.warning("session file %s (%d bytes) alone exceeds server.sessions_max_mb: deleted", f, size)


def prune_oldest(folder: Path, pattern: str, max_bytes: int,
                 spare: Collection[Path] = ()) -> tuple[int, list[tuple[Path, int]]]:
    """Delete the files of `folder` matching `pattern`, least recently modified first, until they hold at most
    `max_bytes` (those in `spare` count, but stay). Returns the bytes they then hold, and each file deleted with its
    size."""
    files = []
    for f in folder.glob(pattern):
        try:
            st = f.stat()
        except OSError:
            continue
        files.append((st.st_mtime_ns, f.name, st.st_size, f))
    files.sort()
    total = sum(size for _t, _n, size, _f in files)
    deleted = []
    for _t, _n, size, f in files:
        if total <= max_bytes:
            break
        if f in spare:
            continue
        f.unlink(missing_ok=True)
        total -= size
        deleted.append((f, size))
    return total, deleted


def _touch(path: Path) -> None:
    """Mark a file most recently used: its modification time now, to the nanosecond (a file system stamps writes
    with a coarser clock, which two saves in a row may share)."""
    now = time.time_ns()
    try:
        os.utime(path, ns=(now, now))
    except OSError:
        pass


class SessionStore:
    """Session runners by id, least recently used first. Bounded by a count (`capacity`: max_sessions, and as many
    new runners as max_bytes holds) and by the bytes their arrays really hold (`measure`, a runner's: its Cache
    grows masks and pass buffers as it is used): `bound` evicts the least recently used until both hold, then
    `release` (malloc_trim) gives the freed memory back to the OS."""

    def __init__(self, new_runner: Callable[[], Runner], max_sessions: int, max_bytes: int, bytes_per_session: int,
                 files: SessionFiles | None = None, measure: Callable[[Runner], int] | None = None,
                 release: Callable[[], None] = lambda: None):
        self._new = new_runner
        self.files = files  # where sessions are also saved (None: in memory only)
        self.bytes_per_session = bytes_per_session
        self.max_bytes = max_bytes
        self.capacity = min(max_sessions, max_bytes // max(bytes_per_session, 1))
        self._measure = measure or (lambda _runner: bytes_per_session)
        self._release = release
        self._runners: OrderedDict[str, Runner] = OrderedDict()
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._runners)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._runners

    @property
    def nbytes(self) -> int:
        """The bytes the stored sessions' arrays hold now."""
        return sum(self._measure(r) for r in list(self._runners.values()))

    def get(self, session_id: str, busy: frozenset[str] = frozenset()) -> Runner:
        """The session's Runner (created empty if new), now the most recently used; may evict the least recently
        used that is not `busy` (decoding: its Runner stays in use, so dropping it would free nothing)."""
        runner = self._runners.get(session_id)
        if runner is not None:
            self._runners.move_to_end(session_id)
            return runner
        if self.capacity == 0:
            raise TracelmError("sessions are off on this server (server.max_sessions or server.session_memory_mb "
                               "allows none)")
        self.bound(busy, room=1)
        runner = self._runners[session_id] = self._new()
        if self.files is not None:
            self.files.load(session_id, runner)
        return runner

    def bound(self, busy: frozenset[str] | set[str] = frozenset(), room: int = 0) -> int:
        """Evict the least recently used sessions not `busy` until `room` more fit the count and the stored ones'
        bytes (plus `room` new runners) are within max_bytes; memory is then released. Returns how many went."""
        evicted = 0
        while self._runners:
            over = self.nbytes + room * self.bytes_per_session > self.max_bytes
            if len(self._runners) + room <= self.capacity and not over:
                break
            victim = next((sid for sid in self._runners if sid not in busy), None)
            if victim is None:
                break
            del self._runners[victim]
            evicted += 1
        if evicted:
            self.evicted += evicted
            self._release()
        return evicted

    def save(self, session_id: str) -> None:
        """Save the session's Cache to its file (when the store has a folder and still holds the session)."""
        runner = self._runners.get(session_id)
        if self.files is not None and runner is not None:
            self.files.save(session_id, runner)

    def drop(self, session_id: str) -> None:
        self._runners.pop(session_id, None)

    def ids(self) -> list[str]:
        """Session ids, least recently used first."""
        return list(self._runners)
