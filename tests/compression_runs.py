"""Rank-side runs shared by the compressing hooks' tests: one linear layer (a single bucket of
21000 gradients, so the bucket is the flattened weight gradient) trained on each rank's own
batches, with the gradients every rank computed locally gathered beside the hook's result."""
import torch
import torch.distributed as dist

CHUNK = 256
RATIO = 0.05


def make_hook(name):
    import commtune as ct

    return {
        "Quantize": lambda: ct.hooks.Quantize(chunk=CHUNK, min_size=0),
        "Quantize-nearest": lambda: ct.hooks.Quantize(chunk=CHUNK, stochastic=False, min_size=0),
        "Quantize4-nearest": lambda: ct.hooks.Quantize(bits=4, chunk=CHUNK, stochastic=False, min_size=0),
        "QuantizeE4M3-nearest": lambda: ct.hooks.Quantize(format="e4m3", chunk=CHUNK, stochastic=False, min_size=0),
        "SignSGD": lambda: ct.hooks.SignSGD(chunk=CHUNK, min_size=0),
        "TopK": lambda: ct.hooks.TopK(ratio=RATIO, min_size=0),
        "TopK-threshold": lambda: ct.hooks.TopK(ratio=RATIO, min_size=0, selection="threshold"),
        "RandomK": lambda: ct.hooks.RandomK(ratio=RATIO, min_size=0),
        "RandomK-no-feedback": lambda: ct.hooks.RandomK(ratio=RATIO, error_feedback=False, min_size=0),
    }[name]()


def _model(device="cpu"):
    torch.manual_seed(0)
    return torch.nn.Linear(300, 70, bias=False).to(device)


def _step(ddp, local, rank, step):
    x = torch.randn(16, 300, generator=torch.Generator().manual_seed(1000 * step + rank)).to(local.weight.device)
    ddp.zero_grad()
    ddp(x).square().mean().backward()
    local.zero_grad()
    local(x).square().mean().backward()
    parts = [torch.empty_like(local.weight.grad) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local.weight.grad)
    return ddp.module.weight.grad.detach().cpu().view(-1), [p.cpu().view(-1) for p in parts]


def hook_run(rank, world_size, steps, hook_name, device="cpu", overrides=None):
    """Per step: (the hook's gradient, every rank's local gradient); the stats and state_dict.
    `overrides`: fields of the hook's configuration to change (e.g. min_size, error_feedback)."""
    import dataclasses

    import commtune as ct

    hook = dataclasses.replace(make_hook(hook_name), **(overrides or {}))
    ids = [torch.cuda.current_device()] if device == "cuda" else None
    ddp, local = ct.wrap(_model(device), hook=hook, device_ids=ids), _model(device)
    out = [_step(ddp, local, rank, s) for s in range(steps)]
    return {"steps": out, "stats": ct.stats(ddp), "state": ct.handle_of(ddp).state_dict()}


def resume_run(rank, world_size, steps, split, hook_name):
    """Gradients of an uninterrupted run and of one stopped after `split` steps and resumed
    from state_dict in a new DDP."""
    import commtune as ct

    local = _model()
    whole = ct.wrap(_model(), hook=make_hook(hook_name))
    straight = [_step(whole, local, rank, s)[0] for s in range(steps)]
    first = ct.wrap(_model(), hook=make_hook(hook_name))
    for s in range(split):
        _step(first, local, rank, s)
    second = ct.wrap(_model(), hook=make_hook(hook_name))
    ct.handle_of(second).load_state_dict(ct.handle_of(first).state_dict())
    resumed = [_step(second, local, rank, s)[0] for s in range(split, steps)]
    return {"straight": straight[split:], "resumed": resumed}


def assert_steps_stand_alone(results, simulate, **close):
    """Without error feedback each step is the scheme applied to that step's gradients alone:
    `simulate` (steps of every rank's gradients -> the scheme's result per step, with error
    feedback) given one step at a time; no error is kept. Where the error would have been carried,
    the result differs from the simulation with it, so the check can tell the two apart."""
    steps = results[0]["steps"]
    carried = simulate([grads for _, grads in steps])
    for r in results:
        assert not [key for key in r["state"] if key.startswith("error.")]
        for ours, grads in r["steps"]:
            torch.testing.assert_close(ours, simulate([grads])[0], **close)
    assert not torch.equal(steps[-1][0], carried[-1])
