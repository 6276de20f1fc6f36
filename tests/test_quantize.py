"""Quantize: its kernels (error bounds, unbiased stochastic rounding, CPU = CUDA bits) and the
hook end to end on 2 and 3 gloo ranks against a plain-PyTorch simulation of the same scheme."""
import functools
import math

import pytest
import torch

import compression_runs
import distributed
from commtune import _C
from conftest import DEVICES, cuda_world_size, needs_cuda

LEVELS = {8: 127, 4: 7}


def round_trip(src, ranks, chunk, draws=-1, bits=8):
    """The three passes on one rank, as if every rank sent `src`: the packed shards, the error
    src - decoded, shard 0 summed over the ranks and encoded again, the first encoding decoded,
    and the shard size."""
    shard, piece_bytes = _C.quantize_layout(src.numel(), ranks, chunk, bits)
    packed = torch.empty(ranks * piece_bytes, dtype=torch.uint8, device=src.device)
    error = torch.empty_like(src)
    _C.quantize_shards_(src, error, packed, ranks, chunk, draws, bits)
    piece = torch.empty(piece_bytes, dtype=torch.uint8, device=src.device)
    _C.reduce_shard_(packed[:piece_bytes].repeat(ranks), piece, src.numel(), ranks, chunk, ranks, draws, bits)
    decoded = torch.empty_like(src)
    _C.dequantize_shards_(packed, decoded, ranks, chunk, bits)
    return packed, error, piece, decoded, shard


def encode(values, chunk, draw=None, bits=8):
    """The scheme in tensor ops: per-chunk absmax scale, codes floor(x / scale + draw)."""
    v = values.view(-1, chunk)
    scale = v.abs().amax(1) / LEVELS[bits]
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    draw = torch.full_like(v, 0.5) if draw is None else draw.view(-1, chunk)
    codes = torch.floor(v * inverse[:, None] + draw).clamp(-LEVELS[bits], LEVELS[bits])
    return (codes * scale[:, None]).view(-1), scale


