"""Large, NaN and Inf gradients; timeouts; counters reset; hook state round trip."""
import pytest
import torch
from torch import nn

import distributed


def _extreme_gradients(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    import commtune as ct

    def grads(ddp, x):
        ddp.zero_grad()
        ddp(x).sum().backward()
        return ddp.module.weight.grad.clone()

    def linear():
        torch.manual_seed(0)
        return nn.Linear(4, 3, bias=False)

    out = {}
    # |grad| = 8e4 on rank 0, over fp16's 65504 unless scaled before the cast; the mean fits.
    big = torch.full((2, 4), 4e4 if rank == 0 else 1.0)
    ours = ct.wrap(linear(), hook=ct.hooks.Cast(torch.float16))
    theirs = DDP(linear())
    theirs.register_comm_hook(None, default_hooks.fp16_compress_hook)
    out["big_ours"], out["big_theirs"] = grads(ours, big), grads(theirs, big)
    local = big.sum(0, keepdim=True).expand(3, 4)
    parts = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(parts, local.contiguous())
    out["big_exact"] = torch.stack(parts).double().mean(0)

    # NaN on one rank, Inf on another: every rank must see them, as with torch's hook.
    bad = torch.ones(2, 4)
    bad[0, 1] = float("nan") if rank == 0 else 1.0
    bad[1, 2] = float("inf") if rank == world_size - 1 else 1.0
    for name, hook in (("allreduce", ct.hooks.AllReduce()), ("bf16", ct.hooks.Cast(torch.bfloat16))):
        out[f"bad_{name}"] = grads(ct.wrap(linear(), hook=hook), bad)
    reference = DDP(linear())
    reference.register_comm_hook(None, default_hooks.allreduce_hook)
    out["bad_torch"] = grads(reference, bad)
    return out


def test_fp16_does_not_overflow_on_large_gradients():
    for r in distributed.run(_extreme_gradients, 2):
        assert torch.isinf(r["big_theirs"]).any(), "torch's fp16 hook overflows here"
        assert torch.isfinite(r["big_ours"]).all()
        torch.testing.assert_close(r["big_ours"].double(), r["big_exact"], rtol=2e-3, atol=0)


def test_nan_and_inf_reach_every_rank():
    for r in distributed.run(_extreme_gradients, 3):
        ref = r["bad_torch"]
        assert torch.isnan(ref).any() and torch.isinf(ref).any()
        for name in ("bad_allreduce", "bad_bf16"):
            assert torch.equal(torch.isnan(r[name]), torch.isnan(ref)), name
            assert torch.equal(torch.isinf(r[name]), torch.isinf(ref)), name


OVERFLOWING = {
    "quantize_int8": lambda ct: ct.hooks.Quantize(chunk=64, min_size=0),
    "quantize_int4": lambda ct: ct.hooks.Quantize(bits=4, chunk=64, min_size=0),
    "quantize_e4m3": lambda ct: ct.hooks.Quantize(format="e4m3", chunk=64, min_size=0),
    "signsgd": lambda ct: ct.hooks.SignSGD(chunk=64, min_size=0),
    "topk": lambda ct: ct.hooks.TopK(ratio=0.25, min_size=0),
    "topk_threshold": lambda ct: ct.hooks.TopK(ratio=0.25, min_size=0, selection="threshold"),
    # a NaN never qualifies for the threshold: the first value sent carries it
    "topk_threshold_nan": lambda ct: ct.hooks.TopK(ratio=0.25, min_size=0, selection="threshold"),
    "randomk": lambda ct: ct.hooks.RandomK(ratio=0.25, min_size=0),
    # draws 1 of the 1024 entries, not the overflowing one: the overflow must still show
    "randomk_sparse": lambda ct: ct.hooks.RandomK(ratio=0.001, min_size=0, seed=1),
    # compresses from iteration 2 on: the overflow comes at step 3 (below)
    "powersgd": lambda ct: ct.hooks.PowerSGD(rank=2, start_iter=2, min_compression_rate=0.5),
}


def _overflow_then_finite(rank, world_size, hook):
    """One step where one entry of rank 0's gradient is Inf (NaN for the hooks named *_nan), then
    two finite steps, through a compressing hook with error feedback, as a loss scaler's overflow
    would go."""
    import commtune as ct

    torch.manual_seed(0)
    ddp = ct.wrap(nn.Linear(32, 32, bias=False), hook=OVERFLOWING[hook](ct))
    overflow = 3 if hook == "powersgd" else 0
    poisoned = {"now": False}

    def poison(grad):  # before DDP takes the gradient into its bucket
        if not poisoned["now"]:
            return grad
        grad = grad.clone()
        grad[3, 7] = float("nan") if hook.endswith("_nan") else float("inf")
        return grad

    ddp.module.weight.register_hook(poison)
    out = {"after": []}
    for step in range(overflow + 3):
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(10 * step + rank))
        poisoned["now"] = step == overflow and rank == 0
        ddp.zero_grad()
        ddp(x).pow(2).sum().backward()
        grad = ddp.module.weight.grad.clone()
        if step == overflow:
            out["overflow"] = grad
            # error feedback, and PowerSGD's warm-started Q
            out["error"] = [e for k, e in ct.handle_of(ddp).state_dict().items() if k.startswith(("error.", "q_memory."))]
        elif step > overflow:
            out["after"].append(grad)
    return out


