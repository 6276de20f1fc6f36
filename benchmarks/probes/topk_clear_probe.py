# Probe: where TopK's error-feedback call (the threshold selection with clear) spends its time
# over the selection alone, on a 100 MB fp32 bucket at k = 1%: the bucket reused or a fresh copy
# a call, clearing or not, and a scatter of k zeros as a pass of its own. The twenty-sixth
# session's runs: benchmarks/results/topk_clear_probe_h100_session26.txt.
#   python benchmarks/probes/topk_clear_probe.py   (after pip install -e .; one GPU)
import itertools, torch
from commtune import _C
from commtune.bench.common import cuda_time_ms
numel, iters = 25_000_000, 50
k = numel // 100
src = torch.randn(numel, device="cuda")
calls = iters + 3
fresh = src.expand(calls, numel).clone()
piece = torch.empty(2 * k, dtype=torch.int32, device="cuda")
q = torch.empty(1, dtype=torch.int64, device="cuda")
def rot(clear):
    turn = itertools.count()
    return lambda: _C.threshold_top_k_(fresh[next(turn) % calls], k, piece, q, clear)
def refill():
    fresh.copy_(src.expand(calls, numel))
cases = {}
cases["same src, no clear"] = lambda: _C.threshold_top_k_(src, k, piece, q, False)
cases["fresh copies, no clear"] = rot(False)
refill(); cases["fresh copies, clear"] = rot(True)
for name, fn in cases.items():
    if "clear" in name and "no clear" not in name: refill()
    print(f"{name:30s} {1e3 * cuda_time_ms(fn, iters, 3, queued=True):7.2f} us", flush=True)
src2 = src.clone()
idx = torch.randperm(numel, device="cuda")[:k]
z = torch.zeros(k, device="cuda")
print(f"{'index_put_ of k zeros':30s} {1e3 * cuda_time_ms(lambda: src2.index_put_((idx,), z), iters, 3, queued=True):7.2f} us")
sidx = idx.sort().values
print(f"{'same, sorted positions':30s} {1e3 * cuda_time_ms(lambda: src2.index_put_((sidx,), z), iters, 3, queued=True):7.2f} us")
