"""SignSGD: the sign kernels (bit packing, scales, error) and the hook end to end on 2 and 3
gloo ranks against a plain-PyTorch simulation of EF-SignSGD."""
import functools

import pytest
import torch

import compression_runs
import distributed
from commtune import _C
from conftest import DEVICES, needs_cuda, on_device

CHUNK = compression_runs.CHUNK


def encode(x, chunk):
    """The scheme in tensor ops: per chunk, +-(mean |x|) by sign (zero counts as positive)."""
    n = x.numel()
    padded = torch.nn.functional.pad(x.abs().double(), (0, -n % chunk)).view(-1, chunk)
    counts = torch.full((padded.shape[0],), float(chunk), dtype=torch.float64)
    counts[-1] = n - chunk * (padded.shape[0] - 1)
    scale = (padded.sum(1) / counts).float().repeat_interleave(chunk)[:n]
    return torch.where(x < 0, -scale, scale)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("numel", [21000, 64, 1000])
def test_encoding_packs_the_signs_and_keeps_the_error(device, numel):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    x[::7] = 0.0
    piece = torch.empty(_C.sign_piece_bytes(numel, CHUNK), dtype=torch.uint8, device=device)
    error = torch.empty(numel, device=device)
    _C.sign_encode_(x.to(device), error, piece, CHUNK)
    words = -(-numel // CHUNK) * CHUNK // 32
    bits = piece[:4 * words].cpu().view(torch.int32)
    unpacked = ((bits[:, None] >> torch.arange(32)) & 1).view(-1)[:numel].bool()
    assert torch.equal(unpacked, x < 0)
    decoded = torch.empty(numel, device=device)
    _C.sign_decode_mean_(piece, decoded, 1, CHUNK)
    torch.testing.assert_close(decoded.cpu(), encode(x, CHUNK), rtol=1e-6, atol=0)
    torch.testing.assert_close(error.cpu(), x - decoded.cpu(), rtol=0, atol=0)
    assert piece.numel() == 4 * words + 4 * -(-numel // CHUNK)  # a bit per element, a float per chunk


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1024, 2048])  # on CUDA a warp a chunk, a block a chunk
@pytest.mark.parametrize("offset", [0, 1])
def test_accumulate_encodes_error_plus_bucket_as_add_then_encode_does(device, dtype, chunk, offset):
    # Error feedback's add fused into the encoding (the hook's call): the same piece and error,
    # bit for bit, as error.add_(bucket) and then encoding the error buffer into itself.
    numel = 5001  # a last chunk and a last group of four cut short
    gen = torch.Generator().manual_seed(8)
    error, bucket = (torch.randn(numel, generator=gen).to(dtype) for _ in range(2))
    pieces = [torch.empty(_C.sign_piece_bytes(numel, chunk), dtype=torch.uint8, device=device) for _ in range(2)]
    before = on_device(error, device, offset)
    before.add_(on_device(bucket, device, offset))
    _C.sign_encode_(before, before, pieces[0], chunk)
    fused, added = on_device(error, device, offset), on_device(bucket, device, offset)
    _C.sign_encode_(added, fused, pieces[1], chunk, accumulate=True)
    assert torch.equal(pieces[1], pieces[0])
    assert torch.equal(fused, before)
    assert torch.equal(added.cpu(), bucket)  # only read


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("numel", [3000, 2999])  # 2999: a thread's last group of four is cut short
def test_decoding_averages_the_ranks_pieces(device, numel):
    xs = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    pieces = []
    for x in xs:
        piece = torch.empty(_C.sign_piece_bytes(numel, CHUNK), dtype=torch.uint8, device=device)
        _C.sign_encode_(x.to(device), None, piece, CHUNK)
        pieces.append(piece)
    out = torch.empty(numel, device=device)
    _C.sign_decode_mean_(torch.cat(pieces), out, 3, CHUNK)
    expected = (encode(xs[0], CHUNK) + encode(xs[1], CHUNK) + encode(xs[2], CHUNK)) / 3
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_pieces_off_a_word_are_refused(device):
    numel = 3000
    spare = torch.zeros(2 * _C.sign_piece_bytes(numel, CHUNK) + 1, dtype=torch.uint8, device=device)
    with pytest.raises(RuntimeError, match="encoded piece must start 4-byte aligned"):
        _C.sign_encode_(torch.ones(numel, device=device), None, spare[1:_C.sign_piece_bytes(numel, CHUNK) + 1], CHUNK)
    with pytest.raises(RuntimeError, match="gathered pieces must start 4-byte aligned"):
        _C.sign_decode_mean_(spare[1:], torch.empty(numel, device=device), 2, CHUNK)


