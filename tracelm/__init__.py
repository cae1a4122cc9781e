"""tracelm: auditable LLM inference on the CPU as an explicit graph of pure numpy stages."""

__version__ = "0.1.0"


class TracelmError(Exception):
    """An error caused by the user's input (file, config, prompt): reported as one line, exit 2."""
