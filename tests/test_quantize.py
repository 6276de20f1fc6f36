"""Quantize: its kernels (error bounds, unbiased stochastic rounding, CPU = CUDA bits) and the
hook end to end on 2 and 3 gloo ranks against a plain-PyTorch simulation of the same scheme."""
import functools
import math

import pytest
import torch

import compression_runs
import distributed
from commtune import _C
from conftest import DEVICES, cuda_world_size, needs_cuda, on_device

CODES = ["int8", "int4", "e4m3"]
TOP = {"int8": 127, "int4": 7, "e4m3": 448}  # the largest code magnitude
BITS = {"int8": 8, "int4": 4, "e4m3": 8}


def round_trip(src, ranks, chunk, draws=-1, codes="int8"):
    """The three passes on one rank, as if every rank sent `src`: the packed shards, the error
    src - decoded, shard 0 summed over the ranks and encoded again, the first encoding decoded,
    and the shard size."""
    shard, piece_bytes = _C.quantize_layout(src.numel(), ranks, chunk, codes)
    packed = torch.empty(ranks * piece_bytes, dtype=torch.uint8, device=src.device)
    error = torch.empty_like(src)
    _C.quantize_shards_(src, error, packed, ranks, chunk, draws, codes)
    piece = torch.empty(piece_bytes, dtype=torch.uint8, device=src.device)
    _C.reduce_shard_(packed[:piece_bytes].repeat(ranks), piece, src.numel(), ranks, chunk, ranks, draws, codes)
    decoded = torch.empty_like(src)
    _C.dequantize_shards_(packed, decoded, ranks, chunk, codes)
    return packed, error, piece, decoded, shard


def levels(values, chunk, codes="int8"):
    """The scheme in tensor ops, rounding to nearest: per-chunk absmax scale, integer codes
    floor(x / scale + 0.5), or e4m3 codes by torch's own float8_e4m3fn conversion. Returns the
    codes' values (before the scale), one row a chunk, and the scales."""
    v = values.view(-1, chunk)
    scale = v.abs().amax(1) / TOP[codes]
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    y = v * inverse[:, None]
    if codes == "e4m3":
        return y.to(torch.float8_e4m3fn).float(), scale  # torch's conversion: to nearest, ties to even
    return torch.floor(y + 0.5).clamp(-TOP[codes], TOP[codes]), scale


def encode(values, chunk, codes="int8"):
    """The values as the scheme decodes them, and the scales."""
    q, scale = levels(values, chunk, codes)
    return (q * scale[:, None]).view(-1), scale


BIAS = {"int8": 128, "int4": 8, "e4m3": 0}  # what a stored integer code is over the code


def sum_decoded(encoded, codes):
    """The sum over (codes' values, scales) pairs in rank order, one rounding a code, as the reduce
    kernels make it: e4m3 codes times their scale, added in turn; int8 and int4 codes as stored
    (code + bias) times their scale, added in turn, less the bias times the scales' sum (taken in
    turn). The products are exact in float64, and so are the sums wherever the terms are within
    2^21 of each other (true of these tests' data): each step rounds once to float32."""
    total = torch.zeros_like(encoded[0][0], dtype=torch.float64)
    scales = torch.zeros_like(encoded[0][1], dtype=torch.float64)
    for q, scale in encoded:
        total = (total + (q.double() + BIAS[codes]) * scale.double()[:, None]).float().double()
        scales = (scales + scale.double()).float().double()
    return (total - BIAS[codes] * scales[:, None]).float().view(-1)


def step_of(values, chunk, codes):
    """Per element, the distance between the two codes around it (in the values' units)."""
    v = values.double().view(-1, chunk)
    scale = v.abs().amax(1, keepdim=True) / TOP[codes]
    if codes != "e4m3":
        return scale.expand_as(v).reshape(-1)
    binade = torch.floor(torch.log2((v / scale).abs().clamp(min=2.0 ** -6))).clamp(min=-6)
    return (2.0 ** (binade - 3) * scale).view(-1)


