"""RandomK's passes (kernels/random_k.h) against the same steps in ATen ops at the draw's
positions: the draw itself (one entry of each stratum, uniform within it, the same on CPU and
CUDA), taking with and without clearing, an overflow anywhere reaching the first value, and
placing the mean. The CUDA kernels cut the bucket into slices of 16384 entries: the shapes below
put strata across slices, many strata in one, and a bucket that starts off a 16-byte boundary."""
import pytest
import torch

from commtune import _C
from conftest import DEVICES, on_device

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


# (numel, k): strata of ~33 entries; three strata over five slices; one entry each; one stratum
SHAPES = [(100_000, 3_000), (70_001, 3), (40_000, 40_000), (50_000, 1)]


def strata_starts(numel, k):
    """Stratum s holds entries floor(s numel / k) to floor((s + 1) numel / k) - 1."""
    return torch.arange(k + 1, dtype=torch.long) * numel // k


def take(x, k, seed, clear, add=None):
    values = torch.full((k,), -7.0, dtype=x.dtype, device=x.device)  # not zeros: every value is written
    _C.random_k_take_(x, seed, values, clear, add)
    return values


@pytest.mark.parametrize("device", DEVICES)
def test_the_draw_is_the_same_everywhere_and_new_each_seed(device):
    numel, k = 1_000_003, 1_000  # strata of 1000 entries: another seed picks the same one in 1/1000
    positions = _C.random_k_positions(numel, k, 12345)
    assert positions.min() >= 0 and positions.max() < numel
    # Taking from x = arange gives the positions themselves (exact in float64 below 2^53).
    got = take(torch.arange(numel, dtype=torch.float64, device=device), k, 12345, False)
    assert torch.equal(got.cpu().long(), positions)
    assert torch.equal(_C.random_k_positions(numel, k, 12345), positions)  # deterministic
    other = _C.random_k_positions(numel, k, 12346)
    assert (other == positions).float().mean() < 0.01  # another step's seed: other positions


@pytest.mark.parametrize("numel,k", SHAPES + [(5_000_000_007, 1000), (10, 3)])
def test_each_draw_lies_in_its_own_stratum(numel, k):
    positions = _C.random_k_positions(numel, k, 5)
    starts = strata_starts(numel, k)
    assert bool((positions >= starts[:-1]).all()) and bool((positions < starts[1:]).all())
    if k == numel:
        assert torch.equal(positions, torch.arange(numel))  # every entry, once


