"""`tracelm tokenize` and `tracelm bench tokenizer`: a model's tokenizer alone (no weights), reading inputs and
ids, encoding and decoding them, timing encode/decode."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tracelm.io.files import GiB, read_regular_text
from tracelm.io.loader import load_tokenizer
from tracelm.state.errors import TracelmError


def tokenize_lines(model: str, inputs: list[str], decode: bool = False, separator: str | None = None,
                   add_special: bool = False, parse_special: bool = False, skip_special: bool = False
                   ) -> Iterator[str]:
    """The output lines of `tracelm tokenize` with `model`'s tokenizer: per input its ids as a JSON list, or
    with `decode` (inputs are lists of ids) its text, followed by `separator` when given."""
    tok = load_tokenizer(model)
    for text in inputs:
        if decode:
            yield tok.decode(parse_ids(text), skip_special=skip_special)
            if separator is not None:
                yield separator
        else:
            yield json.dumps(tok.encode(text, add_bos=add_special and None, add_eos=add_special and None,
                                        parse_special=parse_special))


def tokenizer_report(model: str, input_file: str | None = None) -> dict[str, Any]:
    """`tracelm bench tokenizer`: encode/decode rates of `model`'s tokenizer on a file (English prose by default)."""
    text = read_text_file(input_file) if input_file else english_prose()
    return {"text": input_file or PROSE_NOTE, **bench_tokenizer(load_tokenizer(model), text)}


def read_text_file(path: str | Path) -> str:
    """A UTF-8 text file; bytes that are not UTF-8 are an error that names the offset."""
    return read_regular_text(path, "input", GiB)


def split_inputs(text: str, separator: str | None) -> list[str]:
    """The inputs of a file: without a separator, one per line; with one, the runs of lines between lines
    equal to it (a separator line at the very end closes the last input rather than opening an empty one)."""
    if text.endswith("\n"):
        text = text[:-1]
    lines = text.split("\n") if text else []
    if separator is None:
        return lines
    inputs: list[str] = []
    group: list[str] = []
    for line in lines:
        if line == separator:
            inputs.append("\n".join(group))
            group = []
        else:
            group.append(line)
    if group:
        inputs.append("\n".join(group))
    return inputs


_ID_LIST = re.compile(r"^\s*\[?\s*(-?\d+(\s*[,\s]\s*-?\d+)*)?\s*\]?\s*$")


def parse_ids(line: str) -> list[int]:
    """Token ids written as a JSON array (`[1, 2]`) or separated by spaces or commas (`1 2`, `1,2`)."""
    if not _ID_LIST.match(line):
        raise TracelmError(f"not a list of token ids: {line[:80]!r}")
    return [int(x) for x in re.findall(r"-?\d+", line)]


PROSE_NOTE = "Python's own reference documentation (pydoc_data.topics), English prose with some code"


def english_prose() -> str:
    """About 0.5-0.8 MB of English prose that every Python installation carries."""
    try:
        from pydoc_data.topics import topics
    except ImportError as e:  # a stripped-down Python
        raise TracelmError(f"no built-in benchmark text ({e}); give one with --input-file") from None
    return "\n\n".join(topics[k] for k in sorted(topics))


def bench_tokenizer(tokenizer: Any, text: str, min_seconds: float = 2.0) -> dict[str, Any]:
    """Encode throughput (MB/s of UTF-8 input and tokens/s), line by line and as one string, and decode."""
    lines = [line for line in text.split("\n") if line]
    n_bytes = len(text.encode("utf-8"))

    def best(fn: Any) -> float:
        fn()
        times, t_end = [], time.perf_counter() + min_seconds
        while time.perf_counter() < t_end or len(times) < 2:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    ids = tokenizer.encode(text, add_bos=False)
    whole = best(lambda: tokenizer.encode(text, add_bos=False))
    per_line = best(lambda: [tokenizer.encode(line, add_bos=False) for line in lines])
    line_bytes = sum(len(line.encode("utf-8")) for line in lines)
    batch = best(lambda: tokenizer.encode_batch(lines, add_bos=False))
    decode = best(lambda: tokenizer.decode(ids))
    return {
        "tokenizer": repr(tokenizer),
        "text_bytes": n_bytes,
        "text_lines": len(lines),
        "tokens": len(ids),
        "bytes_per_token": round(n_bytes / max(len(ids), 1), 2),
        "encode_whole_mb_s": round(n_bytes / whole / 1e6, 2),
        "encode_lines_mb_s": round(line_bytes / per_line / 1e6, 2),
        "encode_batch_lines_mb_s": round(line_bytes / batch / 1e6, 2),
        "encode_tokens_s": round(len(ids) / whole),
        "decode_tokens_s": round(len(ids) / decode),
    }