def test_passes_refuse_buffers_on_another_device():
    # as Quantize's (tests/test_quantize.py): the meta device stands in for another device
    numel = 3000
    piece = torch.empty(_C.sign_piece_bytes(numel, CHUNK), dtype=torch.uint8)
    elsewhere = torch.empty(2 * piece.numel(), dtype=torch.uint8, device="meta")
    with pytest.raises(RuntimeError, match="encoded piece must be on cpu"):
        _C.sign_encode_(torch.ones(numel), None, elsewhere[:piece.numel()], CHUNK)
    with pytest.raises(RuntimeError, match="error buffer must be on cpu"):
        _C.sign_encode_(torch.ones(numel), torch.empty(numel, device="meta"), piece, CHUNK)
    with pytest.raises(RuntimeError, match="gathered pieces must be on cpu"):
        _C.sign_decode_mean_(elsewhere, torch.empty(numel), 2, CHUNK)


def simulate(steps_locals, world):
    errors = [torch.zeros_like(steps_locals[0][0]) for _ in range(world)]
    out = []
    for grads in steps_locals:
        total = torch.zeros_like(grads[0])
        for r in range(world):
            sent = errors[r] + grads[r]
            decoded = encode(sent, CHUNK)
            errors[r] = sent - decoded
            total = total + decoded
        out.append(total / world)
    return out


@functools.lru_cache(maxsize=None)
def run(world_size):
    return distributed.run(compression_runs.hook_run, world_size, 4, "SignSGD")


@pytest.mark.parametrize("world_size", [2, 3])
def test_hook_equals_the_simulated_scheme_and_ranks_agree(world_size):
    results = run(world_size)
    expected = simulate([grads for _, grads in results[0]["steps"]], world_size)
    for r in results:
        for (ours, _), theirs, (first, _) in zip(r["steps"], expected, results[0]["steps"]):
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-9)
            assert torch.equal(ours, first)


