"""commtune: C++/CUDA DDP communication hooks, NCCL tuning and per-bucket counters."""
from ._native import load as _load

_C = _load()

from . import hooks  # noqa: E402
from .registration import Handle, handle_of, register, wrap  # noqa: E402
from .stats import format_table as _format_table  # noqa: E402

__version__ = "0.1.0"


def stats(ddp):
    """The counters of the commtune hook on `ddp` (same as handle.stats())."""
    return handle_of(ddp).stats()


def report(ddp, file=None):
    """Prints the counters of the hook on `ddp` as a table and returns the text."""
    handle = handle_of(ddp)
    text = _format_table(handle.stats(), title=f"commtune.{handle.name}")
    print(text, file=file)
    return text


__all__ = ["hooks", "register", "wrap", "stats", "report", "Handle", "handle_of"]
