"""all_reduce / reduce_scatter / all_gather over message sizes, with nccl-tests' bandwidths.

    torchrun --nproc-per-node 8 benchmarks/allreduce_sweep.py          # NCCL, 8 B .. 1 GiB
    python -m commtune bench allreduce                                 # every GPU, or 2 gloo ranks
    python -m commtune bench allreduce --ranks 3 --max-size 1MiB       # CPU: small sizes

Definitions as nccl-tests' PERFORMANCE.md: the size S is the bytes of the full result (the
reduced buffer for all_reduce, the gathered buffer for all_gather, the input for
reduce_scatter); algbw = S / t; busbw = algbw * 2(n-1)/n for all_reduce and algbw * (n-1)/n for
the other two, so busbw compares with the link's bandwidth whatever n is. t is the mean time
per call over the timed calls (CUDA events on GPUs, the host clock between barriers on CPU),
and the slowest rank's t is reported.
"""
import argparse
import time

import torch
import torch.distributed as dist

from .. import launch
from ..nccl import parse_size
from .common import environment, format_rows, write_results

OPS = ("all_reduce", "reduce_scatter", "all_gather")


def bus_factor(op, n):
    """busbw / algbw for `op` on n ranks (nccl-tests)."""
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def sizes_between(smallest, largest):
    """Powers of two from `smallest` to `largest` bytes."""
    out, s = [], smallest
    while s <= largest:
        out.append(s)
        s *= 2
    return out


def _call(op, full, part):
    if op == "all_reduce":
        dist.all_reduce(full)
    elif op == "reduce_scatter":
        dist.reduce_scatter_tensor(part, full)
    else:
        dist.all_gather_into_tensor(full, part)


def time_op(op, size, device, warmup, iters):
    """Mean seconds per call on this rank, for a result of `size` bytes (float32)."""
    n = dist.get_world_size()
    count = max(n, size // 4 // n * n)  # elements, divisible by n
    full = torch.ones(count, device=device)
    part = torch.ones(count // n, device=device)
    for _ in range(warmup):
        _call(op, full, part)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            _call(op, full, part)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / iters
    else:
        dist.barrier()
        began = time.perf_counter()
        for _ in range(iters):
            _call(op, full, part)
        seconds = (time.perf_counter() - began) / iters
    slowest = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest), count * 4


def sweep(rank, world_size, args):
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    say = print if rank == 0 else (lambda *a, **k: None)
    sizes = args.sizes or sizes_between(args.min_size, args.max_size)
    say(f"sweep: {', '.join(args.ops)}; {len(sizes)} sizes {min(sizes)} B..{max(sizes)} B; "
        f"{world_size} ranks, backend {dist.get_backend()}")
    rows = []
    for op in args.ops:
        for i, size in enumerate(sizes):
            # Fewer calls for large messages: each repetition is long enough already.
            iters = max(2, min(args.iters, int(args.iters * 2**20 / max(size, 2**20))))
            seconds, nbytes = time_op(op, size, device, args.warmup, iters)
            algbw = nbytes / seconds / 1e9
            rows.append({"op": op, "bytes": nbytes, "time_us": seconds * 1e6, "algbw_GBps": algbw,
                         "busbw_GBps": algbw * bus_factor(op, world_size), "iters": iters})
            say(f"  {op} {nbytes} B: {seconds * 1e6:.1f} us ({i + 1}/{len(sizes)})")
    if rank == 0:
        table = [[r["op"], str(r["bytes"]), f"{r['time_us']:.1f}", f"{r['algbw_GBps']:.3f}", f"{r['busbw_GBps']:.3f}"]
                 for r in rows]
        print(format_rows(["op", "bytes", "time us", "algbw GB/s", "busbw GB/s"], table))
        write_results(args.out, {"benchmark": "allreduce_sweep", "environment": environment(), "args": {
            k: v for k, v in vars(args).items()}, "world_size": world_size, "backend": dist.get_backend(),
            "rows": rows})


def parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    p.add_argument("--min-size", type=parse_size, default=8, help="smallest result in bytes (default 8)")
    p.add_argument("--max-size", type=parse_size, default=None,
                   help="largest result (default 1GiB on GPUs, 4MiB on CPU)")
    p.add_argument("--sizes", type=parse_size, nargs="+", default=None,
                   help="exact sizes instead of the powers of two between --min-size and --max-size")
    p.add_argument("--iters", type=int, default=20, help="timed calls per size (fewer above 1 MiB)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--ranks", type=int, default=None, help="ranks to start when not under torchrun")
    p.add_argument("--out", default="benchmarks/results/allreduce_sweep.json")
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    if args.max_size is None:
        args.max_size = 2**30 if torch.cuda.is_available() else 4 * 2**20
    if args.min_size > args.max_size:
        raise SystemExit(f"--min-size ({args.min_size}) is above --max-size ({args.max_size})")
    if args.iters < 1 or args.warmup < 0:
        raise SystemExit("--iters must be >= 1 and --warmup >= 0")
    launch.run_ranks(sweep, args=(args,), world_size=args.ranks)


if __name__ == "__main__":
    main()
