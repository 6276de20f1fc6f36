"""PowerSGD cost on one GPU: commtune's C++/CUDA hook against torch's powerSGD_hook.

ResNet-50 (batch 128, bf16 autocast, channels_last) and a 12-layer, 768-wide transformer
encoder; ranks 1, 4 and 8; 25 MB and 1 MB buckets. Every variant is built once and timed in
interleaved repetitions; the cost of a hook is its time per iteration minus the no-hook run
with the same buckets, taken per repetition (median and range reported).
"""
import argparse
import functools
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

from .. import hooks, registration
from .common import (environment, format_rows, init_gpu_process_group, interleaved, make_ddp, profile_variants,
                     summary, timed_chunk, training_step, write_results)

START_ITER = 2  # compression runs from the third iteration: every timed iteration compresses


def resnet50(device, batch):
    import torchvision

    model = torchvision.models.resnet50().to(device, memory_format=torch.channels_last)
    x = torch.randn(batch, 3, 224, 224, device=device).to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device=device)
    return model, lambda m: nn.functional.cross_entropy(m(x), y)


def encoder(device, batch, seq=128, width=768, layers=12):
    layer = nn.TransformerEncoderLayer(width, 12, 4 * width, batch_first=True, dropout=0.0)
    model = nn.Sequential(nn.TransformerEncoder(layer, layers, enable_nested_tensor=False), nn.Linear(width, 1000))
    model = model.to(device)
    x = torch.randn(batch, seq, width, device=device)
    y = torch.randint(0, 1000, (batch * seq,), device=device)
    return model, lambda m: nn.functional.cross_entropy(m(x).flatten(0, 1), y)


MODELS = {"resnet50": (resnet50, 128), "encoder": (encoder, 32)}


def torch_powersgd(rank):
    state = functools.partial(torch_psgd.PowerSGDState, process_group=None, matrix_approximation_rank=rank,
                              start_powerSGD_iter=START_ITER, use_error_feedback=True, warm_start=True)
    return (state, torch_psgd.powerSGD_hook)


def variants(ranks, buckets):
    """name -> (hook, bucket MB, launch thread)."""
    out = {}
    for mb in buckets:
        out[f"no hook, {mb:g} MB"] = (None, mb, False)
        for r in ranks:
            out[f"torch powerSGD_hook r{r}, {mb:g} MB"] = (torch_powersgd(r), mb, False)
            out[f"commtune PowerSGD r{r}, {mb:g} MB"] = (hooks.PowerSGD(rank=r, start_iter=START_ITER), mb, False)
            out[f"commtune PowerSGD r{r}, {mb:g} MB, launch thread"] = (
                hooks.PowerSGD(rank=r, start_iter=START_ITER), mb, True)
    return out


def measure(model_name, device, args, say):
    factory, batch = MODELS[model_name]
    runners, stats_of, host, steps = {}, {}, {}, {}
    for name, (hook, mb, thread) in variants(args.ranks, args.buckets).items():
        torch.manual_seed(0)
        model, loss_of = factory(device, args.batch or batch)
        ddp = make_ddp(model, hook, device, mb)
        if thread:
            registration.handle_of(ddp).launch_thread = True
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3, momentum=0.9)

        step = training_step(ddp, opt, loss_of)
        for _ in range(args.warmup):
            step()
        runners[name], host[name] = timed_chunk(step, args.iters)
        steps[name] = step
        if isinstance(hook, hooks.HookConfig):
            registration.handle_of(ddp).reset_stats()
            stats_of[name] = registration.handle_of(ddp)
        say(f"  built and warmed up: {model_name} / {name}")
    times = interleaved(runners, args.reps, progress=say)
    if args.trace_dir and dist.get_rank() == 0:
        profile_variants(steps, os.path.join(args.trace_dir, model_name))
    rows = {}
    for name, values in times.items():
        mb = variants(args.ranks, args.buckets)[name][1]
        base = times[f"no hook, {mb:g} MB"]
        added = [v - b for v, b in zip(values, base)]
        rows[name] = {"ms_per_iteration": summary(values), "added_ms": summary(added),
                      "host_ms_per_iteration": summary(host[name])}
        if name in stats_of:
            s = stats_of[name].stats()
            n = max(1, s["iterations"])
            rows[name]["counters_per_iteration"] = {
                k: s[k] / n for k in ("calls", "bytes_in", "bytes_out", "hook_host_us", "comm_us")}
            rows[name]["compression_ratio"] = s["compression_ratio"]
    return rows


def bars(rows, ranks, buckets):
    out = {}
    for mb in buckets:
        for r in ranks:
            theirs = rows[f"torch powerSGD_hook r{r}, {mb:g} MB"]["added_ms"]["median"]
            for suffix in ("", ", launch thread"):
                ours = rows[f"commtune PowerSGD r{r}, {mb:g} MB{suffix}"]["added_ms"]["median"]
                ratio = theirs / ours if ours > 0 else float("inf")
                out[f"r{r}, {mb:g} MB{suffix}: torch adds {theirs:.2f} ms, commtune {ours:.2f} ms "
                    f"(x{ratio:.1f} less) >= 20x"] = ratio >= 20
    if 4 in ranks and 25 in buckets:
        for suffix in ("", ", launch thread"):
            ours = rows[f"commtune PowerSGD r4, 25 MB{suffix}"]["added_ms"]["median"]
            out[f"r4, 25 MB{suffix}: commtune adds {ours:.2f} ms <= 1.0 ms"] = ours <= 1.0
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--ranks", nargs="+", type=int, default=[1, 4, 8])
    p.add_argument("--buckets", nargs="+", type=float, default=[25.0, 1.0], help="bucket_cap_mb values")
    p.add_argument("--batch", type=int, default=None, help="batch size (default: 128 ResNet-50, 32 encoder)")
    p.add_argument("--reps", type=int, default=5, help="interleaved repetitions (default 5)")
    p.add_argument("--iters", type=int, default=12, help="timed iterations per repetition")
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--out", default="benchmarks/results/powersgd.json")
    p.add_argument("--trace-dir", default=None,
                   help="also profile 5 iterations of each variant; tables of CUDA and host time in DIR/MODEL/kernels.txt")
    args = p.parse_args(argv)
    device = init_gpu_process_group(port=29534)
    rank = dist.get_rank()
    say = print if rank == 0 else (lambda *a, **k: None)
    results, all_bars = {}, {}
    for model_name in args.models:
        say(f"{model_name}: {len(variants(args.ranks, args.buckets))} variants x {args.reps} repetitions "
            f"x {args.iters} iterations, {dist.get_world_size()} rank(s)")
        results[model_name] = measure(model_name, device, args, say)
        table = []
        for name, r in results[model_name].items():
            ms, added = r["ms_per_iteration"], r["added_ms"]
            table.append([name, f"{ms['median']:.2f}", f"{added['median']:+.2f}",
                          f"{added['min']:+.2f}..{added['max']:+.2f}", f"{r['host_ms_per_iteration']['median']:.2f}",
                          f"{r.get('compression_ratio', float('nan')):.1f}"])
        say(f"== {model_name}")
        say(format_rows(["variant", "ms/iter", "added ms", "added range", "host ms/iter", "compression"], table))
        for bar, ok in bars(results[model_name], args.ranks, args.buckets).items():
            all_bars[f"{model_name} {bar}"] = ok
            say(f"{'PASS' if ok else 'FAIL'}  {model_name} {bar}")
    if rank == 0:
        write_results(args.out, {"benchmark": "powersgd", "environment": environment(), "args": vars(args),
                                 "world_size": dist.get_world_size(), "results": results, "bars": all_bars})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
