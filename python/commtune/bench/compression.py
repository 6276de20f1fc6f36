"""Compression kernels on one GPU: each pass of the Quantize scheme (int8, int4 and fp8 e4m3
codes) on a 100 MB fp32 bucket against a device-to-device copy of the same bucket (the bytes
each scheme puts on the wire: benchmarks/wire_bytes.py).

Bandwidth counts the bytes a pass must read and write once: quantize reads the bucket and
the error buffer (error feedback's add is part of the pass) and writes the codes, the scales
and the error buffer; reduce reads the ranks' encoded shards and
writes one; dequantize reads the encoded bucket and writes the bucket. The reduce pass of a
real step handles one shard (1/ranks of the bucket); it is also timed on a shard as large as
the whole bucket, where its tail no longer dominates, and a copy of as many bytes as the int8
one-shard reduce shows what that size alone costs. So does a copy as large as the int4 one-shard
reduce (half of int8's bytes), and a launch of a one-element kernel: what every pass pays in this
timing besides its own work (its launch and the events; 3.39 us on an H100). Each one-shard
reduce is also given as a share of the speed of a copy of its own bytes (information: the bar is
on the 100 MB copy).

Each pass is timed twice: "ms" as the device runs it, queued behind a spin kernel (in a step,
earlier work hides the host's launches; the bar is on this time), and "ms_from_idle" from an idle
device, host launch latency included (what the sixth and seventh sessions reported).
"""
import argparse
import itertools

import torch

from .. import _C
from .common import cuda_time_ms, environment, format_rows, write_results


def passes_of(codes, numel, ranks, chunk, device):
    """name -> (the pass, the bytes it must move) for one kind of codes."""
    shard, piece = _C.quantize_layout(numel, ranks, chunk, codes)
    src = torch.randn(numel, device=device)
    error = torch.zeros_like(src)
    packed = torch.empty(ranks * piece, dtype=torch.uint8, device=device)
    mine = torch.empty(piece, dtype=torch.uint8, device=device)
    out = torch.empty_like(src)
    _C.quantize_shards_(src, None, packed, ranks, chunk, 7, codes)
    # `ranks` pieces of a shard the size of the bucket: every rank's encoding of the whole bucket
    _, whole = _C.quantize_layout(numel, 1, chunk, codes)
    big = torch.empty(ranks * whole, dtype=torch.uint8, device=device)
    for r in range(ranks):
        _C.quantize_shards_(src, None, big[r * whole:(r + 1) * whole], 1, chunk, r, codes)
    big_mine = torch.empty(whole, dtype=torch.uint8, device=device)
    return {
        # error += bucket in the same pass, as the hook runs it: the bucket and the error read, the
        # codes and the error written
        f"{codes} quantize (stochastic, error feedback and its add: the hook's call)": (
            lambda: _C.quantize_shards_(src, error, packed, ranks, chunk, 7, codes, accumulate=True),
            12 * numel + ranks * piece),
        f"{codes} reduce one shard": (
            lambda: _C.reduce_shard_(packed, mine, numel, ranks, chunk, ranks, 7, codes), ranks * piece + piece),
        f"{codes} reduce a bucket-sized shard": (
            lambda: _C.reduce_shard_(big, big_mine, numel * ranks, ranks, chunk, ranks, 7, codes),
            ranks * whole + whole),
        f"{codes} dequantize": (
            lambda: _C.dequantize_shards_(packed, out, ranks, chunk, codes), ranks * piece + 4 * numel),
    }


