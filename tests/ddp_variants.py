"""Rank-side code shared by the hook tests: the same training run under several hooks.

Every variant starts each step from the reference model's parameters (plain DDP), so each
step's gradients compare the hooks alone, without drift between the runs.
"""
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from models import BUCKET_CAP_MB, batch, loss_fn, make_model


def build(name, device):
    import commtune as ct

    ids = [torch.cuda.current_device()] if device == "cuda" else None
    kw = dict(device_ids=ids, bucket_cap_mb=BUCKET_CAP_MB)
    commtune_hooks = {
        "commtune.AllReduce": lambda: ct.hooks.AllReduce(),
        "commtune.Cast(fp16)": lambda: ct.hooks.Cast(torch.float16),
        "commtune.Cast(bf16)": lambda: ct.hooks.Cast(torch.bfloat16),
    }
    if name in commtune_hooks:
        return ct.wrap(make_model(device=device), hook=commtune_hooks[name](), **kw)
    ddp = DDP(make_model(device=device), **kw)
    torch_hooks = {
        "torch.allreduce_hook": default_hooks.allreduce_hook,
        "torch.fp16_compress_hook": default_hooks.fp16_compress_hook,
        "torch.bf16_compress_hook": default_hooks.bf16_compress_hook,
    }
    if name in torch_hooks:
        # DDP's own check refuses the bf16 hook without CUDA+NCCL; the hook itself runs on gloo.
        dist._register_comm_hook(ddp.reducer, None, torch_hooks[name])
    elif name == "torch.builtin_allreduce":
        ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    elif name != "ddp":
        raise KeyError(name)
    return ddp


def exact_mean(local_grads):
    """Mean over ranks of each rank's own gradients, in float64."""
    out = []
    for g in local_grads:
        parts = [torch.empty_like(g) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, g)
        out.append(torch.stack([p.double() for p in parts]).mean(0).cpu())
    return out


def _bucket_sizes(ddp):
    data = ddp._get_ddp_logging_data()
    parse = lambda s: [int(v) for v in s.split(",")] if s else []
    return parse(data.get("bucket_sizes", "")), parse(data.get("rebuilt_bucket_sizes", ""))


def lockstep(rank, world_size, variants, steps, device="cpu"):
    import commtune as ct

    if device == "cuda":
        # Same kernels for the local reference and the DDP copies, and full fp32 arithmetic.
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False

    ref = build("ddp", device)
    local = make_model(device=device)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    models = {name: build(name, device) for name in variants}
    grads = {name: [] for name in variants}
    exact = []
    for step in range(steps):
        x, y = batch(rank, step, device)
        local.load_state_dict(ref.module.state_dict())
        local.zero_grad()
        loss_fn(local, x, y).backward()
        exact.append(exact_mean([p.grad for p in local.parameters()]))
        for name, model in models.items():
            model.module.load_state_dict(ref.module.state_dict())
            model.zero_grad()
            loss_fn(model, x, y).backward()
            grads[name].append([p.grad.detach().cpu().clone() for p in model.parameters()])
        opt.zero_grad()
        loss_fn(ref, x, y).backward()
        opt.step()
    result = {"grads": grads, "exact": exact, "stats": {}, "buckets": {}, "state": {}}
    result["param_bytes"] = sum(p.numel() * p.element_size() for p in ref.parameters())
    for name, model in models.items():
        if name.startswith("commtune."):
            result["stats"][name] = ct.stats(model)
            result["buckets"][name] = _bucket_sizes(model)
            result["state"][name] = ct.handle_of(model).state_dict()
    return result
