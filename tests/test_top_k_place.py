"""TopK's decompression (top_k_place_, kernels/top_k.h) against the steps it replaced in ATen ops:
a float32 zero bucket, each rank's picks added with index_add_ rank after rank, the sum divided by
the ranks and rounded once to the bucket's dtype. The CUDA pass cuts the bucket into tiles of 4096
entries, one a block, and reads a rank's entries of a tile as one stretch of its piece, loading 8
ranks' stretches at once: the pieces below put picks on tile edges, many ranks on one entry, more
of one rank's picks in a tile than a block has threads, pieces with unused slots and without, more
ranks than a block loads at once, a bucket of more tiles than the GPU runs blocks at once, and a
bucket and pieces off a 16-byte boundary."""
import subprocess
import sys

import pytest
import torch

from commtune import _C
from conftest import DEVICES, needs_cuda, on_device

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
TILE = 4096


def piece(numel, k, picks, generator, special=()):
    """One rank's piece: `picks` ascending distinct indices (tile edges among them) with random
    values, then k - picks unused slots (value 0 at index 0). `special` values replace the first
    picks' (a NaN, an Inf, a subnormal, a zero)."""
    edges = torch.tensor([0, TILE - 1, TILE, numel - 1])
    edges = edges[edges < numel].unique()[:picks]
    others = torch.randperm(numel, generator=generator)
    others = others[~torch.isin(others, edges)][: picks - len(edges)]
    indices = torch.cat([edges, others]).sort().values
    values = torch.randn(len(indices), generator=generator)
    for i, v in enumerate(special[: len(values)]):
        values[i] = v
    out = torch.zeros(2 * k, dtype=torch.int32)
    out[: len(indices)] = values.view(torch.int32)
    out[k : k + len(indices)] = indices.to(torch.int32)
    return out


def gathered_pieces(numel, k, ranks, fill, seed=0, special=()):
    g = torch.Generator().manual_seed(seed)
    return torch.cat([piece(numel, k, max(1, int(fill[r % len(fill)] * k)), g, special if r == 0 else ())
                      for r in range(ranks)])


def picks_of(indices):
    """Which of a piece's slots are picks: slot 0, and every later slot not at index 0."""
    picked = indices != 0
    picked[0] = True
    return picked


def reference(gathered, numel, ranks, dtype):
    """The ATen steps the hook ran before top_k_place_ (the CPU's true division by the ranks)."""
    k = gathered.numel() // (2 * ranks)
    total = torch.zeros(numel)
    for r in range(ranks):
        part = gathered[2 * k * r : 2 * k * (r + 1)]
        values, indices = part[:k].view(torch.float32), part[k:]
        picked = picks_of(indices)
        total.index_add_(0, indices[picked].long(), values[picked])
    return (total / ranks).to(dtype)


def place(gathered, numel, ranks, dtype, device, offset=0):
    out = on_device(torch.full((numel,), 7.0, dtype=dtype), device, offset)  # not zeros: all is written
    _C.top_k_place_(on_device(gathered, device, offset), out, ranks)
    return out.cpu()


