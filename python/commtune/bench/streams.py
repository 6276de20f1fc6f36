"""Where a hook's continuation runs its kernels, and what that costs ResNet-50 on one GPU.

c10's Future runs each then() callback on the next stream of torch's pool. These variants put
the same decode copy on different streams (Python hooks, fp32 allreduce, so only the copy's
placement differs) beside commtune's Cast(bf16) and no hook: interleaved repetitions, median
ms per iteration and the median of per-repetition ratios to no hook.
"""
import argparse

import torch
import torch.distributed as dist
from torch import nn

from .. import hooks
from .common import (environment, format_rows, init_gpu_process_group, interleaved, make_ddp, paired_ratios,
                     summary, timed_chunk, training_step, write_results)


def _wire(state, buf):
    """A bf16 buffer per bucket, kept: the copies below read it (its values do not matter)."""
    if buf.data_ptr() not in state:
        state[buf.data_ptr()] = torch.zeros_like(buf, dtype=torch.bfloat16)
    return state[buf.data_ptr()]


def copy_on_pool_stream(state, bucket, elements=None):
    buf, wire = bucket.buffer(), _wire(state, bucket.buffer())

    def decode(fut):
        out = fut.value()[0]
        out[:elements].copy_(wire[:elements])
        return out

    return dist.all_reduce(buf, async_op=True).get_future().then(decode)


def copy_on_one_stream(state, bucket):
    buf, wire = bucket.buffer(), _wire(state, bucket.buffer())
    side = state.setdefault("side", torch.cuda.Stream())

    def decode(fut):
        out, current = fut.value()[0], torch.cuda.current_stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            out.copy_(wire)
        current.wait_stream(side)
        return out

    return dist.all_reduce(buf, async_op=True).get_future().then(decode)


def copy_on_compute_stream_at_the_end(state, bucket):
    """Every bucket's copy on backward's stream, queued once the last bucket is launched."""
    buf, wire = bucket.buffer(), _wire(state, bucket.buffer())
    pending = state.setdefault("pending", [])
    result = torch.futures.Future(devices=[buf.device])
    pending.append((dist.all_reduce(buf, async_op=True), buf, wire, result))
    if bucket.is_last():
        for work, b, w, r in pending:
            work.wait()
            b.copy_(w)
            r.set_result(b)
        pending.clear()
    return result


VARIANTS = {
    "no hook": None,
    "commtune Cast(bf16)": lambda: hooks.Cast(torch.bfloat16),
    "copy in then(), pool stream": lambda: (dict, copy_on_pool_stream),
    "1-element copy in then(), pool stream": lambda: (dict, lambda s, b: copy_on_pool_stream(s, b, elements=1)),
    "copy in then(), one fixed stream": lambda: (dict, copy_on_one_stream),
    "copy on backward's stream at the end": lambda: (dict, copy_on_compute_stream_at_the_end),
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default="benchmarks/results/continuation_streams.json")
    args = p.parse_args(argv)
    device = init_gpu_process_group(port=29561)
    import torchvision

    x = torch.randn(args.batch, 3, 224, 224, device=device).to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (args.batch,), device=device)
    runners = {}
    for name, make in VARIANTS.items():
        torch.manual_seed(0)
        model = torchvision.models.resnet50().to(device, memory_format=torch.channels_last)
        ddp = make_ddp(model, make() if make else None, device, 25.0)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        step = training_step(ddp, opt, lambda m: nn.functional.cross_entropy(m(x), y))
        for _ in range(args.warmup):
            step()
        runners[name], _ = timed_chunk(step, args.iters)
        print(f"built and warmed up: {name}")
    times = interleaved(runners, args.reps)
    results = {name: {"ms_per_iteration": summary(v), "ratio_to_no_hook": summary(paired_ratios(v, times["no hook"]))}
               for name, v in times.items()}
    print(format_rows(["variant", "ms/iter", "x no hook"],
                      [[n, f"{r['ms_per_iteration']['median']:.2f}", f"{r['ratio_to_no_hook']['median']:.4f}"]
                       for n, r in results.items()]))
    write_results(args.out, {"benchmark": "continuation_streams", "environment": environment(), "args": vars(args),
                             "results": results})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