def chi_square(counts):
    expected = counts.sum() / counts.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def test_the_entry_within_a_stratum_is_uniform():
    # Across strata: 100000 strata of 10 entries, the offset of each draw in its stratum.
    numel, k = 1_000_000, 100_000
    offsets = _C.random_k_positions(numel, k, 7) - strata_starts(numel, k)[:-1]
    # 9 degrees of freedom: mean 9, standard deviation ~4.2; 5 of them above
    assert chi_square(torch.bincount(offsets, minlength=10).double()) < 9 + 5 * 4.25
    # Across steps: one stratum of 7 entries, 4000 seeds (6 degrees: mean 6, deviation ~3.5). The
    # hook's seeds are hashes (of seed, iteration and bucket), so these are random 62-bit words:
    # raw consecutive seeds are a weaker input to the mixer, and the draw does not rely on them.
    seeds = torch.randint(0, 2**62, (4000,), generator=torch.Generator().manual_seed(0)).tolist()
    picks = torch.tensor([int(_C.random_k_positions(7000, 1000, seed)[3]) - 21 for seed in seeds])
    assert chi_square(torch.bincount(picks, minlength=7).double()) < 6 + 5 * 3.5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("clear", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("offset", [0, 1])
def test_take_gathers_the_drawn_values_and_clears_them(device, dtype, clear, shape, offset):
    (numel, k), seed = shape, 99
    x = torch.randn(numel, generator=torch.Generator().manual_seed(1)).to(dtype)
    on = on_device(x, device, offset)
    values = take(on, k, seed, clear)
    positions = _C.random_k_positions(numel, k, seed)
    assert torch.equal(values.cpu(), x[positions])
    expected = x.clone()
    if clear:
        expected[positions] = 0
    assert torch.equal(on.cpu(), expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", ["inf", "-inf", "nan"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("where", ["missed", "drawn", "last entry"])
def test_an_overflow_anywhere_makes_the_first_value_nan_and_leaves_the_buffer(device, bad, dtype, where):
    numel, k, seed = 200_001, 20, 5  # a tail past the last whole 16-byte pack
    positions = _C.random_k_positions(numel, k, seed)
    at = {"missed": int(positions[7]) + 1, "drawn": int(positions[7]), "last entry": numel - 1}[where]
    x = torch.randn(numel, generator=torch.Generator().manual_seed(2)).to(dtype)
    assert where == "drawn" or at not in set(positions.tolist())
    x[at] = float(bad)
    for clear in (False, True):
        on = on_device(x, device, 0)
        values = take(on, k, seed, clear).cpu()
        assert torch.isnan(values[0])
        torch.testing.assert_close(values[1:], x[positions][1:], rtol=0, atol=0, equal_nan=True)
        expected = x.clone()
        if clear:  # error feedback keeps neither the sent values nor the overflow
            expected[positions] = 0
            expected[at] = 0
        torch.testing.assert_close(on.cpu(), expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("clear", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("offsets", [(0, 0), (1, 1), (0, 1)], ids=["aligned", "both off", "apart"])
def test_take_with_add_is_add_then_take(device, dtype, clear, shape, offsets):
    # Error feedback's add fused into the take (the hook's call); "apart": x and add start at other
    # offsets from 16 bytes, where the CUDA side adds first instead.
    (numel, k), seed = shape, 42
    gen = torch.Generator().manual_seed(3)
    error, grad = (torch.randn(numel, generator=gen).to(dtype) for _ in range(2))
    on, add = on_device(error, device, offsets[0]), on_device(grad, device, offsets[1])
    values = take(on, k, seed, clear, add)
    summed = error + grad  # at::add_ on the CPU: the sum in opmath, rounded once to dtype
    positions = _C.random_k_positions(numel, k, seed)
    assert torch.equal(values.cpu(), summed[positions])
    if clear:
        summed[positions] = 0
    assert torch.equal(on.cpu(), summed)
    assert torch.equal(add.cpu(), grad)  # only read


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("where", ["missed", "drawn", "head", "last entry"])
def test_a_sum_that_overflows_is_caught_and_cleared(device, where):
    # Both terms finite, their fp16 sum Inf: the fused pass checks what it writes, not what it read.
    numel, k, seed = 200_001, 20, 5
    positions = _C.random_k_positions(numel, k, seed)
    at = {"missed": int(positions[7]) + 1, "drawn": int(positions[7]), "head": 0, "last entry": numel - 1}[where]
    assert where in ("drawn", "head") or at not in set(positions.tolist())
    error = torch.randn(numel, generator=torch.Generator().manual_seed(6)).half()
    grad = error.clone()
    error[at], grad[at] = 60000.0, 60000.0
    on = on_device(error, device, 1)  # off alignment: the head is walked one entry at a time
    values = take(on, k, seed, True, on_device(grad, device, 1)).cpu()
    assert torch.isnan(values[0])
    expected = error + grad
    assert torch.isinf(expected[at])
    torch.testing.assert_close(values[1:], expected[positions][1:], rtol=0, atol=0, equal_nan=True)
    expected[positions] = 0
    expected[at] = 0
    assert torch.equal(on.cpu(), expected)


def test_a_double_above_float_range_is_no_overflow():
    x = torch.full((1000,), 1e300, dtype=torch.float64)
    values = take(x, 10, 3, True)
    assert torch.isfinite(values).all() and bool((values == 1e300).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ranks", [1, 3])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("offset", [0, 1])
def test_place_puts_the_mean_at_the_drawn_positions_and_zeros_elsewhere(device, dtype, ranks, shape, offset):
    (numel, k), seed = shape, 11
    positions = _C.random_k_positions(numel, k, seed)
    summed = torch.randn(k, generator=torch.Generator().manual_seed(4)).to(dtype)
    out = on_device(torch.randn(numel, dtype=dtype), device, offset)  # not zeros: every entry is written
    _C.random_k_place_(summed.to(device), seed, out, ranks)
    expected = torch.zeros(numel, dtype=dtype).index_copy_(0, positions, summed / ranks)
    assert torch.equal(out.cpu(), expected)


@pytest.mark.parametrize("call", ["float values", "short bucket", "2-D bucket", "int bucket", "ranks 0", "k above numel",
                                  "double add", "short add", "overlapping add"])
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
        elif call == "ranks 0":
            _C.random_k_place_(torch.empty(10), 1, x, 0)
        elif call == "k above numel":
            _C.random_k_take_(x, 1, torch.empty(101), False)
        elif call == "double add":
            _C.random_k_take_(x, 1, torch.empty(10), True, x.double())
        elif call == "short add":
            _C.random_k_take_(x, 1, torch.empty(10), True, torch.zeros(99))
        else:
            _C.random_k_take_(x[:50], 1, torch.empty(10), True, x[25:75])
