"""The error that reports bad input (a file, a config, a prompt) in one line: every layer raises it."""

import json
from typing import Any


def shown(value: Any, limit: int = 40) -> str:
    """A value for an error message, as JSON (a string as Python writes it), cut short: a number of 400 digits or a
    key of 5,000 characters names itself by its start and its length."""
    if isinstance(value, str):
        return repr(value) if len(value) <= limit else f"{value[: limit - 16]!r}... ({len(value)} characters)"
    try:
        text = json.dumps(value, default=repr)
    except (ValueError, RecursionError):  # an integer past Python's digit limit, a nest too deep
        text = f"<{type(value).__name__}>"
    return cut(text, limit)


def cut(text: str, limit: int = 200) -> str:
    """`text`, or its start and its length when longer than `limit`."""
    return text if len(text) <= limit else f"{text[: limit - 16]}... ({len(text)} characters)"


class TracelmError(Exception):
    """An error caused by the user's input (file, config, prompt): reported as one line, exit 2."""


class SessionFileError(TracelmError):
    """A session file (a saved conversation: tracelm/io/session_file.py) that cannot be resumed: not a session
    file, or unreadable. The subclasses name the reason; none of them is ever resumed into wrong output."""


class SessionFileTruncated(SessionFileError):
    """The file is shorter than its own header says (cut off while copied, or a disk full)."""


class SessionFileTampered(SessionFileError):
    """The file's bytes do not match the sha256 it carries (edited or damaged)."""


class SessionModelMismatch(SessionFileError):
    """The file was made with another model (its sha256) or another ModelConfig."""


class SessionIncompatible(SessionFileError):
    """The file was made by another tracelm version, session format or compute mode, or holds more positions
    than the context: its keys and values are not the ones this engine would compute."""


class ModelFormatError(TracelmError):
    """A model, tokenizer or config file whose field has the wrong type or a value out of its range (named with the
    file, key or tensor), or whose structure breaks its format's rules."""


class NonFiniteError(TracelmError):
    """A pass produced NaN or infinity: the message names the first layer, stage and token that did."""


class ResourceError(TracelmError):
    """A run that would exceed a bound decided before allocating: the model's trained context, or the memory
    available (the message holds the estimate)."""


class TraceFormatError(TracelmError):
    """A trace line that cannot be read as a trace event (e.g. JSON nested too deeply)."""


class GrammarLibraryError(TracelmError):
    """The grammar library (llguidance) raised on a constraint: its message and version, named with the
    constraint. Reported like any bad input (a 400 on the server) and logged in one line."""


class EvidenceFormatError(TracelmError):
    """Attestation evidence (a TPM quote, an SEV-SNP report, a TDX quote, a certificate, a binding) that does not
    parse as its format: the message names the structure, field and offset."""


class PolicyError(TracelmError):
    """An auditor's trust policy (`--policy FILE`) with an unknown key, a wrong type or a file it cannot read."""
