"""Every refusal of register/wrap, with its message, before anything is registered."""
import pytest
import torch
from torch import nn

import commtune as ct
import distributed
from models import make_model


def test_register_refuses_a_module_that_is_not_ddp():
    with pytest.raises(TypeError, match="expects a torch.nn.parallel.DistributedDataParallel"):
        ct.register(nn.Linear(2, 2), ct.hooks.AllReduce())


def test_wrap_refuses_a_ddp_module():
    ddp = object.__new__(nn.parallel.DistributedDataParallel)  # no process group needed to be refused
    with pytest.raises(TypeError, match="expects the bare model"):
        ct.wrap(ddp, hook=ct.hooks.AllReduce())


@pytest.mark.parametrize("hook", [None, "bf16", lambda state, bucket: None])
def test_hook_must_be_a_commtune_config(hook):
    with pytest.raises(TypeError, match="hook must be a commtune.hooks config"):
        ct.wrap(nn.Linear(2, 2), hook=hook)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int8, "bf16"])
def test_cast_refuses_other_dtypes_before_ddp_is_built(dtype):
    # No process group exists here: the ValueError must come before DDP's constructor.
    with pytest.raises(ValueError, match=r"Cast: dtype must be torch.float16 or torch.bfloat16"):
        ct.wrap(nn.Linear(2, 2), hook=ct.hooks.Cast(dtype))


def test_stats_of_a_module_without_commtune_hook():
    with pytest.raises(ValueError, match="has no commtune hook"):
        ct.stats(nn.Linear(2, 2))


def _refusals_on_ranks(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    seen = {}
    ddp = ct.wrap(make_model(), hook=ct.hooks.AllReduce())
    try:
        ct.register(ddp, ct.hooks.Cast(torch.float16))
    except RuntimeError as e:
        seen["second commtune hook"] = str(e)
    torch_hooked = DDP(make_model())
    torch_hooked.register_comm_hook(None, default_hooks.allreduce_hook)
    try:
        ct.register(torch_hooked, ct.hooks.AllReduce())
    except RuntimeError as e:
        seen["after a torch hook"] = str(e)
    try:
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    except RuntimeError as e:
        seen["torch hook after commtune"] = str(e)

    handle = ct.handle_of(ddp)
    for bad in ({}, {"iteration": torch.zeros(2)}):
        try:
            handle.load_state_dict(bad)
        except RuntimeError as e:
            seen[f"state {sorted(bad)}"] = str(e)

    sparse = ct.wrap(nn.Embedding(10, 4, sparse=True), hook=ct.hooks.AllReduce())
    try:
        sparse(torch.tensor([1, 2, 3])).sum().backward()
    except RuntimeError as e:
        seen["sparse"] = str(e)
    dist.barrier()
    return seen


def test_refusals_on_a_real_process_group():
    for seen in distributed.run(_refusals_on_ranks, 2):
        assert "already has a communication hook (commtune.AllReduce)" in seen["second commtune hook"]
        assert "already has a communication hook" in seen["after a torch hook"]
        assert "can only be called once" in seen["torch hook after commtune"]
        assert "no 'iteration' entry" in seen["state []"]
        assert "must hold one number" in seen["state ['iteration']"]
        assert "sparse gradients are not supported" in seen["sparse"]


def test_unsupported_backend():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        ddp = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
        with pytest.raises(ValueError, match="support the gloo and nccl backends.*uses fake"):
            ct.register(ddp, ct.hooks.AllReduce())
        assert not hasattr(ddp, "_commtune_handle")
    finally:
        dist.destroy_process_group()
