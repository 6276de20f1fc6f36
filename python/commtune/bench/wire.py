"""Bytes each rank puts on the wire, per scheme: the hooks' counters against the schemes' formulas.

    python benchmarks/wire_bytes.py                     # 8 ranks (gloo on CPU, NCCL on 8 GPUs), 25 MB bucket
    python benchmarks/wire_bytes.py --ranks 3 --mb 4

Every hook runs on a model of one parameter (one DDP bucket of --mb), two iterations; its
`wire_bytes` counter (each collective counted as nccl-tests counts bus traffic: an allreduce of
S sends 2(n-1)/n S from each rank, an all-gather of pieces P sends (n-1) P, an all-to-all of S
sends (n-1)/n S) is compared with the figure written below from each scheme's description. The
byte counts do not depend on the device, so gloo ranks on a CPU give the same figures as GPUs.
"""
import argparse
import math

import torch
import torch.distributed as dist

from .. import hooks, launch
from .common import environment, format_rows, write_results

CHUNK = 1024
RATIO = 0.01
BITS = {"int8": 8, "int4": 4, "e4m3": 8}


def schemes():
    """name -> (hook config, bytes one rank sends for a bucket of `numel` fp32 on `n` ranks)."""
    ring = lambda nbytes, n: 2 * (n - 1) / n * nbytes

    def quantize(codes):
        def sent(numel, n):  # all-to-all of the n shards' codes and scales, all-gather of the reduced shard
            shard = math.ceil(math.ceil(numel / n) / CHUNK) * CHUNK
            piece = shard * BITS[codes] // 8 + 4 * shard // CHUNK
            return (n - 1) * piece + (n - 1) * piece
        return sent

    def sign(numel, n):  # all-gather of one bit a value and one fp32 scale a chunk
        chunks = math.ceil(numel / CHUNK)
        return (n - 1) * (chunks * CHUNK // 8 + 4 * chunks)

    k = lambda numel: math.ceil(RATIO * numel)
    bits = {"int8": dict(bits=8), "int4": dict(bits=4), "e4m3": dict(format="e4m3")}
    table = {
        "AllReduce (default DDP)": (hooks.AllReduce(), lambda numel, n: ring(4 * numel, n)),
        "Cast bf16": (hooks.Cast(torch.bfloat16), lambda numel, n: ring(2 * numel, n)),
    }
    for codes, kw in bits.items():
        table[f"Quantize {codes}"] = (hooks.Quantize(chunk=CHUNK, min_size=0, **kw), quantize(codes))
    table["SignSGD"] = (hooks.SignSGD(chunk=CHUNK, min_size=0), sign)
    table[f"TopK {RATIO}"] = (hooks.TopK(RATIO, min_size=0, selection="threshold"),
                              lambda numel, n: (n - 1) * 8 * k(numel))  # k fp32 values + k int32 indices
    table[f"RandomK {RATIO}"] = (hooks.RandomK(RATIO, min_size=0), lambda numel, n: ring(4 * k(numel), n))
    return table


class OneBucket(torch.nn.Module):
    """A model whose gradients are one tensor of `numel` values: one DDP bucket."""

    def __init__(self, numel):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(numel))

    def forward(self, x):
        return (self.weight * x).sum()


def run(rank, world_size, args):
    import commtune as ct

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    numel = int(args.mb * 1e6) // 4
    rows, table = [], schemes()
    for i, (name, (config, formula)) in enumerate(table.items(), 1):
        if rank == 0:
            print(f"[{i}/{len(table)}] {name}", flush=True)
        model = OneBucket(numel).to(device)
        ddp = ct.wrap(model, hook=config, device_ids=[device.index] if device.type == "cuda" else None,
                      bucket_cap_mb=2 * args.mb + 1)
        g = torch.Generator(device=device).manual_seed(rank)
        for _ in range(args.iters):
            ddp(torch.randn(numel, generator=g, device=device)).backward()
        s = ct.stats(ddp)
        expected = args.iters * formula(numel, world_size)
        rows.append({"scheme": name, "calls": s["calls"], "bytes_in_per_rank": s["bytes_in"] / s["calls"],
                     "wire_bytes_per_rank": s["wire_bytes"] / s["calls"], "formula_per_rank": expected / s["calls"],
                     "vs_ring_allreduce": s["wire_ratio"],
                     "equal": math.isclose(s["wire_bytes"], expected, rel_tol=1e-12)})
        del ddp, model
    if rank == 0:
        header = ["scheme", "bytes in", "sent (counters)", "sent (formula)", "x fewer than a ring allreduce", "equal"]
        print(format_rows(header,
                          [[r["scheme"], f"{r['bytes_in_per_rank']:.0f}", f"{r['wire_bytes_per_rank']:.0f}",
                            f"{r['formula_per_rank']:.0f}", f"{r['vs_ring_allreduce']:.2f}",
                            "yes" if r["equal"] else "NO"] for r in rows]))
        bar = all(r["equal"] for r in rows)
        print(f"{'PASS' if bar else 'FAIL'}  bytes on the wire per rank equal the analytic figure for each scheme "
              f"({world_size} ranks, {dist.get_backend()})")
        write_results(args.out, {"benchmark": "wire_bytes", "environment": environment(), "args": vars(args),
                                 "world_size": world_size, "backend": dist.get_backend(), "numel": numel, "rows": rows,
                                 "bars": {"bytes on the wire per rank equal the analytic figure": bar}})


def parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=8, help="ranks to start when not under torchrun (default 8)")
    p.add_argument("--mb", type=float, default=25.0, help="the bucket's size in MB of fp32 gradients")
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/wire_bytes.json")
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    if args.ranks < 2 or args.mb <= 0 or args.iters < 1:
        raise SystemExit("--ranks must be >= 2, --mb > 0 and --iters >= 1")
    backend = "nccl" if torch.cuda.device_count() >= args.ranks else "gloo"  # bytes are the same on either
    launch.run_ranks(run, args=(args,), backend=backend, world_size=args.ranks)


if __name__ == "__main__":
    main()