def unpack(code_bytes, codes):
    """Codes as stored: a signed byte each, an fp8 byte, or two per byte plus 8 (the even one low)."""
    if codes == "e4m3":
        return code_bytes.view(torch.float8_e4m3fn).float()
    if codes == "int8":
        return code_bytes.view(torch.int8).float()
    pairs = torch.stack([code_bytes & 15, code_bytes >> 4], 1).view(-1)
    return pairs.float() - 8


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codes", CODES)
# chunks above 1024 take the one-block-per-chunk CUDA kernels, the others one warp per chunk
@pytest.mark.parametrize("numel,ranks,chunk", [(10_000, 3, 256), (4096, 2, 1024), (77, 4, 8), (20_000, 3, 2048)])
def test_rounding_to_nearest_matches_the_scheme_and_bounds_the_error(device, codes, numel, ranks, chunk):
    src = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3
    src[::5] *= 1e-3  # e4m3: values across many binades, subnormal codes too
    packed, error, piece, decoded, shard = (t.cpu() if isinstance(t, torch.Tensor) else t
                                            for t in round_trip(src.to(device), ranks, chunk, codes=codes))
    code_bytes = shard * BITS[codes] // 8
    assert shard % chunk == 0 and shard * ranks >= numel > shard * (ranks - 1) - chunk
    assert packed.numel() == ranks * (code_bytes + 4 * shard // chunk)  # the codes and one float per chunk
    padded = torch.nn.functional.pad(src, (0, ranks * shard - numel))
    expected, _ = encode(padded, chunk, codes)
    torch.testing.assert_close(decoded, expected[:numel], rtol=0, atol=0)
    torch.testing.assert_close(error, src - decoded, rtol=0, atol=0)
    assert bool(((src - decoded).abs() <= step_of(padded, chunk, codes)[:numel] / 2 + 1e-7).all())
    # every rank sent the same: shard 0's sum over the ranks, in rank order, divided and encoded again
    total = sum_decoded([levels(padded[:shard], chunk, codes)] * ranks, codes)
    again, _ = encode(total / ranks, chunk, codes)
    reduced = torch.tensor(piece[code_bytes:].numpy().view("float32"))
    values = unpack(piece[:code_bytes], codes).view(-1, chunk)
    torch.testing.assert_close((values * reduced[:, None]).view(-1), again, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codes", CODES)
def test_stochastic_rounding_is_unbiased(device, codes):
    src = torch.randn(2048, generator=torch.Generator().manual_seed(7))
    draws = 400
    mean = sum(round_trip(src.to(device), 1, 256, seed, codes)[3].cpu().double() for seed in range(draws)) / draws
    # one draw errs by up to a step, with variance <= step^2 / 4: the mean of 400 by ~step / 40
    z = ((mean - src.double()) / (step_of(src, 256, codes) / 2 / math.sqrt(draws))).abs()
    assert float(z.mean()) < 1.0 and float(z.max()) < 6
    nearest = round_trip(src.to(device), 1, 256, codes=codes)[3].cpu().double()
    assert float((nearest - src).abs().mean()) > 5 * float((mean - src).abs().mean())  # no bias like rounding


@needs_cuda
@pytest.mark.needs_cuda
@pytest.mark.parametrize("codes", CODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("chunk", [512, 2048])
def test_cuda_and_cpu_kernels_give_the_same_bits(dtype, codes, chunk):
    src = (torch.randn(50_000, generator=torch.Generator().manual_seed(3)) * 5).to(dtype)
    # The first half's chunks hold values across many binades (e4m3's subnormal codes, encoded
    # a code at a time); the second half's only normal ones (e4m3's word-at-a-time encoder).
    src[:25_000:3] *= 1e-4
    cpu = round_trip(src, 3, chunk, 12345, codes)
    gpu = round_trip(src.cuda(), 3, chunk, 12345, codes)
    for a, b in zip(cpu[:4], gpu[:4]):
        assert torch.equal(a, b.cpu())


@needs_cuda
@pytest.mark.needs_cuda
@pytest.mark.parametrize("codes", CODES)
@pytest.mark.parametrize("ranks,chunk,divisor", [(8, 1024, 8), (16, 1024, 16), (11, 256, 11), (9, 1000, 9),
                                                  (8, 2048, 8), (41, 1024, 41), (6, 1024, 8)])
def test_cuda_and_cpu_reduce_different_ranks_to_the_same_bits(codes, ranks, chunk, divisor):
    # Each rank's own shard 0 (a different bucket per rank), so a rank's codes or scale read in
    # another's place shows. The warp kernel adds ranks two at a time (9, 11 and 41 end with one
    # alone); at 8 and 16 ranks (a power of two, chunks of 1024) each kind takes its common-case
    # kernel, int4's with four ranks at a time, as do 6 ranks whose mean divides by 8 (a divisor
    # the caller picks; int4's kernel ends with two ranks one at a time); chunks of 256 and 1000
    # leave lanes past the chunk; 2048 takes the block kernel; 41 ranks' scales are more than a
    # warp's lanes, which find the largest one together.
    numel = 40_000
    pieces = []
    for r in range(ranks):
        src = torch.randn(numel, generator=torch.Generator().manual_seed(50 + r)) * (r + 1)
        packed = round_trip(src, ranks, chunk, 7, codes)[0]
        pieces.append(packed[: packed.numel() // ranks])
    received = torch.cat(pieces)
    out = []
    for device in ("cpu", "cuda"):
        piece = torch.empty(pieces[0].numel(), dtype=torch.uint8, device=device)
        _C.reduce_shard_(received.to(device), piece, numel, ranks, chunk, divisor, 99, codes)
        out.append(piece.cpu())
    assert torch.equal(out[0], out[1])


@needs_cuda
@pytest.mark.needs_cuda
@pytest.mark.parametrize("codes", CODES)
@pytest.mark.parametrize("ranks", [8, 9])
def test_cuda_reduce_of_a_large_shard_is_the_cpu_bits(codes, ranks):
    # 4000 chunks a shard, more than one wave of the reduce's warps on any GPU (an H200 holds
    # 3168): random codes (int8's -128 too; e4m3's NaN codes left out) with scales from 2^-41 to
    # 2^20 side by side, cheaper than encoding pieces.
    chunk, chunks = 1024, 4000
    numel = ranks * chunk * chunks
    shard, piece_bytes = _C.quantize_layout(numel, ranks, chunk, codes)
    assert shard == chunk * chunks
    g = torch.Generator().manual_seed(ranks)
    received = torch.randint(0, 256, (ranks, piece_bytes), dtype=torch.uint8, generator=g)
    if codes == "e4m3":
        received[(received & 0x7F) == 0x7F] = 0x7E
    code_bytes = shard * BITS[codes] // 8
    scales = torch.rand(ranks, chunks, generator=g) * 2.0 ** torch.randint(-40, 20, (ranks, chunks), generator=g)
    received[:, code_bytes:] = scales.view(torch.uint8).view(ranks, -1)
    out = []
    for device in ("cpu", "cuda"):
        piece = torch.empty(piece_bytes, dtype=torch.uint8, device=device)
        _C.reduce_shard_(received.view(-1).to(device), piece, numel, ranks, chunk, ranks, 5, codes)
        out.append(piece.cpu())
    assert torch.equal(out[0], out[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codes", CODES)
def test_inf_and_nan_make_their_chunk_not_finite_and_leave_no_error(device, codes):
    # An Inf (chunk 0) and a NaN (chunk 2) must reach the decoded values, the whole chunk not
    # finite, so that a loss scaler sees them on every rank; the error feedback keeps nothing of
    # those chunks (else every later step would be NaN). The other chunks are untouched.
    numel, ranks, chunk = 4096, 2, 1024
    src = torch.randn(numel, generator=torch.Generator().manual_seed(5))
    src[5], src[2 * chunk + 7] = float("inf"), float("nan")
    _, error, _, decoded = (t.cpu() for t in round_trip(src.to(device), ranks, chunk, codes=codes)[:4])
    bad = torch.zeros(numel, dtype=torch.bool)
    bad[:chunk] = bad[2 * chunk:3 * chunk] = True
    assert not torch.isfinite(decoded[bad]).any()
    assert bool((error[bad] == 0).all())
    clean = src.clone()
    clean[bad] = 0
    expected, _ = encode(clean, chunk, codes)
    assert torch.equal(decoded[~bad], expected[~bad])
    assert torch.equal(error[~bad], (src - decoded)[~bad])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codes", CODES)
def test_a_chunk_too_small_for_a_normal_scale_encodes_as_zeros_and_keeps_its_error(device, codes):
    # Chunk 1's values are normal floats (2e-38 to 4e-38) but its scale, absmax / top, would be
    # subnormal: it is 0 on CPU and GPU alike, the chunk decodes as zeros and the error feedback
    # keeps its values. (The CPU once took the subnormal scale's infinite inverse and encoded the
    # chunk as -top or +-top codes.) The other chunks are untouched.
    numel, ranks, chunk = 4096, 2, 1024
    g = torch.Generator().manual_seed(9)
    src = torch.randn(numel, generator=g)
    sign = torch.where(torch.rand(chunk, generator=g) < 0.5, -1.0, 1.0)
    src[chunk:2 * chunk] = sign * (1 + torch.rand(chunk, generator=g)) * 2e-38
    _, error, _, decoded = (t.cpu() for t in round_trip(src.to(device), ranks, chunk, codes=codes)[:4])
    tiny = torch.zeros(numel, dtype=torch.bool)
    tiny[chunk:2 * chunk] = True
    assert bool((decoded[tiny] == 0).all())
    assert torch.equal(error[tiny], src[tiny])
    expected, _ = encode(src.masked_fill(tiny, 0), chunk, codes)
    assert torch.equal(decoded[~tiny], expected[~tiny])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codes", CODES)
def test_an_infinite_scale_reaches_the_reduced_chunk(device, codes):
    # One rank's chunk overflowed (its scale is Inf): the reduced chunk's values must not be
    # finite on any rank; the other chunk is whole.
    numel, ranks, chunk = 4096, 2, 1024
    src = torch.randn(numel, generator=torch.Generator().manual_seed(11))
    shard, piece_bytes = _C.quantize_layout(numel, ranks, chunk, codes)
    code_bytes = shard * BITS[codes] // 8
    received = round_trip(src, ranks, chunk, codes=codes)[0][:piece_bytes].repeat(ranks)
    received[piece_bytes + code_bytes:piece_bytes + code_bytes + 4] = torch.tensor([float("inf")]).view(torch.uint8)
    piece = torch.empty(piece_bytes, dtype=torch.uint8, device=device)
    _C.reduce_shard_(received.to(device), piece, numel, ranks, chunk, ranks, 5, codes)
    piece = piece.cpu()
    scales = torch.tensor(piece[code_bytes:].numpy().view("float32"))
    decoded = unpack(piece[:code_bytes], codes).view(-1, chunk) * scales[:, None]
    assert not torch.isfinite(decoded[0]).any()
    assert torch.isfinite(decoded[1]).all() and decoded[1].abs().max() > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codes", CODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("chunk", [1024, 2048])  # on CUDA a warp a chunk, a block a chunk
@pytest.mark.parametrize("offset", [0, 1])
def test_accumulate_encodes_error_plus_bucket_as_add_then_encode_does(device, codes, dtype, chunk, offset):
    # Error feedback's add fused into the encoding (the hook's call): the same codes and error,
    # bit for bit, as error.add_(bucket) and then encoding the error buffer into itself.
    numel, ranks, draws = 9001, 3, 11  # stochastic rounding; shards and chunks cut short
    gen = torch.Generator().manual_seed(9)
    error, bucket = (torch.randn(numel, generator=gen).to(dtype) for _ in range(2))
    _, piece_bytes = _C.quantize_layout(numel, ranks, chunk, codes)
    packed = [torch.empty(ranks * piece_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
    before = on_device(error, device, offset)
    before.add_(on_device(bucket, device, offset))
    _C.quantize_shards_(before, before, packed[0], ranks, chunk, draws, codes)
    fused, added = on_device(error, device, offset), on_device(bucket, device, offset)
    _C.quantize_shards_(added, fused, packed[1], ranks, chunk, draws, codes, accumulate=True)
    assert torch.equal(packed[1], packed[0])
    assert torch.equal(fused, before)
    assert torch.equal(added.cpu(), bucket)  # only read


def test_accumulate_needs_an_error_buffer_of_the_buckets_kind():
    _, piece_bytes = _C.quantize_layout(100, 1, 64, "int8")
    packed = torch.empty(piece_bytes, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="Quantize: adding the bucket to the error buffer needs an error buffer"):
        _C.quantize_shards_(torch.ones(100), None, packed, 1, 64, -1, "int8", accumulate=True)
    with pytest.raises(RuntimeError, match="Quantize: the tensor added to the error buffer must be .* Half"):
        _C.quantize_shards_(torch.ones(100), torch.zeros(100).half(), packed, 1, 64, -1, "int8", accumulate=True)


@pytest.mark.parametrize("device", DEVICES)
def test_passes_refuse_pieces_off_a_word(device):
    numel, ranks, chunk = 4096, 2, 1024
    _, piece_bytes = _C.quantize_layout(numel, ranks, chunk, "int8")
    spare = torch.zeros(ranks * piece_bytes + 1, dtype=torch.uint8, device=device)
    piece = torch.empty(piece_bytes, dtype=torch.uint8, device=device)
    with pytest.raises(RuntimeError, match="received pieces must start 4-byte aligned"):
        _C.reduce_shard_(spare[1:], piece, numel, ranks, chunk, ranks, 5, "int8")
    with pytest.raises(RuntimeError, match="packed buffer must start 4-byte aligned"):
        _C.quantize_shards_(torch.ones(numel, device=device), None, spare[1:], ranks, chunk, 5, "int8")
    with pytest.raises(RuntimeError, match="gathered pieces must start 4-byte aligned"):
        _C.dequantize_shards_(spare[1:], torch.empty(numel, device=device), ranks, chunk, "int8")


# ---- the hook through DDP -------------------------------------------------------------------

CHUNK = compression_runs.CHUNK


def simulate(steps_locals, world, chunk, codes="int8"):
    """The scheme with error feedback and rounding to nearest, in float32 tensor ops."""
    numel = steps_locals[0][0].numel()
    shard = math.ceil(math.ceil(numel / world) / chunk) * chunk
    errors = [torch.zeros(numel) for _ in range(world)]
    out = []
    for grads in steps_locals:
        encoded = []
        for r in range(world):
            sent = errors[r] + grads[r]
            q, scale = levels(torch.nn.functional.pad(sent, (0, world * shard - numel)), chunk, codes)
            errors[r] = sent - (q * scale[:, None]).view(-1)[:numel]
            encoded.append((q, scale))
        mean, _ = encode(sum_decoded(encoded, codes) / world, chunk, codes)
        out.append(mean[:numel])
    return out


@functools.lru_cache(maxsize=None)
def run(world_size, hook):
    return distributed.run(compression_runs.hook_run, world_size, 4, hook)


NEAREST_HOOKS = [("Quantize-nearest", "int8"), ("Quantize4-nearest", "int4"), ("QuantizeE4M3-nearest", "e4m3")]


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("hook,codes", NEAREST_HOOKS)
def test_hook_equals_the_simulated_scheme(world_size, hook, codes):
    results = run(world_size, hook)
    expected = simulate([grads for _, grads in results[0]["steps"]], world_size, CHUNK, codes)
    for r in results:
        for (ours, _), theirs in zip(r["steps"], expected):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


@needs_cuda
@pytest.mark.needs_cuda
@pytest.mark.parametrize("hook,codes", NEAREST_HOOKS)
def test_hook_on_nccl_equals_the_simulated_scheme(hook, codes):
    world = cuda_world_size()
    results = distributed.run(compression_runs.hook_run, world, 4, hook, "cuda", backend="nccl")
    expected = simulate([grads for _, grads in results[0]["steps"]], world, CHUNK, codes)
    for r in results:
        for (ours, _), theirs in zip(r["steps"], expected):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_without_error_feedback_each_step_stands_alone():
    results = distributed.run(compression_runs.hook_run, 2, 3, "Quantize-nearest", "cpu", {"error_feedback": False})
    compression_runs.assert_steps_stand_alone(results, lambda steps: simulate(steps, 2, CHUNK), rtol=0, atol=0)


@pytest.mark.parametrize("world_size", [2, 3])
def test_stochastic_hook_is_close_to_the_mean_and_ranks_agree(world_size):
    results = run(world_size, "Quantize")
    for step, (ours, grads) in enumerate(results[0]["steps"]):
        exact = torch.stack(grads).mean(0)
        assert float((ours - exact).norm() / exact.norm()) < 0.05
        for r in results[1:]:
            assert torch.equal(r["steps"][step][0], ours)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("hook,codes", NEAREST_HOOKS)
def test_counters_count_the_quantized_bytes(world_size, hook, codes):
    stats = run(world_size, hook)[0]["stats"]
    numel, steps = 300 * 70, 4
    shard = math.ceil(math.ceil(numel / world_size) / CHUNK) * CHUNK
    piece = shard * BITS[codes] // 8 + 4 * shard // CHUNK  # one shard's codes and scales
    handed = (world_size + 1) * piece  # every shard to the all-to-all, the reduced one to the all-gather
    assert stats["calls"] == steps and stats["bytes_in"] == steps * numel * 4
    assert stats["bytes_out"] == steps * handed
    assert stats["compression_ratio"] == pytest.approx(numel * 4 / handed)
    # Sent: the n - 1 shards that go elsewhere, then the reduced shard to the n - 1 others.
    sent = 2 * (world_size - 1) * piece
    assert stats["wire_bytes"] == pytest.approx(steps * sent, rel=1e-12)
    ring = 2 * (world_size - 1) / world_size * numel * 4  # a ring allreduce of the fp32 bucket
    assert stats["wire_ratio"] == pytest.approx(ring / sent)


def test_state_dict_carries_the_error_and_resumes_bit_for_bit():
    results = distributed.run(compression_runs.resume_run, 2, 5, 3, "Quantize")
    for r in results:
        for a, b in zip(r["straight"], r["resumed"]):
            assert torch.equal(a, b)
    state = run(2, "Quantize-nearest")[0]["state"]
    assert set(state) == {"iteration", "error.0"} and state["error.0"].numel() == 70 * 300


def test_passes_refuse_buffers_on_another_device():
    # A buffer on another device than the bucket would have the CPU loop read a GPU's memory (or
    # a kernel the host's): refused before any access. The meta device stands in for the other.
    numel, ranks, chunk = 64, 2, 8
    _, piece = _C.quantize_layout(numel, ranks, chunk, "int8")
    src, packed = torch.randn(numel), torch.zeros(ranks * piece, dtype=torch.uint8)
    elsewhere = torch.empty(ranks * piece, dtype=torch.uint8, device="meta")
    with pytest.raises(RuntimeError, match="packed buffer must be on cpu"):
        _C.quantize_shards_(src, None, elsewhere, ranks, chunk, 5, "int8")
    with pytest.raises(RuntimeError, match="error buffer must be on cpu"):
        _C.quantize_shards_(src, torch.empty(numel, device="meta"), packed, ranks, chunk, 5, "int8")
    with pytest.raises(RuntimeError, match="reduced piece must be on cpu"):
        _C.reduce_shard_(packed, elsewhere[:piece], numel, ranks, chunk, ranks, 5, "int8")
    with pytest.raises(RuntimeError, match="gathered pieces must be on cpu"):
        _C.dequantize_shards_(elsewhere, torch.empty(numel), ranks, chunk, "int8")


def test_bad_values_are_refused():
    import commtune as ct

    for kw, word in [({"bits": 2}, "bits"), ({"bits": True}, "bits"), ({"chunk": 6}, "chunk"), ({"chunk": 12}, "chunk"),
                     ({"chunk": 16384}, "chunk"), ({"format": "e5m2"}, "format"), ({"format": "e4m3", "bits": 4}, "e4m3"),
                     ({"stochastic": 1}, "stochastic"), ({"seed": -1}, "seed"), ({"min_size": -5}, "min_size"),
                     ({"bits": 3}, "bits"), ({"chunk": 0}, "chunk"),
                     ({"seed": 2**63}, r"seed must be an integer in \[0, 2\*\*63\)"),  # the C++ options' int64
                     ({"min_size": 2**64}, "min_size")]:
        with pytest.raises(ValueError, match=word):
            ct.hooks.Quantize(**kw).validate()
