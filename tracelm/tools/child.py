"""A function run in a fresh child process, for benches whose figures must not share a process: another
engine's libraries and threads, a peak RSS of its own, a machine probe that must not warm this process's
caches. The child is started by the function itself (multiprocessing's spawn: a new interpreter that
imports the function's module), never by a module path in a string."""

from __future__ import annotations

import multiprocessing
import signal
from collections.abc import Callable
from typing import Any

from tracelm.state.errors import TracelmError


def _child(send: Any, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        send.send(("ok", fn(*args)))
    except BaseException as e:  # noqa: BLE001 -- one line for the parent, not a traceback
        send.send(("error", f"{type(e).__name__}: {e}".splitlines()[0]))
    finally:
        send.close()


def run_child(fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> Any:
    """fn(*args) computed in a new process and returned (a picklable value). TracelmError when it raised
    (its one-line reason), was killed by a signal (ChildKilled) or ran past `timeout` seconds (killed)."""
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(send, fn, args), daemon=True)
    proc.start()
    send.close()
    try:
        if not receive.poll(timeout):
            proc.kill()
            raise TracelmError(f"timed out after {timeout:.0f} s")
        status, value = receive.recv()
    except EOFError:  # the child ended without a word: a signal, or os._exit
        proc.join()
        code = proc.exitcode or 0
        if code < 0:
            raise ChildKilled(_signal_name(-code)) from None
        raise TracelmError(f"child exited with code {code} and no result") from None
    finally:
        receive.close()
    proc.join()
    if status == "error":
        raise TracelmError(value)
    return value


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
