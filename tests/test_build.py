"""Loading the extension under a torch it was not built for fails with a clear ImportError."""
import pytest

from commtune import _build_info, _native


def test_mismatched_torch_is_refused(monkeypatch):
    monkeypatch.setattr(_build_info, "TORCH_VERSION", "0.0.0-other")
    with pytest.raises(ImportError, match=r"built against torch 0.0.0-other but torch .* is loaded; rebuild"):
        _native.load()


def test_matching_torch_loads():
    assert _native.load().cast_scale is not None