def sparsifier_passes(numel, ranks, chunk, device, calls=1):
    """SignSGD's two kernels, RandomK's two passes, TopK's decompression (the mean of `ranks` pieces:
    one dense write, and the ATen ops it replaced as an information row) and TopK's two
    selections, at ratio 0.01: the threshold one (commtune's kernels: a sampled threshold, then
    one pass), alone and as the hook runs it with error feedback (adding the bucket to the error
    buffer in the same pass, and clearing what it takes, and any Inf or NaN, from that buffer), and
    the exact one (torch.topk: a radix select, not a sort; not ours, so outside the bar). RandomK's
    take likewise, with error feedback as the hook runs it and without. The clearing calls without
    the add (what runs when a buffer is not 16-byte aligned: the add then goes first, as a pass of
    its own) are information rows. TopK's clearing calls get an error buffer of their own for each
    of their first `calls` calls (then they repeat), so that no timed call sees what an earlier one
    cleared."""
    src = torch.randn(numel, device=device)
    error = torch.zeros_like(src)
    out = torch.empty_like(src)
    piece = _C.sign_piece_bytes(numel, chunk)
    gathered = torch.empty(ranks * piece, dtype=torch.uint8, device=device)
    for r in range(ranks):
        _C.sign_encode_(src, None, gathered[r * piece:(r + 1) * piece], chunk)
    k = numel // 100
    piece_k = torch.empty(2 * k, dtype=torch.int32, device=device)
    qualifying = torch.empty(1, dtype=torch.int64, device=device)
    fresh, turn = src.expand(calls, numel).clone(), itertools.count()
    errors, turn_added = (src * 0.5).expand(calls, numel).clone(), itertools.count()
    # RandomK clears the same positions every call with the same seed: one spare bucket will do.
    spare, drawn = src.clone(), torch.empty(k, device=device)
    cleared = torch.empty_like(qualifying)
    # Every rank's piece as the selection writes it: k picks in index order (values, indices).
    pieces = []
    for _ in range(ranks):
        picked = torch.randperm(numel, device=device)[:k].sort().values
        pieces += [torch.randn(k, device=device).view(torch.int32), picked.to(torch.int32)]
    gathered_k = torch.cat(pieces)
    return {
        "top-k select, ratio 0.01 (threshold)": (lambda: _C.threshold_top_k_(src, k, piece_k, qualifying, False),
                                                 4 * numel + 8 * k),
        # error += bucket, the selection, and the error buffer written back whole (its picks 0)
        TOPK_AS_THE_HOOK: (lambda: _C.threshold_top_k_(errors[next(turn_added) % calls], k, piece_k, cleared, True,
                                                       src), 12 * numel + 8 * k),
        TOPK_CLEAR_NO_ADD: (lambda: _C.threshold_top_k_(fresh[next(turn) % calls], k, piece_k, cleared, True),
                            4 * numel + 8 * k + 4 * k),
        # The stratified draw reads and writes only inside the stream of the bucket: a read of it
        # and the k values written (take); with error feedback the bucket is also read and the
        # error buffer written whole, its k entries sent 0; a write of it and the k values read (place).
        RANDOMK_TAKE: (lambda: _C.random_k_take_(spare, RANDOMK_SEED, drawn, True, src), 12 * numel + 4 * k),
        "random-k take, ratio 0.01 (read and gather: no error feedback)": (
            lambda: _C.random_k_take_(src, RANDOMK_SEED, drawn, False), 4 * numel + 4 * k),
        RANDOMK_CLEAR_NO_ADD: (lambda: _C.random_k_take_(spare, RANDOMK_SEED, drawn, True), 4 * numel + 8 * k),
        randomk_place(ranks): (lambda: _C.random_k_place_(drawn, RANDOMK_SEED, out, ranks), 4 * numel + 4 * k),
        "sign encode (error feedback and its add: the hook's call)": (
            lambda: _C.sign_encode_(src, error, gathered[:piece], chunk, accumulate=True), 12 * numel + piece),
        f"sign decode the mean of {ranks} ranks": (lambda: _C.sign_decode_mean_(gathered, out, ranks, chunk),
                                                    ranks * piece + 4 * numel),
        topk_place(ranks): (lambda: _C.top_k_place_(gathered_k, out, ranks), 4 * numel + ranks * 8 * k),
        TOPK_PLACE_ATEN: (lambda: topk_place_in_aten(gathered_k, out, ranks), 4 * numel + ranks * 8 * k),
        EXACT_TOPK: (lambda: src.abs().topk(k, sorted=False), 4 * numel + 8 * k),
    }, qualifying, k


