# Probe: RandomK's step before and after its kernels, on one GPU, a 100 MB fp32 bucket at ratio
# 0.01, error feedback on: the hook's taking (draw, gather, overflow check, clearing) and placing,
# as ATen ops with positions drawn on the host (the hook before the twenty-sixth session) and as
# commtune's kernels (since the twenty-eighth, one pass over the bucket each, on the stratified
# draw). Device time queued (CUDA events, median of 30) and host time per call (what autograd's
# thread spends launching it). Results: benchmarks/results/randomk_ab_<gpu>_session<N>.txt.
#   python benchmarks/probes/randomk_ab_probe.py   (after pip install -e .; one GPU)
import math
import statistics
import time

import torch

from commtune import _C
from commtune.bench.common import cuda_time_ms

numel, ranks, ratio, seed = 25_000_000, 8, 0.01, 2026
k = math.ceil(ratio * numel)
src = torch.randn(numel, device="cuda")
x, out = src.clone(), torch.empty_like(src)
values = torch.empty(k, device="cuda")


def aten_take():
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(numel, (k,), generator=gen).pin_memory().to("cuda", non_blocking=True)
    v = x.index_select(0, positions)
    v[:1].add_(torch.where(torch.isfinite(x).all(), 0.0, float("nan")))
    x.index_fill_(0, positions, 0).nan_to_num_(0.0, 0.0, 0.0)
    return v, positions


def aten_place(summed, positions):
    out.zero_()
    out.index_copy_(0, positions, summed.div(ranks))


_, kept = aten_take()
cases = {
    "ATen take (host draw, copy, index_select, isfinite.all, index_fill, nan_to_num_)": aten_take,
    "commtune take (random_k_take_)": lambda: _C.random_k_take_(x, seed, values, True),
    "ATen place (zero_, index_copy_ of the mean)": lambda: aten_place(values, kept),
    "commtune place (random_k_place_)": lambda: _C.random_k_place_(values, seed, out, ranks),
}
for name, fn in cases.items():
    device_us = 1e3 * cuda_time_ms(fn, 30, 3, queued=True)
    host = []
    for _ in range(30):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    print(f"{name:82s} device {device_us:8.1f} us   host {1e6 * statistics.median(host):8.1f} us", flush=True)
