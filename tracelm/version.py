"""tracelm's version (recorded in every trace header)."""

__version__ = "0.1.0"