@pytest.mark.parametrize("hook", sorted(OVERFLOWING))
def test_an_overflow_reaches_every_rank_and_the_error_feedback_stays_finite(hook):
    for r in distributed.run(_overflow_then_finite, 2, hook):
        assert not torch.isfinite(r["overflow"]).all(), "the overflow did not reach this rank"
        assert r["error"] and all(torch.isfinite(e).all() for e in r["error"]), "the error feedback kept the overflow"
        for grad in r["after"]:
            assert torch.isfinite(grad).all() and grad.abs().max() > 0


def _one_rank_stalls(rank, world_size):
    import time

    import commtune as ct

    ddp = ct.wrap(nn.Linear(4, 4), hook=ct.hooks.AllReduce())
    if rank == 1:
        time.sleep(8)  # never joins the allreduce; outlives rank 0's 3 s timeout
        return "stalled"
    started = time.monotonic()
    try:
        ddp(torch.ones(2, 4)).sum().backward()
    except RuntimeError as e:
        return {"error": str(e), "seconds": time.monotonic() - started}
    return {"error": None}


def test_a_missing_rank_surfaces_as_an_error_not_a_hang():
    r0, r1 = distributed.run(_one_rank_stalls, 2, pg_timeout_s=3, timeout_s=120)
    assert r1 == "stalled"
    assert r0["error"] is not None, "backward returned although rank 1 never communicated"
    assert "timed out" in r0["error"].lower() or "timeout" in r0["error"].lower(), r0["error"]


RESUMABLE = {
    "cast": lambda ct: ct.hooks.Cast(torch.bfloat16),
    # error feedback, warm-started Q and the seed generator all live in the hook's state
    "powersgd": lambda ct: ct.hooks.PowerSGD(rank=2, start_iter=2, seed=3),
    "powersgd_batched": lambda ct: ct.hooks.PowerSGD(rank=1, start_iter=2, batch_same_shape=True),
}
# Not here: PowerSGD with warm_start=False. It draws a fresh Q every iteration in bucket order,
# as torch does, and a new DDP's first iteration has another bucket order, so a resumed run
# continues with other random draws (equally valid, not bit-for-bit).


def _resume(rank, world_size, steps, split, hook, device="cpu"):
    """Trains `steps` iterations straight, and again with a checkpoint of the hook after `split`."""
    import commtune as ct
    from models import batch, loss_fn, make_model

    def train(ddp, opt, begin, end):
        for step in range(begin, end):
            opt.zero_grad()
            loss_fn(ddp, *batch(rank, step, device)).backward()
            opt.step()

    def fresh():
        ddp = ct.wrap(make_model(device=device), hook=RESUMABLE[hook](ct),
                      device_ids=[rank] if device == "cuda" else None)
        return ddp, torch.optim.SGD(ddp.parameters(), lr=0.1)

    straight, opt = fresh()
    train(straight, opt, 0, steps)
    first, opt = fresh()
    train(first, opt, 0, split)
    hook_state = ct.handle_of(first).state_dict()
    model_state, opt_state = first.module.state_dict(), opt.state_dict()
    resumed, opt = fresh()
    resumed.module.load_state_dict(model_state)
    opt.load_state_dict(opt_state)
    ct.handle_of(resumed).load_state_dict(hook_state)
    train(resumed, opt, split, steps)
    resumed_params = [p.detach().clone() for p in resumed.parameters()]

    handle = ct.handle_of(resumed)
    before_reset = handle.stats()
    handle.reset_stats()
    after_reset = handle.stats()
    train(resumed, opt, steps, steps + 1)
    return {
        "straight": [p.detach().clone() for p in straight.parameters()],
        "resumed": resumed_params,
        "iteration": (ct.handle_of(straight).iteration, handle.iteration),
        "stats": (before_reset, after_reset, handle.stats()),
    }


