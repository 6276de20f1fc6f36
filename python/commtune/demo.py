"""`python -m commtune demo`: a small model trained with each hook, and its counters."""
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from . import hooks, launch, registration
from .overlap import OverlappedOptimizer
from .stats import format_table


def _model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Flatten(),
        nn.Linear(16 * 16 * 16, 256), nn.ReLU(), nn.Linear(256, 10),
    )


def _configs():
    return [("plain DDP (no hook)", None), ("commtune AllReduce", hooks.AllReduce()),
            ("commtune Cast(bf16)", hooks.Cast(torch.bfloat16)),
            ("commtune Cast(fp16)", hooks.Cast(torch.float16)),
            ("commtune PowerSGD(rank=2), from iteration 2", hooks.PowerSGD(rank=2, start_iter=2)),
            # min_size=0: the demo's buckets are smaller than the default threshold
            ("commtune Quantize(8 bits)", hooks.Quantize(min_size=0)),
            ("commtune SignSGD", hooks.SignSGD(min_size=0)),
            ("commtune TopK(0.05)", hooks.TopK(ratio=0.05, min_size=0)),
            # the small buckets go with the next one; the update runs inside backward
            ("commtune Fused(AllReduce, 8 MB)", hooks.Fused(hooks.AllReduce(), min_bytes=8 << 20)),
            ("commtune WithOptimizer(AllReduce, sgd)", hooks.WithOptimizer(hooks.AllReduce(), "sgd", lr=0.02,
                                                                          momentum=0.9))]


def _train(rank, world_size, iterations, warmup):
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    ids = [device.index] if device.type == "cuda" else None
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"commtune demo: {world_size} ranks, backend {dist.get_backend()}, device {device.type}, "
        f"{iterations} iterations per hook, timed and counted after {warmup} warm-up iterations")
    # A learnable task: the label is the strongest of 10 fixed random patterns in the image.
    patterns = torch.randn(10, 3 * 16 * 16, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1 + rank)
    images = [torch.randn(32, 3, 16, 16, generator=g) for _ in range(8)]
    data = [(x, (x.flatten(1) @ patterns.T).argmax(1)) for x in images]
    for n, (label, hook) in enumerate(_configs(), 1):
        model = _model().to(device)
        ddp = DDP(model, device_ids=ids, bucket_cap_mb=1) if hook is None else \
            registration.wrap(model, hook=hook, device_ids=ids, bucket_cap_mb=1)
        opt = (OverlappedOptimizer(ddp) if isinstance(hook, hooks.WithOptimizer)
               else torch.optim.SGD(ddp.parameters(), lr=0.02, momentum=0.9))
        handle = None if hook is None else registration.handle_of(ddp)
        losses = []
        # The warm-up's first iterations load kernels and allocate buckets (tens of ms on a GPU):
        # left in, they would dominate 20 iterations' time and counters.
        for i in range(warmup + iterations):
            if i == warmup:
                _synchronize(device)
                if handle is not None:
                    handle.reset_stats()
                start = time.perf_counter()
            x, y = (t.to(device) for t in data[i % len(data)])
            opt.zero_grad()
            loss = nn.functional.cross_entropy(ddp(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        _synchronize(device)
        ms = (time.perf_counter() - start) / iterations * 1e3
        say(f"\n[{n}/{len(_configs())}] {label}: loss {losses[0]:.3f} -> {losses[-1]:.3f}, {ms:.1f} ms/iteration")
        if handle is not None:
            stats = handle.stats()
            say(format_table(stats))
            if "fused_buckets" in stats:
                say(f"fused: {stats['fused_buckets']:.0f} small buckets sent in {stats['fused_sends']:.0f} fused sends")
        dist.barrier(device_ids=ids)


def _synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(iterations=20, world_size=None, warmup=3):
    launch.run_ranks(_train, args=(iterations, warmup), world_size=world_size)
