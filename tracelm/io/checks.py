"""Checks every reader applies to a field before using it: its type and its range, by the format's rules.

Each check returns the value as the reader needs it (an int, a float, a list of strings, ...) or raises
`ModelFormatError` (a TracelmError: one line, exit 2 from the CLI) naming where the field came from (`where`:
a file and, inside it, a key or tensor) and what was wrong. They run once per load, never per stage call.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tracelm.state.errors import ModelFormatError, TracelmError

# the widest attention head a reader accepts (real models: 64 to 512): a larger one is corrupt, and the RoPE tables
# computed from it before any tensor is read would be allocated from it
MAX_HEAD_DIM = 1 << 16


def kind(value: Any) -> str:
    """What a value is, in words, for an error message."""
    if value is None:
        return "null"
    if isinstance(value, bool | np.bool_):
        return f"a boolean ({value})"
    if isinstance(value, int | np.integer):
        return f"an integer ({value})"
    if isinstance(value, float | np.floating):
        return f"a number ({value:g})"
    if isinstance(value, str):
        return f"a string ({value[:40]!r})"
    if isinstance(value, np.ndarray):
        return f"an array of {value.size} {value.dtype} values"
    if isinstance(value, list | tuple):
        return f"an array of {len(value)} values"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def fail(where: str, what: str, error: type[TracelmError] = ModelFormatError) -> TracelmError:
    return error(f"{where}: {what}")


def integer(value: Any, where: str, lo: int | None = None, hi: int | None = None) -> int:
    """An integer (not a boolean) within lo..hi (either bound may be None)."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        raise fail(where, f"expected an integer, got {kind(value)}")
    value = int(value)
    if lo is not None and value < lo:
        raise fail(where, f"{value} is below the minimum {lo}")
    if hi is not None and value > hi:
        raise fail(where, f"{value} is above the maximum {hi}")
    return value


def number(value: Any, where: str, lo: float | None = None, hi: float | None = None, *, lo_open: bool = False
           ) -> float:
    """A finite number (an integer or a float, not a boolean) within lo..hi; `lo_open`: lo itself excluded."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | float | np.integer | np.floating):
        raise fail(where, f"expected a number, got {kind(value)}")
    value = float(value)
    if not np.isfinite(value):
        raise fail(where, f"expected a finite number, got {value}")
    if lo is not None and (value < lo or (lo_open and value == lo)):
        raise fail(where, f"{value:g} is {'not above' if lo_open else 'below'} the minimum {lo:g}")
    if hi is not None and value > hi:
        raise fail(where, f"{value:g} is above the maximum {hi:g}")
    return value


def boolean(value: Any, where: str) -> bool:
    if not isinstance(value, bool | np.bool_):
        raise fail(where, f"expected a boolean, got {kind(value)}")
    return bool(value)


def string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise fail(where, f"expected a string, got {kind(value)}")
    return value


def strings(value: Any, where: str) -> list[str]:
    """An array of strings (a GGUF string array reads as a list of str)."""
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise fail(where, f"expected an array of strings, got {kind(value)}")
    return value


def numbers(value: Any, where: str, count: int | None = None) -> np.ndarray:
    """A numeric array (a GGUF number array reads as numpy; a list of numbers is taken too), of `count` values when
    given."""
    if isinstance(value, list | tuple) and not any(isinstance(x, bool) or not isinstance(x, int | float)
                                                   for x in value):
        value = np.asarray(value) if value else np.zeros(0, np.int64)
    if not isinstance(value, np.ndarray) or value.dtype.kind not in "iuf" or value.ndim != 1:
        raise fail(where, f"expected an array of numbers, got {kind(value)}")
    if count is not None and len(value) != count:
        raise fail(where, f"has {len(value)} values, expected {count}")
    return value


def integers(value: Any, where: str, count: int | None = None) -> np.ndarray:
    arr = numbers(value, where, count)
    if arr.dtype.kind not in "iu":
        raise fail(where, f"expected an array of integers, got {kind(value)}")
    return arr


def power_of_two(value: Any, where: str, multiple_of: int = 1) -> int:
    n = integer(value, where, lo=multiple_of)
    if n & (n - 1) or n % multiple_of:
        raise fail(where, f"{n} is not a power of two and a multiple of {multiple_of}")
    return n


def shape(value: Any, where: str) -> tuple[int, ...]:
    """A tensor shape: a list of positive integers."""
    if not isinstance(value, list | tuple):
        raise fail(where, f"shape: expected an array of integers, got {kind(value)}")
    return tuple(integer(d, f"{where}: shape", lo=1) for d in value)


def mapping(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise fail(where, f"expected a JSON object, got {kind(value)}")
    return value


def json_value(text: str | bytes, where: str, error: type[TracelmError] = ModelFormatError) -> Any:
    """Parsed JSON, or `error` naming `where`: not UTF-8, not JSON, NaN/Infinity literals, or nested too deep for
    the parser (a RecursionError)."""
    try:
        return json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise error(f"{where}: JSON nested too deeply") from None
    except json.JSONDecodeError as e:
        raise error(f"{where}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise error(f"{where}: not valid JSON ({e})") from None


def json_object(text: str | bytes, where: str, error: type[TracelmError] = ModelFormatError) -> dict[str, Any]:
    value = json_value(text, where, error)
    if not isinstance(value, dict):
        raise error(f"{where}: expected a JSON object, got {kind(value)}")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def inside(folder: Path, relative: Any, where: str) -> Path:
    """`folder / relative` for a relative path that stays inside `folder` (no absolute path, no `..` out of it)."""
    name = string(relative, where)
    if not name or Path(name).is_absolute():
        raise fail(where, f"{name!r} is not a relative path inside the model folder")
    path = folder / name
    if not path.resolve().is_relative_to(folder.resolve()):
        raise fail(where, f"{name!r} leads outside the model folder")
    return path


def choice(value: Any, where: str, options: Sequence[str]) -> str:
    if value not in options:
        raise fail(where, f"{value!r} is not one of {', '.join(map(repr, options))}")
    return value
