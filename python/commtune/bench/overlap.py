"""Optimizer overlap on one GPU: WithOptimizer(AllReduce, "adamw") (with and without the launch
thread) against DDP + torch's AdamW (foreach, and fused) on ResNet-50 and a 12-layer, 768-wide
transformer encoder.

Variants run in interleaved repetitions; the optimizer step alone is timed with CUDA events
after a backward. The bar: WithOptimizer shortens the iteration by at least 70% of the
measured step time of torch's default (foreach) AdamW.
"""
import argparse

import torch
import torch.distributed as dist
from torch import nn

from .. import hooks, overlap, registration
from .common import (cuda_time_ms, environment, format_rows, init_gpu_process_group, interleaved, make_ddp, summary,
                     timed_chunk, training_step, write_results)

LR = 1e-3


def model_and_loss(name, batch, device):
    torch.manual_seed(0)
    if name == "resnet50":
        import torchvision

        model = torchvision.models.resnet50().to(device, memory_format=torch.channels_last)
        x = torch.randn(batch, 3, 224, 224, device=device).to(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (batch,), device=device)
        return model, lambda m: nn.functional.cross_entropy(m(x), y)
    layer = nn.TransformerEncoderLayer(768, 12, 3072, batch_first=True)
    model = nn.TransformerEncoder(layer, 12, enable_nested_tensor=False).to(device)
    x = torch.randn(batch, 128, 768, device=device)
    return model, lambda m: m(x).float().square().mean()


def variants(name, batch, device, bucket_mb):
    """{variant: (ddp, optimizer, loss_of)}"""
    out = {}
    for label, fused in (("torch AdamW (foreach)", False), ("torch AdamW (fused)", True)):
        model, loss_of = model_and_loss(name, batch, device)
        ddp = make_ddp(model, hooks.AllReduce(), device, bucket_mb)
        out[f"AllReduce + {label}"] = (ddp, torch.optim.AdamW(ddp.parameters(), lr=LR, fused=fused), loss_of)
    for label, thread in (("WithOptimizer(AllReduce, adamw)", False), ("WithOptimizer, launch thread", True)):
        model, loss_of = model_and_loss(name, batch, device)
        ddp = make_ddp(model, hooks.WithOptimizer(hooks.AllReduce(), "adamw", lr=LR), device, bucket_mb)
        # With the launch thread the updates' host work leaves autograd's thread too.
        registration.handle_of(ddp).launch_thread = thread
        out[label] = (ddp, overlap.OverlappedOptimizer(ddp), loss_of)
    return out


def step_time_ms(ddp, opt, loss_of, iters):
    """The optimizer's step alone, after one backward (CUDA events)."""
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = loss_of(ddp)
    loss.backward()
    return cuda_time_ms(opt.step, iters)


def measure(name, args, device, say):
    built = variants(name, args.batch if name == "resnet50" else args.seq_batch, device, args.bucket_mb)
    runners = {}
    for label, (ddp, opt, loss_of) in built.items():
        run, _ = timed_chunk(training_step(ddp, opt, loss_of), args.iters)
        for _ in range(args.warmup):
            training_step(ddp, opt, loss_of)()
        runners[label] = run
    say(f"{name}: timing {len(runners)} variants x {args.reps} repetitions x {args.iters} iterations")
    times = interleaved(runners, args.reps, progress=say)
    steps = {label: step_time_ms(ddp, opt, loss_of, 20) for label, (ddp, opt, loss_of) in built.items()
             if not isinstance(opt, overlap.OverlappedOptimizer)}
    result = {"ms_per_iteration": {k: summary(v) for k, v in times.items()}, "optimizer_step_ms": steps}
    ours = result["ms_per_iteration"]["WithOptimizer(AllReduce, adamw)"]["median"]
    for label, step_ms in steps.items():
        plain = result["ms_per_iteration"][label]["median"]
        result.setdefault("saved", {})[label.removeprefix("AllReduce + ")] = {
            "saved_ms": plain - ours, "step_ms": step_ms, "fraction_of_step": (plain - ours) / step_ms}
    ddp = built["WithOptimizer(AllReduce, adamw)"][0]
    s = registration.handle_of(ddp).stats()
    result["hook_counters_per_iteration"] = {k: s[k] / max(1, s["iterations"]) for k in ("calls", "hook_host_us")}
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["resnet50", "transformer"], choices=["resnet50", "transformer"])
    p.add_argument("--batch", type=int, default=64, help="ResNet-50 batch")
    p.add_argument("--seq-batch", type=int, default=16, help="transformer batch (x 128 tokens)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--out", default="benchmarks/results/overlap.json")
    args = p.parse_args(argv)
    device = init_gpu_process_group(port=29537)
    say = print if dist.get_rank() == 0 else (lambda *a, **k: None)
    results, rows, bars = {}, [], {}
    for name in args.models:
        r = results[name] = measure(name, args, device, say)
        for label, ms in r["ms_per_iteration"].items():
            rows.append([name, label, f"{ms['median']:.2f}", f"{ms['min']:.2f}-{ms['max']:.2f}"])
        for label, saved in r["saved"].items():
            say(f"{name}: WithOptimizer saves {saved['saved_ms']:.2f} ms per iteration against {label}, whose step "
                f"takes {saved['step_ms']:.2f} ms ({100 * saved['fraction_of_step']:.0f}% of it)")
        bars[f"{name}: saves >= 70% of torch AdamW (foreach) step"] = (
            r["saved"]["torch AdamW (foreach)"]["fraction_of_step"] >= 0.7)
    say(format_rows(["model", "variant", "ms/iter", "range"], rows))
    for bar, ok in bars.items():
        say(f"{'PASS' if ok else 'FAIL'}  {bar}")
    if dist.get_rank() == 0:
        write_results(args.out, {"benchmark": "overlap", "environment": environment(), "args": vars(args),
                                 "results": results, "bars": bars})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
