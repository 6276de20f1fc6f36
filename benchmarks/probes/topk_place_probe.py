# Probe: TopK's decompression (top_k_place_) on one GPU, a 100 MB fp32 bucket, 8 ranks' pieces of
# k = 1% picks each, against the ATen ops it replaced, a write of the bucket alone (zero_) and the
# device copy (the bar's base); queued device time (median of 50), then each kernel's median time
# over 20 calls (torch.profiler).
#   python benchmarks/probes/topk_place_probe.py   (after pip install -e .; one GPU)
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from commtune import _C
from commtune.bench.common import cuda_time_ms
from commtune.bench.compression import TOPK_PLACE_ATEN, sparsifier_passes, topk_place

numel, ranks, iters = 25_000_000, 8, 50
passes, _, _ = sparsifier_passes(numel, ranks, 1024, torch.device("cuda"))
src, out = torch.randn(numel, device="cuda"), torch.empty(numel, device="cuda")
timed = {"top_k_place_": passes[topk_place(ranks)][0], "ATen ops before": passes[TOPK_PLACE_ATEN][0],
         "write the bucket (zero_)": lambda: out.zero_(), "copy the bucket": lambda: out.copy_(src)}
for name, fn in timed.items():
    print(f"{name:28s} {1e3 * cuda_time_ms(fn, iters, 3, queued=True):8.2f} us", flush=True)
place = passes[topk_place(ranks)][0]
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(20):
        place()
    torch.cuda.synchronize()
kernels = {}
for e in prof.events():
    if e.device_type == torch.autograd.DeviceType.CUDA:
        kernels.setdefault(e.name[:70], []).append(e.device_time)
for name, times in kernels.items():
    print(f"  {name:70s} {statistics.median(times):8.2f} us x {len(times)}")
