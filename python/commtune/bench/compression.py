"""Compression kernels on one GPU: each pass of the 8-bit Quantize scheme on a 100 MB fp32
bucket against a device-to-device copy of the same bucket, and the bytes each rank puts on
the wire against a ring allreduce of the uncompressed bucket.

Bandwidth counts the bytes a pass must read and write once: quantize reads the bucket and
writes the codes, the scales and the error buffer; reduce reads the ranks' encoded shards and
writes one; dequantize reads the encoded bucket and writes the bucket.
"""
import argparse

import torch

from .. import _C
from .common import cuda_time_ms, environment, format_rows, write_results


def measure(numel, ranks, chunk, iters, device):
    shard, piece = _C.quantize_layout(numel, ranks, chunk)
    src = torch.randn(numel, device=device)
    error = torch.empty_like(src)
    packed = torch.empty(ranks * piece, dtype=torch.uint8, device=device)
    mine = torch.empty(piece, dtype=torch.uint8, device=device)
    out = torch.empty_like(src)
    copy = torch.empty_like(src)
    passes = {
        "quantize (stochastic, error feedback)": (lambda: _C.quantize_shards_(src, error, packed, ranks, chunk, 7),
                                                  4 * numel + ranks * piece + 4 * numel),
        "reduce one shard": (lambda: _C.reduce_shard_(packed, mine, numel, ranks, chunk, ranks, 7),
                             ranks * piece + piece),
        "dequantize": (lambda: _C.dequantize_shards_(packed, out, ranks, chunk), ranks * piece + 4 * numel),
        "device-to-device copy fp32": (lambda: copy.copy_(src), 8 * numel),
    }
    rows = {}
    for name, (fn, nbytes) in passes.items():
        ms = cuda_time_ms(fn, iters)
        rows[name] = {"ms": ms, "bytes": nbytes, "GBps": nbytes / ms / 1e6}
    copy_bw = rows["device-to-device copy fp32"]["GBps"]
    for row in rows.values():
        row["fraction_of_copy_bw"] = row["GBps"] / copy_bw
    wire = {"quantize_bytes_per_rank": 2 * (ranks - 1) * piece,
            "allreduce_bytes_per_rank": 2 * (ranks - 1) * 4 * numel / ranks}
    wire["ratio"] = wire["allreduce_bytes_per_rank"] / wire["quantize_bytes_per_rank"]
    return rows, wire


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=100.0, help="bucket size in MB of fp32 (default 100)")
    p.add_argument("--ranks", type=int, default=8, help="ranks the layout is cut for (default 8)")
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default="benchmarks/results/compression.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("compression.py times CUDA kernels: it needs a GPU")
    numel = int(args.mb * 1e6) // 4
    rows, wire = measure(numel, args.ranks, args.chunk, args.iters, torch.device("cuda"))
    print(format_rows(["pass", "ms", "GB/s", "of copy"],
                      [[n, f"{r['ms']:.4f}", f"{r['GBps']:.0f}", f"{100 * r['fraction_of_copy_bw']:.1f}%"]
                       for n, r in rows.items()]))
    print(f"bytes on the wire per rank ({args.ranks} ranks): Quantize {wire['quantize_bytes_per_rank']:.0f}, "
          f"ring allreduce {wire['allreduce_bytes_per_rank']:.0f} ({wire['ratio']:.2f}x less)")
    bars = {f"{n} >= 80% of copy bandwidth": r["fraction_of_copy_bw"] >= 0.8
            for n, r in rows.items() if not n.startswith("device")}
    for bar, ok in bars.items():
        print(f"{'PASS' if ok else 'FAIL'}  {bar}")
    write_results(args.out, {"benchmark": "compression", "environment": environment(), "args": vars(args),
                             "numel": numel, "passes": rows, "wire": wire, "bars": bars})


if __name__ == "__main__":
    main()
