# Probe: TopK's error-feedback call with the add fused (the hook's call since the thirty-first
# session) against the add and the call without it, on one GPU, a 100 MB fp32 bucket at k = 1%,
# an error buffer of its own for each call. Queued device time (median of 50).
#   python benchmarks/probes/topk_fused_probe.py   (after pip install -e .; one GPU)
import torch
from commtune.bench.common import cuda_time_ms
from commtune.bench.compression import TOPK_AS_THE_HOOK, TOPK_CLEAR_NO_ADD, sparsifier_passes

numel, iters = 25_000_000, 50
passes, _, _ = sparsifier_passes(numel, 8, 1024, torch.device("cuda"), calls=iters + 3)
error, bucket = torch.randn(numel, device="cuda"), torch.randn(numel, device="cuda")
timed = {"fused (the hook's call)": passes[TOPK_AS_THE_HOOK][0], "the call without the add": passes[TOPK_CLEAR_NO_ADD][0],
         "error += bucket (add_)": lambda: error.add_(bucket)}
for name, fn in timed.items():
    print(f"{name:30s} {1e3 * cuda_time_ms(fn, iters, 3, queued=True):8.2f} us", flush=True)
