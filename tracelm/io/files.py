"""Reading a file a user names (a trace, a key, a batch input, a session file, a schema): a regular file only, of
at most a bound, so that `/dev/zero`, a FIFO or a sparse file of a terabyte is an error naming it, never a read
that hangs or grows until memory runs out."""

from __future__ import annotations

import os
import stat

from tracelm.state.errors import TracelmError

MiB = 1 << 20
GiB = 1 << 30

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def read_regular(path: str | os.PathLike, what: str, limit: int,
                 error: type[TracelmError] = TracelmError) -> bytes:
    """The bytes of the regular file `path` (`what` it is, for messages), if it holds at most `limit` bytes; `error`
    naming the file otherwise. The file is opened without blocking (a FIFO with no writer would wait for one) and
    checked before anything is read: not a folder, FIFO, device or socket, and no larger than the bound."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise error(f"{path}: cannot read {what}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")
            raise error(f"{path}: {what} is {kind}, not a regular file")
        if st.st_size > limit:
            raise error(f"{path}: {what} of {st.st_size} bytes is larger than the {limit} bytes tracelm reads")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(st.st_size)  # the file as it was when checked (what is appended after is not read)
    except OSError as e:
        raise error(f"{path}: cannot read {what}: {e.strerror or e}") from None
    finally:
        os.close(fd)


def read_regular_text(path: str | os.PathLike, what: str, limit: int,
                      error: type[TracelmError] = TracelmError) -> str:
    """`read_regular` decoded as UTF-8 (bytes that are not: `error` naming the offset)."""
    data = read_regular(path, what, limit, error)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{path}: {what} is not UTF-8 text (byte 0x{data[e.start]:02X} at offset {e.start})") from None