def test_without_error_feedback_each_step_stands_alone():
    results = distributed.run(compression_runs.hook_run, 2, 3, "SignSGD", "cpu", {"error_feedback": False})
    compression_runs.assert_steps_stand_alone(results, lambda steps: simulate(steps, 2), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("world_size", [2, 3])
def test_counters_count_the_packed_bytes(world_size):
    stats = run(world_size)[0]["stats"]
    numel, steps, chunks = 300 * 70, 4, -(-300 * 70 // CHUNK)
    piece = chunks * CHUNK // 8 + 4 * chunks
    assert stats["calls"] == steps and stats["bytes_in"] == steps * numel * 4
    assert stats["bytes_out"] == steps * piece
    assert stats["compression_ratio"] == pytest.approx(numel * 4 / piece)
    # An all-gather: this rank's piece goes to each of the n - 1 others, so the saving against a
    # ring allreduce (2 (n - 1) / n of the bucket) shrinks as ranks are added.
    sent = (world_size - 1) * piece
    assert stats["wire_bytes"] == pytest.approx(steps * sent, rel=1e-12)
    assert stats["wire_ratio"] == pytest.approx(2 * (world_size - 1) / world_size * numel * 4 / sent)


def test_state_dict_carries_the_error_and_resumes_bit_for_bit():
    for r in distributed.run(compression_runs.resume_run, 2, 5, 3, "SignSGD"):
        for a, b in zip(r["straight"], r["resumed"]):
            assert torch.equal(a, b)
    assert set(run(2)[0]["state"]) == {"iteration", "error.0"}


@needs_cuda
@pytest.mark.needs_cuda
def test_cuda_and_cpu_encodings_agree():
    x = torch.randn(50_000, generator=torch.Generator().manual_seed(9))
    pieces = []
    for device in ("cpu", "cuda"):
        piece = torch.empty(_C.sign_piece_bytes(50_000, 1024), dtype=torch.uint8, device=device)
        _C.sign_encode_(x.to(device), None, piece, 1024)
        pieces.append(piece.cpu())
    words = 49 * 1024 // 32
    assert torch.equal(pieces[0][:4 * words], pieces[1][:4 * words])  # the signs exactly
    torch.testing.assert_close(pieces[0][4 * words:].view(torch.float32), pieces[1][4 * words:].view(torch.float32),
                               rtol=1e-6, atol=0)  # scales: the same float64 sum, in another order


@needs_cuda
@pytest.mark.needs_cuda
@pytest.mark.parametrize("chunk,ranks,dtype", [(1024, 8, torch.float32), (2048, 3, torch.float32), (1024, 1, torch.float32),
                                               (1024, 5, torch.float16), (1024, 11, torch.float32), (256, 8, torch.float32)])
def test_cuda_decoding_equals_the_cpu_bit_for_bit(chunk, ranks, dtype):
    """CUDA decodes by a table of sign patterns (chunks of whole multiples of 1024, up to 8 ranks)
    or rank by rank; either way the same sums, in the same order, as the CPU."""
    numel = 5 * 2048 + 96  # the last chunk cut short, and the last warp's words past the bucket
    pieces = []
    for r in range(ranks):
        x = torch.randn(numel, generator=torch.Generator().manual_seed(100 + r)) * (r + 1)
        piece = torch.empty(_C.sign_piece_bytes(numel, chunk), dtype=torch.uint8)
        _C.sign_encode_(x, None, piece, chunk)
        pieces.append(piece)
    gathered = torch.cat(pieces)
    on_cpu = torch.empty(numel, dtype=dtype)
    _C.sign_decode_mean_(gathered, on_cpu, ranks, chunk)
    on_cuda = torch.empty(numel, dtype=dtype, device="cuda")
    _C.sign_decode_mean_(gathered.cuda(), on_cuda, ranks, chunk)
    assert torch.equal(on_cuda.cpu(), on_cpu)
    assert len(on_cpu.unique()) > 2 ** min(ranks, 6) // 2  # many sign patterns were decoded


def test_bad_values_are_refused():
    import commtune as ct

    for kw, word in [({"chunk": 48}, "chunk"), ({"chunk": 0}, "chunk"), ({"error_feedback": 1}, "error_feedback"),
                     ({"min_size": -1}, "min_size"), ({"min_size": 2**63}, "min_size")]:
        with pytest.raises(ValueError, match=word):
            ct.hooks.SignSGD(**kw).validate()


def test_accumulate_needs_an_error_buffer_of_the_buckets_kind():
    piece = torch.empty(_C.sign_piece_bytes(100, CHUNK), dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="SignSGD: adding the bucket to the error buffer needs an error buffer"):
        _C.sign_encode_(torch.ones(100), None, piece, CHUNK, accumulate=True)
    with pytest.raises(RuntimeError, match="SignSGD: the tensor added to the error buffer must be .* Double"):
        _C.sign_encode_(torch.ones(100), torch.zeros(100, dtype=torch.float64), piece, CHUNK, accumulate=True)
    both = torch.zeros(150)
    with pytest.raises(RuntimeError, match="overlaps it in part"):
        _C.sign_encode_(both[:100], both[50:], piece, CHUNK, accumulate=True)
