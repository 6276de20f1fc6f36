"""PowerSGD against torch's powerSGD_hook, end to end through DDP on several gloo ranks."""
from contextlib import nullcontext
from unittest import mock

import numpy as np
import pytest
import torch
from torch import nn

import commtune as ct
import distributed
from commtune import _C

STEPS = 7  # spans the plain-allreduce phase, start_iter, DDP's bucket rebuild and warm starts


class PowerNet(nn.Module):
    """Conv, linear, same-shape linear pair, 1-D and tiny tensors."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc1 = nn.Linear(8 * 8 * 8, 64)
        self.same_a = nn.Linear(64, 64)
        self.same_b = nn.Linear(64, 64)
        self.out = nn.Linear(64, 10)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        x = torch.relu(self.fc1(torch.relu(self.conv(x)).flatten(1)))
        return self.out(torch.relu(self.same_b(torch.relu(self.same_a(x))))) * self.scale


def _train(rank, world_size, which, settings, steps=STEPS, bucket_cap_mb=25, device="cpu", dtype=torch.float32):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    from models import batch

    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.deterministic = True
    torch.manual_seed(0)
    model = PowerNet().to(device, dtype)
    kw = dict(bucket_cap_mb=bucket_cap_mb, device_ids=[rank] if device == "cuda" else None)
    if which == "commtune":
        ddp = ct.wrap(model, hook=ct.hooks.PowerSGD(**settings), **kw)
    else:
        ddp = DDP(model, **kw)
        state = torch_psgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=settings["rank"],
            start_powerSGD_iter=settings["start_iter"], use_error_feedback=settings["error_feedback"],
            warm_start=settings["warm_start"], random_seed=settings.get("seed", 0),
            orthogonalization_epsilon=settings.get("orthogonalization_epsilon", 0.0),
            batch_tensors_with_same_shape=settings.get("batch_same_shape", False))
        ddp.register_comm_hook(state, torch_psgd.powerSGD_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    # torch's hook calls torch.cuda.synchronize(bucket device) whenever CUDA exists, which
    # fails for CPU buckets on a GPU machine: hide CUDA from it there.
    cpu_on_gpu_machine = device == "cpu" and torch.cuda.is_available()
    with mock.patch.object(torch.cuda, "is_available", return_value=False) if cpu_on_gpu_machine else nullcontext():
        for step in range(steps):
            x, y = batch(rank, step, device)
            x = x.to(dtype)
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
    out = {"params": [p.detach().cpu().clone() for p in ddp.parameters()]}
    if which == "commtune":
        out["stats"] = ct.stats(ddp)
    return out


def _both(rank, world_size, settings, device="cpu", dtype=torch.float32):
    # One bucket per iteration: torch's hook issues its P and Q allreduces from gloo callback
    # threads, so with several buckets its collectives can interleave differently per rank.
    return {w: _train(rank, world_size, w, settings, device=device, dtype=dtype) for w in ("commtune", "torch")}


SETTINGS = {
    "rank1": dict(rank=1, start_iter=2, error_feedback=True, warm_start=True),
    "rank4": dict(rank=4, start_iter=3, error_feedback=True, warm_start=True, seed=7),
    "no_ef_no_warm": dict(rank=2, start_iter=1, error_feedback=False, warm_start=False),
    "batched": dict(rank=2, start_iter=2, error_feedback=True, warm_start=True, batch_same_shape=True),
}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_parameters_match_torch_powersgd(world_size, name):
    for r in distributed.run(_both, world_size, SETTINGS[name]):
        ours, theirs = r["commtune"]["params"], r["torch"]["params"]
        for a, b in zip(ours, theirs):
            # rank > 2: torch orthogonalizes by QR, we by Gram-Schmidt; same spans, rounding apart
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        s = r["commtune"]["stats"]
        assert s["iterations"] == STEPS
        assert s["bytes_out"] < s["bytes_in"]  # compressed iterations sent less


def _several_buckets(rank, world_size):
    return _train(rank, world_size, "commtune", SETTINGS["rank1"], bucket_cap_mb=0.05)


def test_several_buckets_and_the_rebuild():
    results = distributed.run(_several_buckets, 3)
    for r in results[1:]:
        for a, b in zip(results[0]["params"], r["params"]):
            assert torch.equal(a, b)  # every rank applied the same decompressed gradients
    s = results[0]["stats"]
    assert all(torch.isfinite(p).all() for p in results[0]["params"])
    assert len(s["buckets"]) >= 2 and s["iterations"] == STEPS
    assert s["bytes_out"] < s["bytes_in"]


def _approximation_error(rank, world_size):
    from models import batch

    torch.manual_seed(0)
    ddp = ct.wrap(PowerNet(), hook=ct.hooks.PowerSGD(rank=1, start_iter=2, approx_error_every=1))
    handle = ct.handle_of(ddp)
    seen = []
    for step in range(4):
        ddp.zero_grad()
        nn.functional.cross_entropy(ddp(*batch(rank, step)[:1]), batch(rank, step)[1]).backward()
        state = handle.state_dict()
        params = list(ddp.parameters())
        compressed = [int(k.split(".")[1]) for k in state if k.startswith("q_memory.")]
        # the hook's input was result + new error (error feedback), for every compressed matrix
        err = sum(float(state[f"error.{i}"].double().square().sum()) for i in compressed)
        inp = sum(float((params[i].grad.reshape(-1) + state[f"error.{i}"]).double().square().sum())
                  for i in compressed)
        s = handle.stats()
        seen.append((s["approximation_error"], s["approximation_error_iteration"],
                     (err / inp) ** 0.5 if compressed else None))
    return seen


def test_approximation_error_is_the_error_feedback_residual():
    for seen in distributed.run(_approximation_error, 2):
        assert np.isnan(seen[0][0]) and np.isnan(seen[1][0])  # plain allreduce: nothing sampled
        for step in (2, 3):
            value, at, expected = seen[step]
            assert at == step
            assert value > 0  # may exceed 1: PQ^T approximates the mean over ranks, M is local
            assert value == pytest.approx(expected, rel=1e-6)


def test_seeds_follow_numpy_legacy_random_state():
    for seed in (0, 1, 2**32 - 1):
        rs = np.random.RandomState(seed)
        assert _C.powersgd_torch_seeds(seed, 20) == [rs.randint(1_000_000_000) for _ in range(20)]


@pytest.mark.parametrize("bad,match", [
    (dict(rank=0), "rank must be an integer >= 1"),
    (dict(rank=1.5), "rank must be an integer >= 1"),
    (dict(start_iter=1), "start_iter must be > 1 when error_feedback or warm_start"),
    (dict(start_iter=-1, error_feedback=False, warm_start=False), "start_iter must be an integer >= 0"),
    (dict(min_compression_rate=0), "min_compression_rate must be a number > 0"),
    (dict(orthogonalization_epsilon=-1e-8), "orthogonalization_epsilon must be a number >= 0"),
    (dict(seed=2**32), r"seed must be an integer in \[0, 2\*\*32\)"),
    (dict(warm_start="yes"), "warm_start must be True or False"),
    (dict(approx_error_every=-1), "approx_error_every must be an integer >= 0"),
])
def test_bad_settings_are_refused_before_ddp(bad, match):
    with pytest.raises(ValueError, match=match):
        ct.wrap(nn.Linear(2, 2), hook=ct.hooks.PowerSGD(**bad))
