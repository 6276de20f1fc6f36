"""TopK and RandomK end to end on 2 and 3 gloo ranks: TopK against a plain-PyTorch simulation
with error feedback (bit for bit), RandomK against the ranks' mean at the positions it sent."""
import functools
import math

import pytest
import torch

import compression_runs
import distributed
from test_random_k import strata_starts

RATIO, NUMEL, STEPS = compression_runs.RATIO, 300 * 70, 4
K = math.ceil(RATIO * NUMEL)


@functools.lru_cache(maxsize=None)
def run(world_size, hook):
    return distributed.run(compression_runs.hook_run, world_size, STEPS, hook)


def exact_top_k(x):
    """TopK's exact selection: (values sent, their indices, the entries taken out of x)."""
    idx = x.abs().topk(K, sorted=False).indices
    return x[idx], idx, idx


def simulate_topk(steps_locals, world, select=exact_top_k):
    errors = [torch.zeros(NUMEL) for _ in range(world)]
    out = []
    for grads in steps_locals:
        total = torch.zeros(NUMEL)
        for r in range(world):
            x = errors[r] + grads[r]
            values, indices, taken = select(x)
            total.index_add_(0, indices, values)
            errors[r] = x.index_fill(0, taken, 0)
        out.append(total / world)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_topk_equals_the_simulated_scheme(world_size):
    results = run(world_size, "TopK")
    expected = simulate_topk([grads for _, grads in results[0]["steps"]], world_size)
    for r in results:
        for (ours, _), theirs in zip(r["steps"], expected):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
            assert int((ours != 0).sum()) <= world_size * K


def test_topk_without_error_feedback_each_step_stands_alone():
    results = distributed.run(compression_runs.hook_run, 2, 3, "TopK", "cpu", {"error_feedback": False})
    compression_runs.assert_steps_stand_alone(results, lambda steps: simulate_topk(steps, 2), rtol=0, atol=0)


def assert_one_sent_per_stratum(sent):
    """RandomK's draw: exactly one entry of each of the K strata (kernels/random_k_draw.h)."""
    positions = sent.nonzero().flatten()
    starts = strata_starts(NUMEL, K)
    assert positions.numel() == K
    assert torch.equal(torch.bucketize(positions, starts, right=True) - 1, torch.arange(K))


@pytest.mark.parametrize("world_size", [2, 3])
def test_randomk_sends_the_mean_at_shared_positions(world_size):
    results = run(world_size, "RandomK-no-feedback")
    for step, (ours, grads) in enumerate(results[0]["steps"]):
        sent = ours != 0
        assert_one_sent_per_stratum(sent)
        torch.testing.assert_close(ours[sent], torch.stack(grads).mean(0)[sent], rtol=1e-6, atol=1e-9)
        for r in results[1:]:
            assert torch.equal(r["steps"][step][0], ours)
    first, second = results[0]["steps"][0][0] != 0, results[0]["steps"][1][0] != 0
    assert not torch.equal(first, second)  # new positions every iteration


@pytest.mark.parametrize("world_size", [2, 3])
def test_randomk_with_error_feedback_equals_the_simulated_scheme(world_size):
    # The positions are the hook's (where its result is not zero: the same on every rank, as the
    # test above checks); the rest is simulated: each rank sends its error plus gradient there,
    # the mean lands there, and what was sent leaves the error buffer.
    results = run(world_size, "RandomK")
    errors = [torch.zeros(NUMEL) for _ in range(world_size)]
    for ours, grads in results[0]["steps"]:
        taken = ours != 0
        sent = [errors[r] + grads[r] for r in range(world_size)]
        expected = torch.zeros(NUMEL)
        expected[taken] = torch.stack([s[taken] for s in sent]).mean(0)
        torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-9)
        for r in range(world_size):
            errors[r] = torch.where(taken, 0.0, sent[r])
    assert not torch.equal(errors[0], torch.zeros(NUMEL))  # the error carried something


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("hook", ["TopK", "RandomK"])
def test_counters_count_what_is_sent(world_size, hook):
    stats = run(world_size, hook)[0]["stats"]
    assert stats["calls"] == STEPS and stats["bytes_in"] == STEPS * NUMEL * 4
    # TopK all-gathers k values and k indices (to each of the n - 1 others); RandomK allreduces
    # k values (a ring: 2 (n - 1) / n of them).
    if hook == "TopK":
        handed, sent = 8 * K, (world_size - 1) * 8 * K
    else:
        handed, sent = 4 * K, 2 * (world_size - 1) / world_size * 4 * K
    assert stats["bytes_out"] == STEPS * handed
    assert stats["wire_bytes"] == pytest.approx(STEPS * sent, rel=1e-12)
    assert stats["wire_ratio"] == pytest.approx(2 * (world_size - 1) / world_size * NUMEL * 4 / sent)


@pytest.mark.parametrize("hook", ["TopK", "RandomK"])
def test_state_dict_carries_the_error_and_resumes_bit_for_bit(hook):
    for r in distributed.run(compression_runs.resume_run, 2, 5, 3, hook):
        for a, b in zip(r["straight"], r["resumed"]):
            assert torch.equal(a, b)
    state = run(2, hook)[0]["state"]
    assert set(state) == {"iteration", "error.0"} and int((state["error.0"] != 0).sum()) > NUMEL // 2


def test_bad_values_are_refused():
    import commtune as ct

    for config in (ct.hooks.TopK, ct.hooks.RandomK):
        for kw, word in [({"ratio": 0}, "ratio"), ({"ratio": 1.5}, "ratio"), ({"ratio": True}, "ratio"),
                         ({"error_feedback": "yes"}, "error_feedback"), ({"min_size": -1}, "min_size"),
                         ({"min_size": 2**63}, "min_size")]:
            with pytest.raises(ValueError, match=word):
                config(**kw).validate()
    for seed in (-2, 2**63):
        with pytest.raises(ValueError, match="seed"):
            ct.hooks.RandomK(seed=seed).validate()
