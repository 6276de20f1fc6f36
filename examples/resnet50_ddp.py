"""ResNet-50 data-parallel training with commtune: the script behind the scaling study.

    torchrun --nproc-per-node 8 examples/resnet50_ddp.py --hook bf16 --bucket-mb 25
    torchrun --nproc-per-node 8 examples/resnet50_ddp.py --nccl-algo tree --nccl-buffsize 16MiB
    torchrun --nproc-per-node 8 examples/resnet50_ddp.py --nccl-profile tuned.json   # from `commtune tune nccl`
    torchrun --nproc-per-node 2 examples/resnet50_ddp.py --model tiny --batch 8   # CPU, gloo

Synthetic data by default (or --data an ImageFolder), AMP (bf16) and channels_last on GPUs.
Beside torch, the commtune lines are the import, ct.init_process_group and ct.wrap (plus, for
--overlap-optimizer, ct.OverlappedOptimizer, and ct.stats for --result).
"""
import argparse
import gc
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import commtune as ct

HOOKS = {
    "none": lambda: ct.hooks.AllReduce(),
    "bf16": lambda: ct.hooks.Cast(torch.bfloat16),
    "fp16": lambda: ct.hooks.Cast(torch.float16),
    "powersgd": lambda: ct.hooks.PowerSGD(rank=4, start_iter=10),
    "quantize": lambda: ct.hooks.Quantize(),
}


def build_model(name):
    if name == "tiny":  # for CPU runs: the same pipeline, a model a laptop trains
        return nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.ReLU(), nn.Conv2d(16, 32, 3, 2, 1), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 1000))
    import torchvision

    return getattr(torchvision.models, name)()


def batches(args, device):
    if args.data:
        import torchvision
        from torchvision import transforms

        tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.ToTensor()])
        dataset = torchvision.datasets.ImageFolder(args.data, tf)
        sampler = torch.utils.data.distributed.DistributedSampler(dataset)
        loader = torch.utils.data.DataLoader(dataset, args.batch, sampler=sampler, num_workers=4, drop_last=True)
        while True:
            for x, y in loader:
                yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    size = 224 if args.model != "tiny" else 64
    x = torch.randn(args.batch, 3, size, size, device=device)
    y = torch.randint(0, 1000, (args.batch,), device=device)
    while True:
        yield x, y


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet50", help="a torchvision model name, or 'tiny' (CPU runs)")
    p.add_argument("--batch", type=int, default=128, help="per rank")
    p.add_argument("--iters", type=int, default=30, help="timed iterations")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--hook", choices=sorted(HOOKS), default="none", help="none: commtune AllReduce (plain mean)")
    p.add_argument("--bucket-mb", type=float, default=None, help="DDP bucket cap (default: DDP's 25 MB)")
    p.add_argument("--accumulate", type=int, default=1, help="micro-steps per communicating step")
    p.add_argument("--overlap-optimizer", action="store_true", help="SGD update inside backward (WithOptimizer)")
    p.add_argument("--nccl-algo", default=None)
    p.add_argument("--nccl-proto", default=None)
    p.add_argument("--nccl-buffsize", default=None)
    p.add_argument("--nccl-profile", default=None,
                   help="NCCL settings from a `python -m commtune tune nccl` profile (instead of the three above)")
    p.add_argument("--data", default=None, help="an ImageFolder directory (default: synthetic data)")
    p.add_argument("--result", default=None, help="append this run's figures to this JSON-lines file")
    return p.parse_args()


def main():
    args = parse()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        torch.backends.cudnn.benchmark = True
    settings = (ct.nccl.Settings.from_profile(args.nccl_profile) if args.nccl_profile
                else ct.nccl.Settings(algo=args.nccl_algo, proto=args.nccl_proto, buffsize=args.nccl_buffsize))
    ct.init_process_group("nccl" if cuda else "gloo", settings=settings if cuda else None)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    model = build_model(args.model).to(device, memory_format=torch.channels_last if cuda else torch.contiguous_format)
    hook = HOOKS[args.hook]()
    if args.overlap_optimizer:
        hook = ct.hooks.WithOptimizer(hook, "sgd", lr=0.1, momentum=0.9, weight_decay=1e-4)
    ddp_kwargs = {"device_ids": [device.index]} if cuda else {}
    if args.bucket_mb is not None:
        ddp_kwargs["bucket_cap_mb"] = args.bucket_mb
    ddp = ct.wrap(model, hook=hook, **ddp_kwargs)
    opt = (ct.OverlappedOptimizer(ddp) if args.overlap_optimizer
           else torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4))

    data = batches(args, device)
    times = []
    for it in range(args.warmup + args.iters):
        if it == args.warmup:
            ct.handle_of(ddp).reset_stats()
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        for micro in range(args.accumulate):
            x, y = next(data)
            last = micro == args.accumulate - 1
            with (ddp.no_sync() if not last else torch.enable_grad()):
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                    loss = nn.functional.cross_entropy(ddp(x), y) / args.accumulate
                loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if it >= args.warmup:
            times.append((time.perf_counter() - started) * 1e3)
        if rank == 0 and (it + 1) % 10 == 0:
            print(f"iteration {it + 1}/{args.warmup + args.iters}: loss {loss.item() * args.accumulate:.3f}",
                  flush=True)

    # The slowest rank sets the pace.
    median = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    stats = ct.stats(ddp)
    timed = max(1, stats["timed_iterations"])
    figures = {"ranks": world, "model": args.model, "batch": args.batch, "hook": args.hook, "bucket_mb": args.bucket_mb,
               "accumulate": args.accumulate, "overlap_optimizer": args.overlap_optimizer,
               "nccl": settings.to_dict() if cuda else None, "iteration_ms": float(median),
               "samples_per_s": world * args.batch * args.accumulate / float(median) * 1e3,
               "comm_ms": stats["comm_us"] / timed / 1e3, "exposed_comm_ms": stats["exposed_comm_us"] / timed / 1e3}
    if rank == 0:
        print(json.dumps(figures))
        if args.result:
            with open(args.result, "a") as f:
                f.write(json.dumps(figures) + "\n")
    # DDP (its reducer and hook hold the process group) goes before the group does.
    del opt, ddp, data
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