# (numel, k, how full each rank's piece is): 1%; unused slots in some pieces; 40% (over 1600 picks
# of a rank in a tile); a bucket shorter than a tile; a last tile of one entry; k = 1
CASES = [(100_000, 1_000, [1.0]), (70_001, 700, [0.9, 1.0, 0.5]), (3 * TILE, 5_000, [1.0]), (1_000, 300, [1.0, 0.2]),
         (2 * TILE + 1, 40, [1.0]), (50_000, 1, [1.0])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ranks", [1, 2, 3, 8, 11])
@pytest.mark.parametrize("case", CASES)
def test_place_is_the_mean_of_the_ranks_picks(device, dtype, ranks, case):
    numel, k, fill = case
    gathered = gathered_pieces(numel, k, ranks, fill, seed=ranks)
    got = place(gathered, numel, ranks, dtype, device)
    torch.testing.assert_close(got, reference(gathered, numel, ranks, dtype), rtol=0, atol=0)
    assert int((got != 0).sum()) <= ranks * k


@needs_cuda
@pytest.mark.needs_cuda
@pytest.mark.parametrize("ranks, ratio, fill, k_step", [(3, 0.01, [1.0], 1), (9, 0.01, [1.0, 0.4], 1), (9, 0.03, [0.6], 1),
                                                     (8, 0.01, [1.0, 0.4], 4)])
def test_a_bucket_of_more_tiles_than_the_gpu_runs_blocks(ranks, ratio, fill, k_step):
    # At most 14 blocks an SM fit (16 KB of sums each): here the blocks come in three waves or more.
    # 9 ranks: more than a block loads at once (8); 3%: more of a rank's picks in a tile than a
    # block has threads (64); 40% and 60% full pieces: unused slots across many of bounds_kernel's blocks.
    # k a multiple of 4 (k_step): bounds_kernel reads the pieces 16 bytes at a time, else 4.
    numel = 3 * 14 * torch.cuda.get_device_properties(0).multi_processor_count * TILE + 123
    k = int(ratio * numel) // k_step * k_step
    gathered = gathered_pieces(numel, k, ranks, fill, seed=ranks)
    got = place(gathered, numel, ranks, torch.float32, "cuda")
    torch.testing.assert_close(got, reference(gathered, numel, ranks, torch.float32), rtol=0, atol=0)


def selected_pieces(device, numel, k, ranks, selection):
    """Pieces as the hook's selections write them: the threshold one (a rank whose bucket has few
    entries far above the rest leaves slots unused), the exact one (torch.topk, sorted by index)."""
    pieces = []
    for r in range(ranks):
        x = torch.randn(numel, generator=torch.Generator().manual_seed(r))
        if r == 1:  # 300 sampled entries far above the rest: the threshold is one of them
            x[: 900 : _C.top_k_sample(numel, k)[1]] *= 1e4
        x = x.to(device)
        if selection == "threshold":
            part = torch.empty(2 * k, dtype=torch.int32, device=device)
            qualifying = torch.empty(1, dtype=torch.int64, device=device)
            _C.threshold_top_k_(x, k, part, qualifying, False)
            assert (int(qualifying) < k) == (r == 1)
        else:
            idx = x.abs().topk(k, sorted=False).indices.sort().values
            part = torch.cat([x[idx].view(torch.int32), idx.to(torch.int32)])
        pieces.append(part)
    return torch.cat(pieces)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("selection", ["threshold", "exact"])
def test_pieces_the_selections_write_are_placed_as_index_add_would(device, selection):
    numel, k, ranks = 50_000, 500, 3
    gathered = selected_pieces(device, numel, k, ranks, selection)
    got = place(gathered, numel, ranks, torch.float32, device)
    torch.testing.assert_close(got, reference(gathered.cpu(), numel, ranks, torch.float32), rtol=0, atol=0)
    assert int((got != 0).sum()) > k  # the ranks' picks differ


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("offset", [1, 2, 3])
def test_a_bucket_and_pieces_off_alignment_get_the_same_means(device, offset):
    numel, k, ranks = 3 * TILE + 5, 500, 3
    gathered = gathered_pieces(numel, k, ranks, [1.0, 0.7])
    got = place(gathered, numel, ranks, torch.float32, device, offset)
    torch.testing.assert_close(got, reference(gathered, numel, ranks, torch.float32), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_nan_inf_subnormal_and_zero_values_arrive_as_index_add_adds_them(device):
    # An overflow's NaN (the threshold selection's first value) and an Inf reach the mean; a
    # subnormal is kept (the GPU build's fast math would flush it in a plain add); a picked 0
    # adds nothing.
    numel, k = 10_000, 100
    tiny = torch.tensor(1e-40).item()
    # rank 0's picks and a second rank's piece of unused slots: the mean is half of each value
    gathered = torch.cat([gathered_pieces(numel, k, 1, [1.0], special=(float("nan"), float("inf"), tiny, 0.0)),
                          torch.zeros(2 * k, dtype=torch.int32)])
    got = place(gathered, numel, 2, torch.float32, device)
    torch.testing.assert_close(got, reference(gathered, numel, 2, torch.float32), rtol=0, atol=0, equal_nan=True)
    assert got.isnan().sum() == 1 and got.isinf().sum() == 1
    assert ((got != 0) & (got.abs() < torch.finfo(torch.float32).tiny)).sum() == 1  # the subnormal's half


@pytest.mark.parametrize("device", DEVICES)
def test_a_piece_of_unused_slots_only_adds_nothing(device):
    numel, k = 20_000, 64
    gathered = torch.cat([torch.zeros(2 * k, dtype=torch.int32), gathered_pieces(numel, k, 1, [1.0])])
    got = place(gathered, numel, 2, torch.float32, device)
    torch.testing.assert_close(got, reference(gathered, numel, 2, torch.float32), rtol=0, atol=0)


def test_out_of_order_pieces_and_bad_indices_are_refused_and_leave_the_bucket():
    numel, k = 1_000, 10
    good = gathered_pieces(numel, k, 1, [0.5])
    out = torch.full((numel,), 7.0)
    late = good.clone()
    late[k - 1] = torch.tensor([1.5]).view(torch.int32)  # a value in an unused slot
    with pytest.raises(RuntimeError, match="unused slot"):
        _C.top_k_place_(torch.cat([good, late]), out, 2)
    swapped = good.clone()
    swapped[k + 1], swapped[k + 2] = good[k + 2], good[k + 1]
    with pytest.raises(RuntimeError, match="out of order"):
        _C.top_k_place_(swapped, out, 1)
    after_unused = good.clone()
    after_unused[k + 6] = 5  # a pick after the unused slots begin
    with pytest.raises(RuntimeError, match="out of order"):
        _C.top_k_place_(after_unused, out, 1)
    outside = good.clone()
    outside[k + 4] = numel  # the last pick (indices ascend up to it) past the bucket's end
    with pytest.raises(RuntimeError, match="outside the bucket"):
        _C.top_k_place_(outside, out, 1)
    assert torch.equal(out, torch.full((numel,), 7.0))  # checked before anything is written


@pytest.mark.parametrize("call", ["ranks", "dtype", "length", "bucket", "device"])
def test_refusals_name_the_argument(call):
    pieces, out = torch.zeros(40, dtype=torch.int32), torch.zeros(100)
    with pytest.raises(RuntimeError, match="TopK"):
        if call == "ranks":
            _C.top_k_place_(pieces, out, 0)
        elif call == "dtype":
            _C.top_k_place_(pieces.float(), out, 2)
        elif call == "length":
            _C.top_k_place_(pieces[:30], out, 4)  # not ranks x 2k
        elif call == "bucket":
            _C.top_k_place_(pieces, out.int(), 2)
        else:
            _C.top_k_place_(pieces, torch.zeros(100, device="meta"), 2)


BAD_PIECE_ON_CUDA = """
import sys
import torch
from commtune import _C
ranks, kind, length = int(sys.argv[1]), sys.argv[2], sys.argv[3]
numel = 100_000
if length == "short":  # 8 slots: the one lane of bounds_kernel that takes the piece's ends
    k, picks, step, bad = 8, 8, 9_000, 3  # one pick in every other tile or so
else:  # 3000 picks, then unused slots: the bad slot lies among picks, or among unused slots, in the middle
    k, picks, step, bad = 4096, 3000, 30, 2001
good = torch.zeros(2 * k, dtype=torch.int32)
good[:picks] = torch.ones(picks).view(torch.int32)
good[k : k + picks] = torch.arange(picks, dtype=torch.int32) * step
piece = good.clone()
if kind == "outside":
    piece[k + picks - 1 if length == "short" else k + bad] = numel  # past the bucket's end
elif kind == "out of order":
    piece[k + bad], piece[k + bad + 1] = good[k + bad + 1].item(), good[k + bad].item()
elif length == "short":  # an unused slot (index 0 after slot 0) holding a value
    piece[-1] = 0
else:
    piece[picks + 500] = torch.tensor([1.5]).view(torch.int32)
pieces = torch.cat([good] * (ranks - 1) + [piece])  # the last rank's piece is the bad one
out = torch.zeros(numel, device="cuda")
_C.top_k_place_(pieces.cuda(), out, ranks)
torch.cuda.synchronize()
print("no assertion")
"""


@needs_cuda
@pytest.mark.needs_cuda
@pytest.mark.parametrize("ranks", [1, 10])  # 10: the bad piece is the tenth rank's
@pytest.mark.parametrize("kind", ["outside", "out of order", "unused slot"])
@pytest.mark.parametrize("length", ["short", "long"])  # long: in a lane of picks only, or of unused slots only
def test_a_bad_piece_on_cuda_stops_with_a_device_assertion(ranks, kind, length):
    # A kernel cannot raise: it asserts, naming what is wrong, and the next synchronizing call
    # fails (in a process of its own: an assertion leaves the CUDA context unusable).
    run = subprocess.run([sys.executable, "-c", BAD_PIECE_ON_CUDA, str(ranks), kind, length], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode != 0 and "no assertion" not in run.stdout
    assert kind in run.stdout + run.stderr, (run.stdout + run.stderr)[-2000:]
