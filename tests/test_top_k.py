"""TopK's threshold selection (kernels/top_k.h): the picks against the rule written in plain
PyTorch, CPU = CUDA, how far the count of qualifying entries strays from k, and the hook end to
end on 2 and 3 gloo ranks against a simulation of the same rule with error feedback."""
import functools

import pytest
import torch

import compression_runs
import distributed
import test_sparsify
from commtune import _C
from conftest import DEVICES, needs_cuda, on_device


def rule(x, k):
    """The selection in tensor ops: the threshold is the want-th largest |x| of the sample, and
    the first k entries (by index) at or above it are taken; a bucket holding an Inf or a NaN
    sends NaN as its first value. -> (values, indices, qualifying)."""
    size, stride, want = _C.top_k_sample(x.numel(), k)
    sample = x[: size * stride : stride].float().abs()
    threshold = sample.topk(want).values[-1]
    qualifying = (x.float().abs() >= threshold).nonzero().view(-1)
    taken = qualifying[:k]
    values = torch.zeros(k)
    indices = torch.zeros(k, dtype=torch.int32)
    values[: taken.numel()] = x[taken].float()
    indices[: taken.numel()] = taken.int()
    if not torch.isfinite(x.float()).all():
        values[0] = float("nan")
    return values, indices, qualifying.numel()


def assert_cleared_where_taken(on, x, indices, qualifying, k, clear):
    """The bucket after a call: with `clear`, x with the taken entries (the first
    min(qualifying, k) of `indices`) and every Inf and NaN cleared, untouched elsewhere;
    without, x as it was."""
    expected = x.clone()
    if clear:
        expected[indices[: min(qualifying, k)].long()] = 0
        expected[~torch.isfinite(expected)] = 0
    torch.testing.assert_close(on.cpu(), expected, rtol=0, atol=0, equal_nan=True)


def pick(x, k, clear, add=None):
    # not zeros: the unused slots must be cleared by the call
    piece = torch.full((2 * k,), -1, dtype=torch.int32, device=x.device)
    qualifying = torch.full((1,), -1, dtype=torch.int64, device=x.device)
    _C.threshold_top_k_(x, k, piece, qualifying, clear, add)
    return piece[:k].view(torch.float32).cpu(), piece[k:].cpu(), int(qualifying.item())


def assert_picks_follow_the_rule(x, on, k, clear, add=None):
    """One call on `on` (x on a device) against the rule applied to x: the count, the picks in
    order, and the bucket afterwards. With `add` (a tensor on on's device: error feedback's add
    fused into the call), the rule applies to x + add, summed by at::add_ on the CPU. Returns how
    many qualified."""
    x = x.clone()  # the bucket as it was: on a CPU device `on` may be x itself, cleared by the call
    if add is not None:
        added = add.cpu().clone()
        x += added
    values, indices, qualifying = rule(x, k)
    got_values, got_indices, got_qualifying = pick(on, k, clear, add)
    assert got_qualifying == qualifying
    assert torch.equal(got_indices, indices) and torch.equal(got_values.view(torch.int32), values.view(torch.int32))
    assert_cleared_where_taken(on, x, indices, qualifying, k, clear)
    if add is not None:
        assert torch.equal(add.cpu(), added)  # only read
    return qualifying


def gradient_like(x, seed):
    """A second bucket to add to x (error feedback's new gradient): its own values, x's dtype."""
    return torch.randn(x.numel(), generator=torch.Generator().manual_seed(seed)).to(x.dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("numel,k", [(1000, 10), (16384, 164), (100_000, 1000), (1_000_003, 10_000), (50, 50)])
@pytest.mark.parametrize("clear", [False, True])
@pytest.mark.parametrize("adds", [False, True], ids=["alone", "with add"])
def test_picks_follow_the_rule(device, numel, k, clear, adds):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    x[::7] *= 1e-3  # many magnitudes, and ties among the zeros below
    x[::11] = 0
    add = gradient_like(x, 1).to(device) if adds else None
    assert_picks_follow_the_rule(x, x.to(device), k, clear, add)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("clear", [False, True])
@pytest.mark.parametrize("adds", [False, True], ids=["alone", "with add"])
def test_picks_follow_the_rule_when_they_crowd_together(device, clear, adds):
    # Most qualifying entries lie in 20000 of 300000. On CUDA each warp of the streaming pass
    # takes one tile of 512 here, and those tiles hold more than the warp keeps: more than its
    # buffer (64; written to its slots directly) and more than its slots (twice the expected
    # count and the buffer; read again when placed, after the last slot's entry, which with
    # `clear` the streaming pass has already zeroed).
    x = torch.randn(300_000, generator=torch.Generator().manual_seed(3))
    x[100_000:120_000] *= 1000
    k = 12_000
    add = gradient_like(x, 2).to(device) if adds else None
    qualifying = assert_picks_follow_the_rule(x, x.to(device), k, clear, add)
    assert qualifying > 0.4 * 20_000  # mostly the crowded stretch


def test_a_bucket_within_the_sample_picks_the_exact_top_k():
    x = torch.randn(5000, generator=torch.Generator().manual_seed(1))  # no ties
    values, indices, qualifying = pick(x, 50, False)
    exact = x.abs().topk(50).indices.sort().values
    assert qualifying == 50 and torch.equal(indices.long(), exact) and torch.equal(values, x[exact])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["ties", "one", "normal"])
