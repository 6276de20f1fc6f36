"""AllReduce and Cast end to end through DDP on several gloo ranks, against the exact mean
and against torch's own hooks."""
import functools

import pytest
import torch

import distributed
from ddp_variants import lockstep

STEPS = 5
VARIANTS = [
    "commtune.AllReduce", "torch.allreduce_hook", "torch.builtin_allreduce",
    "commtune.Cast(fp16)", "torch.fp16_compress_hook",
    "commtune.Cast(bf16)", "torch.bf16_compress_hook",
]


@functools.lru_cache(maxsize=None)
def run(world_size):
    return distributed.run(lockstep, world_size, tuple(VARIANTS), STEPS)


@pytest.fixture(params=[2, 3], ids=lambda n: f"world{n}")
def results(request):
    return run(request.param)


def steps_of(result, name):
    return result["grads"][name]


def rel_error(grads, exact):
    num = sum(float((g.double() - e).norm() ** 2) for g, e in zip(grads, exact)) ** 0.5
    den = sum(float(e.norm() ** 2) for e in exact) ** 0.5
    return num / den


def test_allreduce_is_the_exact_mean(results):
    for r in results:
        for step, grads in enumerate(steps_of(r, "commtune.AllReduce")):
            for g, e in zip(grads, r["exact"][step]):
                torch.testing.assert_close(g.double(), e, rtol=1e-6, atol=1e-8)


def test_allreduce_equals_torch_hooks_bit_for_bit(results):
    for r in results:
        for ours, theirs, builtin in zip(steps_of(r, "commtune.AllReduce"),
                                         steps_of(r, "torch.allreduce_hook"),
                                         steps_of(r, "torch.builtin_allreduce")):
            for a, b, c in zip(ours, theirs, builtin):
                assert torch.equal(a, b)
                assert torch.equal(a, c)


def test_ranks_end_with_the_same_gradients(results):
    for name in ("commtune.AllReduce", "commtune.Cast(fp16)", "commtune.Cast(bf16)"):
        for r in results[1:]:
            for a_step, b_step in zip(steps_of(results[0], name), steps_of(r, name)):
                for a, b in zip(a_step, b_step):
                    assert torch.equal(a, b), name


@pytest.mark.parametrize("dtype,ours,theirs", [
    (torch.float16, "commtune.Cast(fp16)", "torch.fp16_compress_hook"),
    (torch.bfloat16, "commtune.Cast(bf16)", "torch.bf16_compress_hook"),
])
def test_cast_matches_torch_compress_hooks(results, dtype, ours, theirs):
    eps = torch.finfo(dtype).eps
    for r in results:
        for step, (a_step, b_step) in enumerate(zip(steps_of(r, ours), steps_of(r, theirs))):
            for a, b in zip(a_step, b_step):
                # torch casts then divides, we scale then cast, and the 16-bit sum rounds at
                # each of the world_size - 1 additions: a few roundings of the largest value apart.
                bound = len(results) * eps * float(b.abs().max())
                torch.testing.assert_close(a, b, rtol=2 * eps, atol=bound)
            # and never further from the exact mean than torch's hook is
            exact = r["exact"][step]
            assert rel_error(a_step, exact) <= 1.05 * rel_error(b_step, exact) + 1e-7


def expected_bucket_bytes(sizes, rebuilt, steps):
    """DDP's own bucket sizes: the first iteration's, then the rebuilt ones."""
    n = max(len(sizes), len(rebuilt))
    pad = lambda v: v + [0] * (n - len(v))
    return [a + (steps - 1) * b for a, b in zip(pad(sizes), pad(rebuilt))]


@pytest.mark.parametrize("name,ratio", [
    ("commtune.AllReduce", 1.0), ("commtune.Cast(fp16)", 2.0), ("commtune.Cast(bf16)", 2.0),
])
def test_counters_match_the_model(results, name, ratio):
    for r in results:
        s = r["stats"][name]
        sizes, rebuilt = r["buckets"][name]
        # DDP rebuilds its buckets after iteration 1: here from one bucket to several.
        assert len(sizes) != len(rebuilt) and len(rebuilt) >= 2
        assert s["iterations"] == STEPS
        assert s["calls"] == len(sizes) + (STEPS - 1) * len(rebuilt)
        assert s["bytes_in"] == STEPS * r["param_bytes"]
        assert [b["bytes_in"] for b in s["buckets"]] == expected_bucket_bytes(sizes, rebuilt, STEPS)
        assert s["bytes_out"] * ratio == s["bytes_in"]
        assert s["compression_ratio"] == ratio
        n = len(results)  # one ring allreduce a bucket: 2 (n - 1) / n of what was handed to it
        assert s["wire_bytes"] == pytest.approx(2 * (n - 1) / n * s["bytes_out"], rel=1e-12)
        assert s["wire_ratio"] == pytest.approx(ratio) and s["ranks"] == n
        assert sum(b["calls"] for b in s["buckets"]) == s["calls"]
        assert s["comm_us"] > 0 and s["hook_host_us"] > 0
        assert s["timed_iterations"] == s["iterations"] and s["timed_calls"] == s["calls"]  # host clock: all
        assert 0 <= s["exposed_comm_us"] <= s["comm_us"]
        assert r["state"][name]["iteration"].item() == STEPS
