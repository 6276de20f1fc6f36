"""commtune: C++/CUDA DDP communication hooks, NCCL tuning and per-bucket counters."""
from ._native import load as _load

_C = _load()

from . import hooks, nccl  # noqa: E402
from .nccl import init_process_group  # noqa: E402
from .registration import Handle, handle_of, register, wrap  # noqa: E402
from .overlap import OverlappedOptimizer, accumulate  # noqa: E402
from . import plot, sim  # noqa: E402
from .stats import export_chrome_trace  # noqa: E402
from .sim import plan_buckets  # noqa: E402
from .stats import format_table as _format_table  # noqa: E402

__version__ = "0.1.0"


def stats(ddp):
    """The counters of the commtune hook on `ddp` (same as handle.stats())."""
    return handle_of(ddp).stats()


def report(ddp, file=None):
    """Prints the counters of the hook on `ddp` as a table and returns the text."""
    handle = handle_of(ddp)
    text = _format_table(handle.stats(), title=f"commtune.{handle.name}")
    if nccl.applied():
        text += "\nNCCL settings: " + " ".join(f"{k}={v}" for k, v in sorted(nccl.applied().items()))
    print(text, file=file)
    return text


__all__ = ["hooks", "nccl", "init_process_group", "register", "wrap", "stats", "report", "Handle", "handle_of",
           "OverlappedOptimizer", "accumulate", "sim", "plan_buckets", "plot", "export_chrome_trace"]
