"""The bucket planner's predicted exposed communication beside the measured one.

On every rank (gloo CPU ranks by default, NCCL GPUs when present): an allreduce sweep of this
machine's own link (fitted to alpha + bytes/busbw), the planner on the model's measured backward,
then DDP training at each candidate bucket cap with commtune's AllReduce, whose counters measure
the communication left after backward (exposed_comm_us). Rank 0 prints both per cap.
"""
import argparse

import torch
import torch.distributed as dist

from .. import hooks, launch, registration, sim
from . import allreduce_sweep
from .common import environment, format_rows, write_results


def _model(width, depth, device):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers).to(device)


def _link(device, world, sizes=(1 << 12, 1 << 16, 1 << 20, 1 << 22, 1 << 24), iters=5):
    """This machine's allreduce, timed as the allreduce sweep times it, and fitted."""
    rows = []
    for nbytes in sizes:
        seconds, measured = allreduce_sweep.time_op("all_reduce", nbytes, device, warmup=1, iters=iters)
        rows.append({"op": "all_reduce", "bytes": measured, "time_us": seconds * 1e6})
    return sim.Link.from_sweep({"world_size": world, "rows": rows}, name="this machine (fitted)"), rows


def _measured_exposed(model_fn, cap, x, iters, device):
    ddp = registration.wrap(model_fn(), hook=hooks.AllReduce(), bucket_cap_mb=cap,
                            device_ids=[device.index] if device.type == "cuda" else None)
    handle = registration.handle_of(ddp)
    for i in range(iters + 2):
        if i == 2:
            handle.reset_stats()  # after DDP's bucket rebuild
        ddp.zero_grad()
        ddp(x).float().square().mean().backward()
    s = handle.stats()
    return s["exposed_comm_us"] / max(1, s["timed_iterations"]), len(s["buckets"])


def _rank(rank, world, args):
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    say = print if rank == 0 else (lambda *a, **k: None)
    link, sweep = _link(device, world)
    say(f"link: alpha {link.alpha_us:.1f} us, busbw {link.busbw_GBps:.3f} GB/s (fitted from {len(sweep)} sizes)")
    model_fn = lambda: _model(args.width, args.depth, device)  # noqa: E731
    x = torch.randn(args.batch, args.width, device=device)
    plan = sim.plan_buckets(model_fn(), x, link=link, ranks=world, caps_mb=tuple(args.caps), first_buckets_mb=(None,),
                            loss_fn=lambda m, b: m(b).float().square().mean())
    predicted = {c.bucket_cap_mb: c for c in plan.candidates}
    rows, results = [], []
    for i, cap in enumerate(args.caps):
        exposed, buckets = _measured_exposed(model_fn, cap, x, args.iters, device)
        p = predicted[cap]
        results.append({"bucket_cap_mb": cap, "predicted_exposed_us": p.exposed_us, "measured_exposed_us": exposed,
                        "predicted_buckets": len(p.buckets), "measured_buckets": buckets,
                        "predicted_comm_us": p.comm_us})
        rows.append([f"{cap:g}", str(len(p.buckets)), str(buckets), f"{p.exposed_us:.0f}", f"{exposed:.0f}"])
        say(f"  cap {cap:g} MB done ({i + 1}/{len(args.caps)})")
    say(format_rows(["cap MB", "buckets (model)", "buckets (DDP)", "predicted exposed us", "measured exposed us"], rows))
    say(f"planner's choice: bucket_cap_mb={plan.bucket_cap_mb:g} (predicted exposed {plan.predicted_exposed_us:.0f} us)")
    if rank == 0:
        write_results(args.out, {"benchmark": "plan_buckets", "environment": environment(), "args": vars(args),
                                 "world_size": world, "backend": dist.get_backend(),
                                 "link": {"alpha_us": link.alpha_us, "busbw_GBps": link.busbw_GBps, "sweep": sweep},
                                 "backward_us": plan.timeline.backward_us, "choice": plan.bucket_cap_mb,
                                 "results": results})


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=None, help="default: every GPU, else 2 CPU ranks")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--caps", type=float, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", default="benchmarks/results/plan_buckets.json")
    args = p.parse_args(argv)
    launch.run_ranks(_rank, args=(args,), world_size=args.ranks)


if __name__ == "__main__":
    main()
