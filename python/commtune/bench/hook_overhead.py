"""Hook overhead on ResNet-50: commtune's hooks against no hook and torch's own hooks.

One process per GPU (torchrun), or one GPU in this process. Variants are timed in interleaved
repetitions; each row reports the median ms/iteration and the median of per-repetition
ratios to the no-hook run. The cast kernel is also timed alone on a 100 MB bucket against a
device-to-device copy of the same bytes.
"""
import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from .. import _C, hooks, registration
from .common import (cuda_time_ms, environment, format_rows, init_gpu_process_group, interleaved, make_ddp,
                     paired_ratios, profile_variants, summary, timed_chunk, training_step, write_results)

VARIANTS = {
    "no hook": None,
    "torch builtin ALLREDUCE": "builtin",
    "torch allreduce_hook": default_hooks.allreduce_hook,
    "torch bf16_compress_hook": default_hooks.bf16_compress_hook,
    "commtune AllReduce": hooks.AllReduce(),
    "commtune AllReduce (timing off)": hooks.AllReduce(),
    "commtune Cast(bf16)": hooks.Cast(torch.bfloat16),
    "commtune AllReduce (launch thread)": hooks.AllReduce(),
    "commtune Cast(bf16) (launch thread)": hooks.Cast(torch.bfloat16),
}
BASELINE = "no hook"
PAIRS = {"commtune AllReduce": "torch allreduce_hook", "commtune Cast(bf16)": "torch bf16_compress_hook",
         "commtune AllReduce (launch thread)": "torch allreduce_hook",
         "commtune Cast(bf16) (launch thread)": "torch bf16_compress_hook"}


def build(hook, device, bucket_mb):
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet50().to(device, memory_format=torch.channels_last)
    ddp = make_ddp(model, hook, device, bucket_mb)
    return ddp, torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)


def cast_kernel_bandwidth(device, mbytes=100, iters=50):
    n = mbytes * 1024 * 1024 // 4
    srcs = [torch.randn(n, device=device) for _ in range(3)]
    out16 = torch.empty(n, device=device, dtype=torch.bfloat16)
    out32 = torch.empty(n, device=device)
    k = iter(range(10**9))
    pick = lambda: srcs[next(k) % len(srcs)]
    rows = {}
    for name, dtype in (("cast_scale fp32->bf16", torch.bfloat16), ("cast_scale fp32->fp16", torch.float16)):
        out = out16.view(dtype) if dtype == torch.float16 else out16
        ms = cuda_time_ms(lambda: _C.cast_scale_(pick(), 0.125, out), iters)
        rows[name] = {"ms": ms, "bytes": n * 6, "GBps": n * 6 / ms / 1e6}
    ms = cuda_time_ms(lambda: out32.copy_(pick()), iters)
    rows["device-to-device copy fp32"] = {"ms": ms, "bytes": n * 8, "GBps": n * 8 / ms / 1e6}
    copy_bw = rows["device-to-device copy fp32"]["GBps"]
    for row in rows.values():
        row["fraction_of_copy_bw"] = row["GBps"] / copy_bw
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--reps", type=int, default=9, help="interleaved repetitions (default 9)")
    p.add_argument("--iters", type=int, default=50, help="timed iterations per repetition")
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--out", default="benchmarks/results/hook_overhead.json")
    p.add_argument("--trace-dir", default=None,
                   help="also profile 5 iterations of each variant; tables of CUDA and host time in DIR/kernels.txt")
    args = p.parse_args(argv)
    device = init_gpu_process_group(port=29533)
    rank, world = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)

    x = torch.randn(args.batch, 3, 224, 224, device=device).to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (args.batch,), device=device)
    runners, models, runners_steps, host_ms = {}, {}, {}, {}
    for name, hook in VARIANTS.items():
        ddp, opt = build(hook, device, args.bucket_mb)
        if name.endswith("(timing off)"):
            registration.handle_of(ddp).timing = False  # what the counters' events cost
        if name.endswith("(launch thread)"):
            registration.handle_of(ddp).launch_thread = True
        step = training_step(ddp, opt, lambda m: nn.functional.cross_entropy(m(x), y))
        run, host_ms[name] = timed_chunk(step, args.iters)
        for _ in range(args.warmup):
            step()
        runners[name], models[name] = run, ddp
        runners_steps[name] = step
        say(f"built and warmed up: {name}")
    for ddp in models.values():
        if hasattr(ddp, "_commtune_handle"):
            registration.handle_of(ddp).reset_stats()
    say(f"timing {len(runners)} variants x {args.reps} repetitions x {args.iters} iterations "
        f"(ResNet-50, batch {args.batch}, bf16 autocast, channels_last, {world} rank(s))")
    times = interleaved(runners, args.reps, progress=say)

    base = times[BASELINE]
    results = {}
    for name, values in times.items():
        ratios = paired_ratios(values, base)
        results[name] = {"ms_per_iteration": summary(values), "ratio_to_no_hook": summary(ratios),
                         "host_ms_per_iteration": summary(host_ms[name])}
        if hasattr(models[name], "_commtune_handle"):
            s = registration.handle_of(models[name]).stats()
            n = max(1, s["iterations"])
            results[name]["counters_per_iteration"] = {
                k: s[k] / n for k in ("calls", "bytes_in", "bytes_out", "hook_host_us", "comm_us", "exposed_comm_us")}
    kernel = cast_kernel_bandwidth(device)
    if args.trace_dir and rank == 0:
        profile_variants(runners_steps, args.trace_dir)

    bars = {}
    for ours, theirs in PAIRS.items():
        r = results[ours]["ratio_to_no_hook"]["median"]
        bars[f"{ours} <= 1.01 x no hook"] = r <= 1.01
        bars[f"{ours} <= {theirs}"] = results[ours]["ms_per_iteration"]["median"] <= results[theirs]["ms_per_iteration"]["median"]
    bars["cast kernel >= 90% of copy bandwidth"] = kernel["cast_scale fp32->bf16"]["fraction_of_copy_bw"] >= 0.90

    rows = []
    for name, r in results.items():
        ms, ratio = r["ms_per_iteration"], r["ratio_to_no_hook"]
        rows.append([name, f"{ms['median']:.2f}", f"{ms['min']:.2f}-{ms['max']:.2f}",
                     f"{ratio['median']:.4f}", f"{ratio['min']:.4f}-{ratio['max']:.4f}",
                     f"{r['host_ms_per_iteration']['median']:.2f}"])
    say(format_rows(["variant", "ms/iter", "range", "x no hook", "ratio range", "host ms/iter"], rows))
    say(format_rows(["kernel (100 MB fp32 bucket)", "ms", "GB/s", "of copy bw"],
                    [[k, f"{v['ms']:.4f}", f"{v['GBps']:.0f}", f"{v['fraction_of_copy_bw']:.1%}"] for k, v in kernel.items()]))
    for bar, ok in bars.items():
        say(f"{'PASS' if ok else 'FAIL'}  {bar}")
    if rank == 0:
        write_results(args.out, {"benchmark": "hook_overhead", "environment": environment(), "args": vars(args),
                                 "world_size": world, "results": results, "cast_kernel": kernel, "bars": bars})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