def topk_place_in_aten(gathered, out, ranks):
    """What the TopK hook ran to decompress before top_k_place_ (thirty-second session)."""
    k = gathered.numel() // (2 * ranks)
    total = torch.zeros(out.numel(), device=out.device)
    for r in range(ranks):
        part = gathered[2 * k * r:2 * k * (r + 1)]
        total.index_add_(0, part[k:].long(), part[:k].view(torch.float32))
    out.copy_(total.div_(ranks))


EXACT_TOPK = "top-k select, ratio 0.01 (torch.topk, exact)"
RANDOMK_TAKE = "random-k take, ratio 0.01 (error += bucket, gather and clear: the hook's call, error feedback)"
RANDOMK_CLEAR_NO_ADD = "random-k take and clear, ratio 0.01, no add (error feedback's fallback, unaligned buffers)"
RANDOMK_SEED = 2026
TOPK_AS_THE_HOOK = "top-k error += bucket, select and clear, ratio 0.01 (threshold: the hook's call, error feedback)"
TOPK_CLEAR_NO_ADD = "top-k select and clear, ratio 0.01, no add (error feedback's fallback, unaligned buffers)"
TOPK_PLACE_ATEN = "top-k place the mean, before: ATen ops (zeros, index_add_ a rank, div_, copy_)"
# Rows outside the bars: not run by the hooks on aligned buffers (all of DDP's and commtune's),
# or no longer run by them.
INFORMATION = (RANDOMK_CLEAR_NO_ADD, TOPK_CLEAR_NO_ADD, TOPK_PLACE_ATEN)
LAUNCH_ALONE = "device: a one-element add (a launch alone)"
# A full read and write of the bucket: what TopK's error feedback ran after the threshold
# selection to keep its buffer finite, before the selection took that over (twenty-sixth session).
NAN_TO_NUM = "device: nan_to_num_ of the bucket (a pass of its own)"
# What error feedback ran before each hook's first kernel took it over (thirty-first session): the
# bucket added to the error buffer, a pass of its own.
ERROR_ADD = "device: error += bucket (at::add_, a pass of its own)"
WARMUP = 3  # untimed calls before each timing


def randomk_place(ranks):
    return f"random-k place the mean of {ranks} ranks, ratio 0.01 (one dense write)"


def topk_place(ranks):
    return f"top-k place the mean of {ranks} ranks, ratio 0.01 (one dense write)"


def small_copy(kind):
    """The row of a copy moving as many bytes as `kind`'s one-shard reduce (e4m3 moves int8's)."""
    return f"device-to-device copy fp32, the {'int8' if kind == 'e4m3' else kind} one-shard reduce's bytes"


