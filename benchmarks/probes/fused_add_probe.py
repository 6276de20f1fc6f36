# Probe: each error-feedback hook's first kernel with error feedback's add fused in (since the
# thirty-first session) against what the hook ran before: error.add_(bucket), a pass of its own,
# then the kernel on the error buffer. One GPU, a 100 MB fp32 bucket cut for 8 ranks, ratio 0.01,
# queued device time (median of 50 calls). TopK gets an error buffer of its own for each call,
# so that no call sees what an earlier one took.
#   python benchmarks/probes/fused_add_probe.py   (after pip install -e .; one GPU)
import itertools

import torch

from commtune import _C
from commtune.bench.common import cuda_time_ms

numel, ranks, chunk, iters, seed = 25_000_000, 8, 1024, 50, 2026
k = numel // 100
bucket = torch.randn(numel, device="cuda")
error = torch.zeros_like(bucket)
values = torch.empty(k, device="cuda")
piece = torch.empty(2 * k, dtype=torch.int32, device="cuda")
count = torch.empty(1, dtype=torch.int64, device="cuda")
errors = (bucket * 0.5).expand(2 * (iters + 3), numel).clone()
turn = itertools.count()
sign = torch.empty(_C.sign_piece_bytes(numel, chunk), dtype=torch.uint8, device="cuda")
packed = {c: torch.empty(ranks * _C.quantize_layout(numel, ranks, chunk, c)[1], dtype=torch.uint8, device="cuda")
          for c in ("int8", "int4", "e4m3")}


hooks = {}
for c in packed:
    hooks[f"Quantize {c}"] = (lambda e, c=c: _C.quantize_shards_(e, e, packed[c], ranks, chunk, 7, c),
                              lambda c=c: _C.quantize_shards_(bucket, error, packed[c], ranks, chunk, 7, c, accumulate=True),
                              lambda: error)
hooks["SignSGD"] = (lambda e: _C.sign_encode_(e, e, sign, chunk),
                    lambda: _C.sign_encode_(bucket, error, sign, chunk, accumulate=True), lambda: error)
hooks["RandomK"] = (lambda e: _C.random_k_take_(e, seed, values, True),
                    lambda: _C.random_k_take_(error, seed, values, True, bucket), lambda: error)
hooks["TopK"] = (lambda e: _C.threshold_top_k_(e, k, piece, count, True),
                 lambda: _C.threshold_top_k_(errors[next(turn) % len(errors)], k, piece, count, True, bucket),
                 lambda: errors[next(turn) % len(errors)])
print(f"{'hook':14s} {'add_, then the kernel':>22s} {'fused':>10s} {'speedup':>8s}")
for name, (kernel, fused, buffer) in hooks.items():
    def before(kernel=kernel, buffer=buffer):
        e = buffer()
        e.add_(bucket)
        kernel(e)
    t0 = 1e3 * cuda_time_ms(before, iters, 3, queued=True)
    t1 = 1e3 * cuda_time_ms(fused, iters, 3, queued=True)
    print(f"{name:14s} {t0:19.2f} us {t1:7.2f} us {t0 / t1:7.2f}x", flush=True)
