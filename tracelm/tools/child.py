"""Functions and objects run in a fresh child process, for benches whose figures must not share a process:
another engine's libraries and threads, a peak RSS of its own, a machine probe that must not warm this
process's caches. The child is started by the function itself (multiprocessing's spawn: a new interpreter
that imports the function's module), never by a module path in a string.

`run_child(fn, *args)` computes one value and ends; `Child(factory, *args)` keeps the object factory(*args)
built in its process and runs its methods there on `call`, one at a time, until `close`."""

from __future__ import annotations

import multiprocessing
import signal
from collections.abc import Callable
from typing import Any

from tracelm.state.errors import TracelmError


def _line(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0]


def _serve(conn: Any, fn: Callable[..., Any], args: tuple[Any, ...], keep: bool) -> None:
    """The child: fn(*args) sent back (keep=False), or kept and its methods answered as (name, kwargs) arrive,
    until None or the parent's end of the pipe closes (keep=True). An exception goes back as one line."""
    try:
        try:
            value = fn(*args)
        except BaseException as e:  # noqa: BLE001 -- one line for the parent, not a traceback
            conn.send(("error", _line(e)))
            return
        conn.send(("ok", None if keep else value))
        while keep:
            try:
                request = conn.recv()
            except EOFError:
                return
            if request is None:
                return
            method, kwargs = request
            try:
                conn.send(("ok", getattr(value, method)(**kwargs)))
            except BaseException as e:  # noqa: BLE001
                conn.send(("error", _line(e)))
    finally:
        conn.close()


def _start(fn: Callable[..., Any], args: tuple[Any, ...], keep: bool) -> tuple[Any, Any]:
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe(duplex=keep)
    proc = ctx.Process(target=_serve, args=(theirs, fn, args, keep), daemon=True)
    proc.start()
    theirs.close()
    return ours, proc


def _receive(conn: Any, proc: Any, timeout: float | None) -> Any:
    """The child's next answer; TracelmError when it raised (its line), was killed by a signal (ChildKilled),
    ended without a word, or gave none within `timeout` seconds (then it is killed)."""
    try:
        if not conn.poll(timeout):
            proc.kill()
            proc.join()
            raise TracelmError(f"timed out after {timeout:.0f} s")
        status, value = conn.recv()
    except EOFError:  # the child ended without a word: a signal, or os._exit
        raise _ended(proc) from None
    if status == "error":
        raise TracelmError(value)
    return value


def _ended(proc: Any) -> TracelmError:
    proc.join()
    code = proc.exitcode or 0
    if code < 0:
        return ChildKilled(_signal_name(-code))
    return TracelmError(f"child exited with code {code} and no result")


def run_child(fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> Any:
    """fn(*args) computed in a new process and returned (a picklable value). TracelmError when it raised
    (its one-line reason), was killed by a signal (ChildKilled) or ran past `timeout` seconds (killed)."""
    conn, proc = _start(fn, args, keep=False)
    try:
        return _receive(conn, proc, timeout)
    finally:
        conn.close()
        proc.join()


class Child:
    """factory(*args) built in a new process and kept there (its own threads, libraries and peak RSS);
    `call(method, **kwargs)` runs one of its methods there and returns the (picklable) value. Errors as
    run_child's, for the build (the constructor raises) and for each call; after one the child is ended."""

    def __init__(self, factory: Callable[..., Any], *args: Any, timeout: float | None = None):
        self._conn, self._proc = _start(factory, args, keep=True)
        self._answer(timeout)

    def call(self, method: str, timeout: float | None = None, **kwargs: Any) -> Any:
        try:
            self._conn.send((method, kwargs))
        except OSError:  # BrokenPipeError, ConnectionResetError, a closed handle
            self._conn.close()
            raise _ended(self._proc) from None
        return self._answer(timeout)

    def _answer(self, timeout: float | None) -> Any:
        try:
            return _receive(self._conn, self._proc, timeout)
        except TracelmError:
            self.close()
            raise

    def close(self) -> None:
        """End the child (asked first, killed when it does not end within seconds); safe to call again."""
        if not self._conn.closed:
            try:
                self._conn.send(None)
            except OSError:  # BrokenPipeError, ConnectionResetError, a closed handle
                pass
            self._conn.close()
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()


class ChildKilled(TracelmError):
    """The child was killed by a signal (its name is the message)."""

    def __init__(self, name: str):
        super().__init__(f"child killed by {name}")
        self.signal_name = name


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
