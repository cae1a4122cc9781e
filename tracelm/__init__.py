"""tracelm: auditable LLM inference on the CPU as an explicit graph of pure stages.

    from tracelm import Session
    print(Session("smollm2-135m-instruct").chat("Hi"))
"""

from tracelm.state.errors import TracelmError
from tracelm.version import __version__

__all__ = ["Session", "TracelmError", "__version__"]


def __getattr__(name: str):
    """`tracelm.Session`, imported when first asked for (importing tracelm alone loads no model code)."""
    if name == "Session":
        from tracelm.session import Session

        return Session
    raise AttributeError(f"module 'tracelm' has no attribute {name!r}")
