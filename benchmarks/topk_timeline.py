"""The threshold top-k's kernels on the device's timeline (one GPU): each kernel's time and the
gap before it, by CUPTI (torch.profiler), 20 calls queued behind a spin kernel as
compression.py queues them; medians over the calls after the first. compression.py times the
whole call; this says where its time goes. From sm_90 on a kernel starts while the one before it
runs (dependent launch), so its gap is negative: it began that long before the previous ended.

    python benchmarks/topk_timeline.py              # the selection alone: $OUT/topk_kernels.json (or ./)
    python benchmarks/topk_timeline.py --call hook  # the hook's error-feedback call (add fused): topk_kernels_hook.json
"""
import argparse
import json
import os
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from commtune.bench.common import environment, write_results
from commtune.bench.compression import TOPK_AS_THE_HOOK, sparsifier_passes

args = argparse.ArgumentParser(description=__doc__.split("\n")[0])
args.add_argument("--call", choices=["select", "hook"], default="select")
call = args.parse_args().call

if not torch.cuda.is_available():
    raise SystemExit("topk_timeline.py times CUDA kernels: it needs a GPU")
dev = torch.device("cuda")
calls = 20
passes, qualifying, k = sparsifier_passes(25_000_000, 8, 1024, dev, calls=calls + 5)  # an error buffer a call
topk = passes["top-k select, ratio 0.01 (threshold)" if call == "select" else TOPK_AS_THE_HOOK][0]
for _ in range(5):
    topk()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    torch.cuda._sleep(int(5e6))
    for _ in range(calls):
        topk()
    torch.cuda.synchronize()
kernels = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA and "spin_kernel" not in e.name),
                 key=lambda t: t[0])
names = {}
for _, _, n in kernels:
    names[n[:70]] = names.get(n[:70], 0) + 1
# calls start at their threshold search
starts = [i for i, (_, _, n) in enumerate(kernels) if "sample_threshold" in n] + [len(kernels)]
per_kernel, gaps, spans = {}, {}, []
for a, b in zip(starts[:-1], starts[1:]):
    one = kernels[a:b]
    spans.append(one[-1][1] - one[0][0])
    for i, (st, en, n) in enumerate(one):
        key = f"{i} {n[:60]}"
        per_kernel.setdefault(key, []).append(en - st)
        if i:
            gaps.setdefault(key, []).append(st - one[i - 1][1])
med = lambda v: statistics.median(v[1:] if len(v) > 2 else v)
summary = {"benchmark": "topk_timeline", "call": call, "environment": environment(), "calls_seen": len(spans),
           "call_span_us_median": med(spans),
           "per_kernel_us_median": {n: med(v) for n, v in per_kernel.items()},
           "gap_before_us_median": {n: med(v) for n, v in gaps.items()},
           "qualifying_per_k": int(qualifying.item()) / k, "events": names}
print(json.dumps(summary, indent=1))
name = "topk_kernels.json" if call == "select" else "topk_kernels_hook.json"
write_results(os.path.join(os.environ.get("OUT", "."), name), summary)
