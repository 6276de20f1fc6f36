"""Loads commtune._C, refusing clearly when it was built for another torch."""
import torch


def load():
    try:
        from . import _build_info
    except ImportError:
        raise ImportError(
            "commtune's C++ extension is not built: run `pip install --no-build-isolation -e .` "
            "in the commtune checkout"
        ) from None
    if _build_info.TORCH_VERSION != torch.__version__:
        # The extension uses c10d's internal headers: loading it under another torch could crash.
        raise ImportError(
            f"commtune was built against torch {_build_info.TORCH_VERSION} but torch "
            f"{torch.__version__} is loaded; rebuild it with `pip install --no-build-isolation -e .`"
        )
    from . import _C

    return _C
