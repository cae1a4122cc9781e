"""Sessions: conversations whose KV cache the server keeps between requests.

A session is one `Runner` (so one `Cache`) on the shared, read-only `LoadedModel`. A follow-up request
on the same session reuses the common prefix of what that Cache already holds, so only the new tokens
are prefilled. Sessions never share a Cache. The store is bounded by a count and by the KV memory the
caches may hold (each Cache is allocated whole for the context); the least recently used session is
dropped to make room. Used from the one worker thread only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from tracelm.session import Runner
from tracelm.state.errors import TracelmError


class SessionStore:
    def __init__(self, new_runner: Callable[[], Runner], max_sessions: int, max_bytes: int, bytes_per_session: int):
        self._new = new_runner
        self.bytes_per_session = bytes_per_session
        self.capacity = min(max_sessions, max_bytes // max(bytes_per_session, 1))
        self._runners: OrderedDict[str, Runner] = OrderedDict()
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._runners)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._runners

    @property
    def nbytes(self) -> int:
        return len(self._runners) * self.bytes_per_session

    def get(self, session_id: str) -> Runner:
        """The session's Runner (created empty if new), now the most recently used; may evict the least."""
        runner = self._runners.get(session_id)
        if runner is not None:
            self._runners.move_to_end(session_id)
            return runner
        if self.capacity == 0:
            raise TracelmError("sessions are off on this server (server.max_sessions or server.session_memory_mb "
                               "allows none)")
        while len(self._runners) >= self.capacity:
            self._runners.popitem(last=False)
            self.evicted += 1
        runner = self._runners[session_id] = self._new()
        return runner

    def drop(self, session_id: str) -> None:
        self._runners.pop(session_id, None)

    def ids(self) -> list[str]:
        """Session ids, least recently used first."""
        return list(self._runners)