def test_the_threshold_is_the_samples_want_th_largest(device, case):
    # On CUDA the search ends early once few of the sample's keys match the digits found: after
    # two of its four rounds for normal values at a ratio of 1%, after one for k = 1 (want = 1).
    # With a few levels, thousands of keys tie at the threshold and every round runs.
    g = torch.Generator().manual_seed(7)
    numel = 2_000_003
    if case == "ties":
        x, k = torch.randint(-3, 4, (numel,), generator=g).float() * 0.5, numel // 100
    else:
        x, k = torch.randn(numel, generator=g), (1 if case == "one" else numel // 100)
    assert_picks_follow_the_rule(x, x.to(device), k, False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["nan_last", "nans_fill_the_sample", "inf_among_many", "minus_inf_fp16",
                                  "sum_overflows_fp16"])
def test_an_inf_or_nan_anywhere_makes_the_first_value_nan(device, case):
    # A NaN never qualifies and an Inf may come after the first k picks: the first value sent
    # carries the overflow instead, so that every rank's sum shows it (a loss scaler then skips
    # the step). Enough NaNs in the sample make the threshold NaN: nothing qualifies at all.
    x = torch.randn(300_000, generator=torch.Generator().manual_seed(11))
    k = 3000
    if case == "nan_last":
        x[-1] = float("nan")
    elif case == "nans_fill_the_sample":
        x[::5] = float("nan")
    elif case == "inf_among_many":
        x[100_000:120_000] = 1000.0  # ties at the threshold: 20000 qualify, and the Inf after them is not taken
        x[250_000] = float("inf")
    elif case == "minus_inf_fp16":
        x = x.half()
        x[123_457] = float("-inf")
    add = None
    if case == "sum_overflows_fp16":  # both finite, their sum Inf: the fused add checks what it writes
        x = x.half()
        add = torch.zeros_like(x)
        x[123_457], add[123_457] = 60000.0, 60000.0
        add = add.to(device)
    qualifying = assert_picks_follow_the_rule(x, x.clone().to(device), k, True, add)
    values, _, _ = pick(x.clone().to(device), k, False, add)
    assert torch.isnan(values[0])
    if case == "nans_fill_the_sample":
        assert qualifying == 0
    if case == "inf_among_many":
        assert qualifying > k


@pytest.mark.parametrize("device", DEVICES)
def test_qualifying_count_stays_near_k(device):
    # A sample of 16384 places the threshold within a few percent for a ratio of 1%; the bucket
    # mixes scales as gradient buckets do (one layer's entries 100 times another's).
    x = torch.randn(4_000_000, generator=torch.Generator().manual_seed(5))
    x[1_000_000:1_500_000] *= 100
    k = 40_000
    _, indices, qualifying = pick(x.to(device), k, False)
    assert 0.85 * k <= qualifying <= 1.15 * k
    exact = set(x.abs().topk(k).indices.tolist())
    taken = indices[: min(qualifying, k)].tolist()
    assert len(exact.intersection(taken)) >= 0.85 * k  # most of the true top k


@needs_cuda
@pytest.mark.needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_and_cpu_pick_the_same(dtype):
    x = (torch.randn(300_001, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
    cpu = pick(x.clone(), 3000, True)
    gpu = pick(x.cuda(), 3000, True)
    for a, b in zip(cpu, gpu):
        assert a == b if isinstance(a, int) else torch.equal(a, b)


@needs_cuda
@pytest.mark.needs_cuda
@pytest.mark.parametrize(
    "dtype,offset",
    [
        (torch.float32, 0),
        (torch.float32, 1),
        (torch.float16, 0),
        (torch.float16, 1),
        (torch.float16, 4),
        (torch.float64, 0),
    ],
)
@pytest.mark.parametrize("adds", [False, True], ids=["alone", "with add"])
def test_cuda_picks_follow_the_rule_with_many_tiles_a_warp(dtype, offset, adds):
    # 15M entries: on an H100 or H200 each warp of the streaming pass takes a run of four or five
    # tiles of 512, the first two loaded while the threshold is found (sm_90 on). A bucket not 16-byte
    # aligned (offset 1; fp16 at offset 4 is 8 bytes off) has its tiles copied entry by entry.
    x = torch.randn(15_000_001, generator=torch.Generator().manual_seed(4))
    x[13_000_000:13_200_000] *= 50  # crowded runs late in the bucket, read again when placed
    x = x.to(dtype)
    k = 150_000
    on = on_device(x, "cuda", offset)
    # an aligned add with an aligned bucket is fused into the stream; off alignment it goes first
    add = gradient_like(x, 9).cuda() if adds else None
    assert_picks_follow_the_rule(x, on, k, True, add)


@needs_cuda
@pytest.mark.needs_cuda
def test_cuda_picks_follow_the_rule_when_a_warp_fills_its_buffer():
    # 7% qualify: a warp of the streaming pass finds ~36 entries in each tile of 512, so its
    # buffer (64) fills within its run of four or five tiles and goes to its slots before the
    # run ends.
    x = torch.randn(15_000_000, generator=torch.Generator().manual_seed(6))
    k = 1_050_000
    assert_picks_follow_the_rule(x, x.cuda(), k, True)
    assert_picks_follow_the_rule(x, x.cuda(), k, True, gradient_like(x, 3).cuda())


@needs_cuda
@pytest.mark.needs_cuda
@pytest.mark.parametrize("adds", [False, True], ids=["alone", "with add"])
def test_cuda_calls_queued_back_to_back_see_each_other(adds):
    # Each call's kernels start before the previous kernel ends (sm_90 on); a call must still see
    # the entries the call before it cleared. Three calls queued without a sync, against the rule
    # applied three times (with `adds`, each call adds the same gradient first, as a hook's steps do).
    x = torch.randn(5_000_000, generator=torch.Generator().manual_seed(6))
    k = 50_000
    on = x.cuda()
    add = gradient_like(x, 4) if adds else None
    add_on = add.cuda() if adds else None
    pieces, counts = [], []
    for _ in range(3):
        piece = torch.full((2 * k,), -1, dtype=torch.int32, device="cuda")
        count = torch.full((1,), -1, dtype=torch.int64, device="cuda")
        _C.threshold_top_k_(on, k, piece, count, True, add_on)
        pieces.append(piece)
        counts.append(count)
    for piece, count in zip(pieces, counts):
        if adds:
            x += add
        values, indices, qualifying = rule(x, k)
        x[indices[: min(qualifying, k)].long()] = 0
        assert int(count.item()) == qualifying
        assert torch.equal(piece[k:].cpu(), indices) and torch.equal(piece[:k].view(torch.float32).cpu(), values)
    assert torch.equal(on.cpu(), x)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_arguments_are_refused(device):
    x = torch.randn(100, device=device)
    piece = torch.empty(20, dtype=torch.int32, device=device)
    count = torch.empty(1, dtype=torch.int64, device=device)
    with pytest.raises(RuntimeError, match="k must be"):
        _C.threshold_top_k_(x, 101, torch.empty(202, dtype=torch.int32, device=device), count, False)
    with pytest.raises(RuntimeError, match="2k = 22"):
        _C.threshold_top_k_(x, 11, piece, count, False)
    with pytest.raises(RuntimeError, match="1-D floating-point"):
        _C.threshold_top_k_(x.view(10, 10), 10, piece, count, False)
    with pytest.raises(RuntimeError, match="int64"):
        _C.threshold_top_k_(x, 10, piece, count.int(), False)
    with pytest.raises(RuntimeError, match="added to the bucket must be a contiguous 1-D Float tensor of 100"):
        _C.threshold_top_k_(x, 10, piece, count, True, torch.zeros(99, device=device))
    with pytest.raises(RuntimeError, match="added to the bucket overlaps it"):
        _C.threshold_top_k_(x[:50], 5, piece[:10], count, True, x[25:75])


# ---- the hook through DDP -------------------------------------------------------------------

STEPS = 4


@functools.lru_cache(maxsize=None)
def run(world_size):
    return distributed.run(compression_runs.hook_run, world_size, STEPS, "TopK-threshold")


def threshold_top_k(x):
    """The rule as TopK applies it: unused slots send 0 at index 0 and take nothing out of x."""
    values, indices, qualifying = rule(x, test_sparsify.K)
    return values, indices.long(), indices[: min(qualifying, test_sparsify.K)].long()


@pytest.mark.parametrize("world_size", [2, 3])
def test_hook_equals_the_simulated_rule(world_size):
    results = run(world_size)
    expected = test_sparsify.simulate_topk([grads for _, grads in results[0]["steps"]], world_size, threshold_top_k)
    for r in results:
        for (ours, _), theirs in zip(r["steps"], expected):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
        ratio = r["stats"]["topk_qualifying_per_k"]
        assert 0.5 < ratio < 2.0  # reported; bucket of 21000 with a sample of 16384 of it


def test_bad_selection_is_refused():
    import commtune as ct

    with pytest.raises(ValueError, match="selection"):
        ct.hooks.TopK(selection="approximate").validate()
