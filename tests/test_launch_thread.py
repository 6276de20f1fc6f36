"""The launch thread: a hook's launches moved off autograd's thread give the same results."""
import pytest
import torch

import distributed
from conftest import cuda_world_size, needs_cuda
from models import BUCKET_CAP_MB, batch, loss_fn, make_model

STEPS = 5


def _with_and_without_thread(rank, world_size, device="cpu"):
    import commtune as ct

    configs = {
        "AllReduce": lambda: ct.hooks.AllReduce(),
        "Cast": lambda: ct.hooks.Cast(torch.bfloat16),
        "PowerSGD": lambda: ct.hooks.PowerSGD(rank=2, start_iter=2),
    }
    ids = [torch.cuda.current_device()] if device == "cuda" else None
    out = {}
    for name, make in configs.items():
        for thread in (False, True):
            # Small buckets: several per iteration, so most are posted to the thread.
            ddp = ct.wrap(make_model(device=device), hook=make(), device_ids=ids, bucket_cap_mb=BUCKET_CAP_MB)
            handle = ct.handle_of(ddp)
            handle.launch_thread = thread
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            for step in range(STEPS):
                opt.zero_grad()
                loss_fn(ddp, *batch(rank, step, device)).backward()
                opt.step()
            s = handle.stats()
            out[name, thread] = {"params": [p.detach().cpu().clone() for p in ddp.parameters()],
                                 "iterations": s["iterations"], "calls": s["calls"],
                                 "on": handle.launch_thread, "hook_iteration": handle.iteration}
            handle.launch_thread = False  # joins the thread between iterations
    return out


def check(results):
    for r in results:
        for name in ("AllReduce", "Cast", "PowerSGD"):
            plain, threaded = r[name, False], r[name, True]
            assert threaded["on"] and not plain["on"]
            assert threaded["iterations"] == plain["iterations"] == STEPS == threaded["hook_iteration"]
            assert threaded["calls"] == plain["calls"] > STEPS  # several buckets per iteration
            for a, b in zip(plain["params"], threaded["params"]):
                assert torch.equal(a, b), name


@pytest.mark.parametrize("world_size", [2, 3])
def test_launch_thread_gives_the_same_training_on_gloo(world_size):
    check(distributed.run(_with_and_without_thread, world_size))


@needs_cuda
@pytest.mark.needs_cuda
def test_launch_thread_gives_the_same_training_on_nccl():
    check(distributed.run(_with_and_without_thread, cuda_world_size(), "cuda", backend="nccl"))