def unpack(code_bytes, bits):
    """Codes as stored: a signed byte each, or two per byte plus 8 (the even one low)."""
    if bits == 8:
        return code_bytes.view(torch.int8).float()
    pairs = torch.stack([code_bytes & 15, code_bytes >> 4], 1).view(-1)
    return pairs.float() - 8


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel,ranks,chunk", [(10_000, 3, 256), (4096, 2, 1024), (77, 4, 8)])
def test_rounding_to_nearest_matches_the_scheme_and_bounds_the_error(device, bits, numel, ranks, chunk):
    src = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3
    packed, error, piece, decoded, shard = (t.cpu() if isinstance(t, torch.Tensor) else t
                                            for t in round_trip(src.to(device), ranks, chunk, bits=bits))
    code_bytes = shard * bits // 8
    assert shard % chunk == 0 and shard * ranks >= numel > shard * (ranks - 1) - chunk
    assert packed.numel() == ranks * (code_bytes + 4 * shard // chunk)  # the codes and one float per chunk
    padded = torch.nn.functional.pad(src, (0, ranks * shard - numel))
    expected, scale = encode(padded, chunk, bits=bits)
    torch.testing.assert_close(decoded, expected[:numel], rtol=0, atol=0)
    torch.testing.assert_close(error, src - decoded, rtol=0, atol=0)
    assert bool(((src - decoded).abs().view(-1) <= scale.repeat_interleave(chunk)[:numel] / 2 + 1e-7).all())
    # every rank sent the same: shard 0's sum over the ranks, in rank order, divided and encoded again
    total = torch.zeros(shard)
    for _ in range(ranks):
        total = total + expected[:shard]
    again, _ = encode(total / ranks, chunk, bits=bits)
    reduced = torch.tensor(piece[code_bytes:].numpy().view("float32"))
    codes = unpack(piece[:code_bytes], bits).view(-1, chunk)
    torch.testing.assert_close((codes * reduced[:, None]).view(-1), again, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [8, 4])
def test_stochastic_rounding_is_unbiased(device, bits):
    src = torch.randn(2048, generator=torch.Generator().manual_seed(7))
    draws = 400
    mean = sum(round_trip(src.to(device), 1, 256, seed, bits)[3].cpu().double() for seed in range(draws)) / draws
    scale = src.view(-1, 256).abs().amax(1).double().repeat_interleave(256) / LEVELS[bits]
    # one draw errs by up to a scale, with variance <= scale^2 / 4: the mean of 400 by ~scale / 40
    z = ((mean - src.double()) / (scale / 2 / math.sqrt(draws))).abs()
    assert float(z.mean()) < 1.0 and float(z.max()) < 6
    nearest = round_trip(src.to(device), 1, 256, bits=bits)[3].cpu().double()
    assert float((nearest - src).abs().mean()) > 5 * float((mean - src).abs().mean())  # no bias like rounding


@needs_cuda
@pytest.mark.needs_cuda
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_and_cpu_kernels_give_the_same_bits(dtype, bits):
    src = (torch.randn(50_000, generator=torch.Generator().manual_seed(3)) * 5).to(dtype)
    cpu = round_trip(src, 3, 512, 12345, bits)
    gpu = round_trip(src.cuda(), 3, 512, 12345, bits)
    for a, b in zip(cpu[:4], gpu[:4]):
        assert torch.equal(a, b.cpu())


# ---- the hook through DDP -------------------------------------------------------------------

CHUNK = compression_runs.CHUNK


def simulate(steps_locals, world, chunk, bits=8):
    """The scheme with error feedback and rounding to nearest, in float32 tensor ops."""
    numel = steps_locals[0][0].numel()
    shard = math.ceil(math.ceil(numel / world) / chunk) * chunk
    errors = [torch.zeros(numel) for _ in range(world)]
    out = []
    for grads in steps_locals:
        decoded = []
        for r in range(world):
            sent = errors[r] + grads[r]
            d, _ = encode(torch.nn.functional.pad(sent, (0, world * shard - numel)), chunk, bits=bits)
            errors[r] = sent - d[:numel]
            decoded.append(d)
        total = torch.zeros(world * shard)
        for d in decoded:
            total = total + d
        mean, _ = encode(total / world, chunk, bits=bits)
        out.append(mean[:numel])
    return out


@functools.lru_cache(maxsize=None)
def run(world_size, hook):
    return distributed.run(compression_runs.hook_run, world_size, 4, hook)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("hook,bits", [("Quantize-nearest", 8), ("Quantize4-nearest", 4)])
def test_hook_equals_the_simulated_scheme(world_size, hook, bits):
    results = run(world_size, hook)
    expected = simulate([grads for _, grads in results[0]["steps"]], world_size, CHUNK, bits)
    for r in results:
        for (ours, _), theirs in zip(r["steps"], expected):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


@needs_cuda
@pytest.mark.needs_cuda
def test_hook_on_nccl_equals_the_simulated_scheme():
    world = cuda_world_size()
    results = distributed.run(compression_runs.hook_run, world, 4, "Quantize-nearest", "cuda", backend="nccl")
    expected = simulate([grads for _, grads in results[0]["steps"]], world, CHUNK)
    for r in results:
        for (ours, _), theirs in zip(r["steps"], expected):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("world_size", [2, 3])
def test_stochastic_hook_is_close_to_the_mean_and_ranks_agree(world_size):
    results = run(world_size, "Quantize")
    for step, (ours, grads) in enumerate(results[0]["steps"]):
        exact = torch.stack(grads).mean(0)
        assert float((ours - exact).norm() / exact.norm()) < 0.05
        for r in results[1:]:
            assert torch.equal(r["steps"][step][0], ours)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("hook,bits", [("Quantize-nearest", 8), ("Quantize4-nearest", 4)])
def test_counters_count_the_quantized_bytes(world_size, hook, bits):
    stats = run(world_size, hook)[0]["stats"]
    numel, steps = 300 * 70, 4
    shard = math.ceil(math.ceil(numel / world_size) / CHUNK) * CHUNK
    quantized = world_size * (shard * bits // 8 + 4 * shard // CHUNK)
    assert stats["calls"] == steps and stats["bytes_in"] == steps * numel * 4
    assert stats["bytes_out"] == steps * quantized
    assert stats["compression_ratio"] == pytest.approx(numel * 4 / quantized)


def test_state_dict_carries_the_error_and_resumes_bit_for_bit():
    results = distributed.run(compression_runs.resume_run, 2, 5, 3, "Quantize")
    for r in results:
        for a, b in zip(r["straight"], r["resumed"]):
            assert torch.equal(a, b)
    state = run(2, "Quantize-nearest")[0]["state"]
    assert set(state) == {"iteration", "error.0"} and state["error.0"].numel() == 70 * 300


def test_bad_values_are_refused():
    import commtune as ct

    for kw, word in [({"bits": 2}, "bits"), ({"bits": True}, "bits"), ({"chunk": 6}, "chunk"), ({"chunk": 12}, "chunk"), ({"chunk": 16384}, "chunk"),
                     ({"stochastic": 1}, "stochastic"), ({"seed": -1}, "seed"), ({"min_size": -5}, "min_size")]:
        with pytest.raises(ValueError, match=word):
            ct.hooks.Quantize(**kw).validate()
