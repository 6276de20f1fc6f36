"""The fused scale-and-cast kernel against plain PyTorch, on CPU and CUDA."""
import pytest
import torch

from commtune import _C
from conftest import DEVICES


def reference(src, scale, dtype):
    return (src.float() * scale).to(dtype)


def random_input(n, dtype, device, offset=0):
    g = torch.Generator().manual_seed(n * 7 + offset)
    x = torch.randn(n + offset, generator=g) * torch.logspace(-6, 6, n + offset)[torch.randperm(n + offset, generator=g)]
    if n + offset > 8:
        x[offset + 1], x[offset + 3], x[offset + 5] = float("inf"), float("-inf"), float("nan")
        x[offset + 7] = -0.0
    return x.to(device=device, dtype=dtype)[offset:]  # offset > 0: a misaligned start


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,offset", [(1, 0), (7, 0), (1000, 0), (1000, 3), (300_001, 0)])
def test_cast_scale_matches_plain_pytorch(device, src_dtype, dtype, n, offset):
    src = random_input(n, src_dtype, device, offset)
    scale = 1.0 / 3.0
    out = torch.full((n,), 12345.0, dtype=dtype, device=device)  # poison: every element must be written
    _C.cast_scale_(src, scale, out)
    expected = reference(src, scale, dtype)
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)
    signed = ~torch.isnan(expected)  # a NaN's sign bit carries no meaning
    assert torch.equal(torch.signbit(out[signed]), torch.signbit(expected[signed]))  # -0.0 stays -0.0


@pytest.mark.parametrize("device", DEVICES)
def test_scaling_first_keeps_fp16_finite(device):
    src = torch.tensor([1e5, -2e5, 6e4], device=device)
    out = _C.cast_scale(src, 0.25, torch.float16)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), src * 0.25, rtol=1e-3, atol=0)


def test_cast_scale_refuses_bad_arguments():
    with pytest.raises(RuntimeError, match="src has 4 elements"):
        _C.cast_scale_(torch.ones(4), 1.0, torch.empty(3, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="must be floating point"):
        _C.cast_scale(torch.ones(4, dtype=torch.int32), 1.0, torch.float16)
    with pytest.raises(RuntimeError, match="must be contiguous"):
        _C.cast_scale(torch.ones(4, 4).t(), 1.0, torch.float16)
    # a kernel on one device must not touch the other's memory; the meta device stands in for it
    with pytest.raises(RuntimeError, match="out must be on cpu with the rest, got meta"):
        _C.cast_scale_(torch.ones(4), 1.0, torch.empty(4, dtype=torch.float16, device="meta"))