@pytest.mark.parametrize("hook", sorted(RESUMABLE))
def test_resume_from_hook_state_and_reset_stats(hook):
    steps, split = 6, 3
    for r in distributed.run(_resume, 2, steps, split, hook):
        for a, b in zip(r["straight"], r["resumed"]):
            if hook == "cast":
                assert torch.equal(a, b)
            else:
                # Same state, but the new DDP's first buckets sit at other offsets, and BLAS
                # may sum a matrix product in another order at another alignment.
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert r["iteration"] == (steps, steps + 1)  # the resumed hook counts on from its checkpoint
        before, after, later = r["stats"]
        assert before["iterations"] == steps - split
        assert after["iterations"] == 0 and after["calls"] == 0 and after["buckets"] == []
        assert later["iterations"] == 1 and later["bytes_in"] == before["bytes_in"] // (steps - split)


def _resume_with_another_rank(rank, world_size):
    import warnings

    import commtune as ct
    from models import batch, loss_fn, make_model

    def trained(approximation_rank, state=None, steps=3):
        torch.manual_seed(0)
        ddp = ct.wrap(make_model(), hook=ct.hooks.PowerSGD(rank=approximation_rank, start_iter=2))
        if state is not None:
            ct.handle_of(ddp).load_state_dict(state)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(steps):
                ddp.zero_grad()
                loss_fn(ddp, *batch(rank, step)).backward()
        return ct.handle_of(ddp).state_dict(), [str(w.message) for w in caught], ddp

    saved, _, _ = trained(2)
    state, messages, ddp = trained(4, saved, steps=1)
    # (a matrix compressed at rank 2 may not be worth it at rank 4, and then has no Q)
    q_sizes = {k: (saved[k].numel(), state[k].numel()) for k in saved if k.startswith("q_memory.") and k in state}
    return {"messages": messages, "q_sizes": q_sizes,
            "finite": all(bool(torch.isfinite(p.grad).all()) for p in ddp.parameters())}


def test_powersgd_resumed_with_another_rank_warns_and_starts_q_afresh():
    for r in distributed.run(_resume_with_another_rank, 2):
        warned = [m for m in r["messages"] if "was it saved with another rank" in m]
        assert warned, r["messages"]
        assert "this hook's (rank 4)" in warned[0] and "fresh Q" in warned[0]
        assert r["q_sizes"] and all(new == 2 * old for old, new in r["q_sizes"].values())
        assert r["finite"]


# Hooks whose state_dict holds per-parameter entries (error feedback, Q memory, optimizer state).
STATEFUL = {
    "quantize": lambda ct: ct.hooks.Quantize(min_size=0),
    "signsgd": lambda ct: ct.hooks.SignSGD(min_size=0),
    "topk": lambda ct: ct.hooks.TopK(ratio=0.1, min_size=0),
    "randomk": lambda ct: ct.hooks.RandomK(ratio=0.1, min_size=0),
    "powersgd": lambda ct: ct.hooks.PowerSGD(rank=2, start_iter=2),
    "with_optimizer": lambda ct: ct.hooks.WithOptimizer(ct.hooks.AllReduce(), "sgd", lr=0.1, momentum=0.9),
}


def _load_from_other_models(rank, world_size, hook):
    import commtune as ct

    def trained(widths):
        torch.manual_seed(0)
        layers = [nn.Linear(a, b) for a, b in zip(widths, widths[1:])]
        ddp = ct.wrap(nn.Sequential(*layers), hook=STATEFUL[hook](ct))
        for _ in range(3):
            ddp.zero_grad()
            ddp(torch.randn(4, widths[0])).sum().backward()
        return ct.handle_of(ddp)

    target = trained([64, 300, 10])
    before = target.state_dict()
    out = {"entries": sorted(before)}
    for name, widths in (("narrower", [32, 300, 10]), ("deeper", [64, 300, 10, 10])):
        try:
            target.load_state_dict(trained(widths).state_dict())
            out[name] = "accepted"
        except RuntimeError as e:
            out[name] = str(e)
    after = target.state_dict()
    out["unchanged"] = sorted(after) == sorted(before) and all(torch.equal(after[k], before[k]) for k in before)
    return out


@pytest.mark.parametrize("hook", sorted(STATEFUL))
def test_a_state_dict_from_another_model_is_refused_and_changes_nothing(hook):
    # Before, Quantize, SignSGD, TopK and RandomK dropped an error buffer of another size
    # silently, and PowerSGD failed at its next bucket with ATen's size mismatch.
    for r in distributed.run(_load_from_other_models, 2, hook):
        assert any(k.split(".")[0] in ("error", "q_memory", "optim") for k in r["entries"])
        # the first layer's weight: 300 x 32 saved, 300 x 64 here
        assert "holds 9600 values, but parameter 0 of this model [300, 64] has 19200" in r["narrower"]
        assert "saved from another model" in r["narrower"]
        # a third layer: entries of parameters 4 and 5, which this model does not have
        assert "belongs to parameter 4, but this model has 4 parameters" in r["deeper"]
        assert r["unchanged"]