def measure(numel, ranks, chunk, iters, device, codes=("int8", "int4", "e4m3"), from_idle=True):
    src = torch.randn(numel, device=device)
    copy = torch.empty_like(src)
    one = torch.zeros(1, device=device)
    passes = {"device-to-device copy fp32": (lambda: copy.copy_(src), 8 * numel),
              LAUNCH_ALONE: (lambda: one.add_(1), 8),
              ERROR_ADD: (lambda: copy.add_(src), 12 * numel),
              NAN_TO_NUM: (lambda: copy.nan_to_num_(0.0, 0.0, 0.0), 8 * numel)}
    # copies moving as many bytes as the reduces of one shard (28 MB of this bucket's 200 at
    # int8, 14 MB at int4): how far a pass that small gets by its size alone (information; the
    # bar's base is the copy above)
    for kind in ("int8", "int4"):
        small = (ranks + 1) * _C.quantize_layout(numel, ranks, chunk, kind)[1] // 8
        passes[small_copy(kind)] = (lambda small=small: copy[:small].copy_(src[:small]), 8 * small)
    for kind in codes:
        passes.update(passes_of(kind, numel, ranks, chunk, device))
    calls = (2 if from_idle else 1) * (iters + WARMUP)  # every call of the clearing pass
    sparsifiers, qualifying, k = sparsifier_passes(numel, ranks, chunk, device, calls)
    passes.update(sparsifiers)
    rows = {}
    for name, (fn, nbytes) in passes.items():
        ms = cuda_time_ms(fn, iters, WARMUP, queued=True)
        idle = cuda_time_ms(fn, iters, WARMUP) if from_idle else float("nan")
        rows[name] = {"ms": ms, "bytes": nbytes, "GBps": nbytes / ms / 1e6,
                      "ms_from_idle": idle, "GBps_from_idle": nbytes / idle / 1e6}
    copy_bw = rows["device-to-device copy fp32"]["GBps"]
    copy_idle = rows["device-to-device copy fp32"]["GBps_from_idle"]
    for row in rows.values():
        row["fraction_of_copy_bw"] = row["GBps"] / copy_bw
        row["fraction_of_copy_bw_from_idle"] = row["GBps_from_idle"] / copy_idle
    for kind in codes:
        reduce = rows[f"{kind} reduce one shard"]
        reduce["fraction_of_same_bytes_copy"] = rows[small_copy(kind)]["ms"] / reduce["ms"]
    # the threshold selection's count error on this bucket (normal entries)
    return rows, int(qualifying.item()) / k


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=100.0, help="bucket size in MB of fp32 (default 100)")
    p.add_argument("--ranks", type=int, default=8, help="ranks the layout is cut for (default 8)")
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default="benchmarks/results/compression.json")
    p.add_argument("--no-idle", action="store_true", help="skip the timing from an idle device (for profilers)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("compression.py times CUDA kernels: it needs a GPU")
    numel = int(args.mb * 1e6) // 4
    rows, qualifying_per_k = measure(numel, args.ranks, args.chunk, args.iters, torch.device("cuda"),
                                     from_idle=not args.no_idle)
    print(format_rows(["pass", "ms", "GB/s", "of copy", "ms from idle", "of copy from idle"],
                      [[n, f"{r['ms']:.4f}", f"{r['GBps']:.0f}", f"{100 * r['fraction_of_copy_bw']:.1f}%",
                        f"{r['ms_from_idle']:.4f}", f"{100 * r['fraction_of_copy_bw_from_idle']:.1f}%"]
                       for n, r in rows.items()]))
    for kind in ("int8", "int4", "e4m3"):
        copy = rows[small_copy(kind)]
        print(f"{kind} reduce one shard: {100 * rows[f'{kind} reduce one shard']['fraction_of_same_bytes_copy']:.1f}% "
              f"of the speed of a copy of its bytes (that copy: {100 * copy['fraction_of_copy_bw']:.1f}% of the "
              f"100 MB copy's bandwidth)")
    print(f"a launch alone (one-element add), queued: {1e3 * rows[LAUNCH_ALONE]['ms']:.2f} us")
    print(f"threshold top-k: {qualifying_per_k:.3f} k qualified (at most k are taken)")
    add_us = 1e3 * rows[ERROR_ADD]["ms"]
    print(f"TopK's error-feedback call: {1e3 * rows[TOPK_AS_THE_HOOK]['ms']:.2f} us; before: the add "
          f"{add_us:.2f} us, then the call without it {1e3 * rows[TOPK_CLEAR_NO_ADD]['ms']:.2f} us (and once the "
          f"nan_to_num_ pass, {1e3 * rows[NAN_TO_NUM]['ms']:.2f} us)")
    print(f"RandomK's error-feedback take: {1e3 * rows[RANDOMK_TAKE]['ms']:.2f} us; before: the add {add_us:.2f} us, "
          f"then the take {1e3 * rows[RANDOMK_CLEAR_NO_ADD]['ms']:.2f} us")
    aten, ours = rows[TOPK_PLACE_ATEN]["ms"], rows[topk_place(args.ranks)]["ms"]
    print(f"TopK's decompression: {1e3 * ours:.2f} us; before (ATen ops) {1e3 * aten:.2f} us, {aten / ours:.2f}x")
    bars = {f"{n} >= 80% of copy bandwidth": r["fraction_of_copy_bw"] >= 0.8
            for n, r in rows.items() if not n.startswith("device") and n != EXACT_TOPK and n not in INFORMATION}
    for bar, ok in bars.items():
        print(f"{'PASS' if ok else 'FAIL'}  {bar}")
    write_results(args.out, {"benchmark": "compression", "environment": environment(), "args": vars(args),
                             "numel": numel, "passes": rows,
                             "topk_threshold_qualifying_per_k": qualifying_per_k, "bars": bars})


if __name__ == "__main__":
    main()
