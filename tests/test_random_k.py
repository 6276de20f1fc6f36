"""RandomK's passes (kernels/random_k.h) against the same steps in ATen ops at the draw's
positions: the draw itself (uniform, with replacement, the same on CPU and CUDA), taking with and
without clearing, an overflow anywhere reaching the first value, and placing the mean."""
import pytest
import torch

from commtune import _C
from conftest import DEVICES

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def take(x, k, seed, clear):
    values = torch.full((k,), -7.0, dtype=x.dtype, device=x.device)  # not zeros: every value is written
    _C.random_k_take_(x, seed, values, clear)
    return values


@pytest.mark.parametrize("device", DEVICES)
def test_the_draw_is_the_same_everywhere_and_new_each_seed(device):
    numel, k = 1_000_003, 10_000
    positions = _C.random_k_positions(numel, k, 12345)
    assert positions.min() >= 0 and positions.max() < numel
    # Taking from x = arange gives the positions themselves (exact in float64 below 2^53).
    got = take(torch.arange(numel, dtype=torch.float64, device=device), k, 12345, False)
    assert torch.equal(got.cpu().long(), positions)
    assert torch.equal(_C.random_k_positions(numel, k, 12345), positions)  # deterministic
    other = _C.random_k_positions(numel, k, 12346)
    assert (other == positions).float().mean() < 0.01  # another step's seed: other positions


def test_the_draw_is_uniform_with_replacement():
    numel, k = 1000, 1_000_000
    counts = torch.bincount(_C.random_k_positions(numel, k, 7), minlength=numel).double()
    expected = k / numel
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # 999 degrees of freedom: mean 999, standard deviation ~44.7; 5 of them either way
    assert 999 - 5 * 44.7 < chi2 < 999 + 5 * 44.7
    # k = numel draws with replacement leave about 1/e of the positions undrawn
    few = torch.bincount(_C.random_k_positions(100_000, 100_000, 8), minlength=100_000)
    assert abs(float((few == 0).double().mean()) - 0.36788) < 0.01


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("clear", [False, True])
def test_take_gathers_the_drawn_values_and_clears_them(device, dtype, clear):
    numel, k, seed = 100_000, 3_000, 99
    x = torch.randn(numel, generator=torch.Generator().manual_seed(1)).to(dtype)
    on = x.clone().to(device)  # on the CPU, x.to(device) would be x itself
    values = take(on, k, seed, clear)
    positions = _C.random_k_positions(numel, k, seed)
    assert torch.equal(values.cpu(), x[positions])  # a position drawn twice sends its value twice
    expected = x.clone()
    if clear:
        expected[positions] = 0
    assert torch.equal(on.cpu(), expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", ["inf", "-inf", "nan"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_an_overflow_anywhere_makes_the_first_value_nan_and_leaves_the_buffer(device, bad, dtype):
    numel, k, seed = 200_000, 20, 5
    positions = _C.random_k_positions(numel, k, seed)
    missed = next(i for i in range(numel) if i not in set(positions.tolist()))
    x = torch.randn(numel, generator=torch.Generator().manual_seed(2)).to(dtype)
    x[missed] = float(bad)
    for clear in (False, True):
        on = x.clone().to(device)
        values = take(on, k, seed, clear).cpu()
        assert torch.isnan(values[0])
        assert torch.equal(values[1:], x[positions][1:])
        expected = x.clone()
        if clear:  # error feedback keeps neither the sent values nor the overflow
            expected[positions] = 0
            expected[missed] = 0
        torch.testing.assert_close(on.cpu(), expected, rtol=0, atol=0, equal_nan=True)


def test_a_double_above_float_range_is_no_overflow():
    x = torch.full((1000,), 1e300, dtype=torch.float64)
    values = take(x, 10, 3, True)
    assert torch.isfinite(values).all() and bool((values == 1e300).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ranks", [1, 3])
def test_place_puts_the_mean_at_the_drawn_positions_and_zeros_elsewhere(device, dtype, ranks):
    numel, k, seed = 50_000, 5_000, 11
    positions = _C.random_k_positions(numel, k, seed)
    # What a sum allreduce of ranks' values at those positions gives: equal at repeated positions.
    summed = torch.randn(numel, generator=torch.Generator().manual_seed(4)).to(dtype)[positions]
    out = torch.randn(numel, dtype=dtype, device=device)  # not zeros: every entry is written
    _C.random_k_place_(summed.to(device), seed, out, ranks)
    expected = torch.zeros(numel, dtype=dtype).index_copy_(0, positions, summed / ranks)
    assert torch.equal(out.cpu(), expected)


@pytest.mark.parametrize("call", ["float values", "short bucket", "2-D bucket", "int bucket", "ranks 0"])
def test_refusals_name_the_argument(call):
    x = torch.randn(100)
    with pytest.raises(RuntimeError, match="RandomK"):
        if call == "float values":
            _C.random_k_take_(x.double(), 1, torch.empty(10), False)
        elif call == "short bucket":
            _C.random_k_take_(torch.empty(0), 1, torch.empty(10), False)
        elif call == "2-D bucket":
            _C.random_k_take_(x.view(10, 10), 1, torch.empty(10), False)
        elif call == "int bucket":
            _C.random_k_place_(torch.empty(10, dtype=torch.int32), 1, torch.zeros(100, dtype=torch.int32), 2)
        else:
            _C.random_k_place_(torch.empty(10), 1, x, 0)
