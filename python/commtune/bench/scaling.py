"""The ResNet-50 scaling study: one rank's throughput, then every configuration on N ranks, each
a torchrun of examples/resnet50_ddp.py in fresh processes (NCCL reads its variables once per
process). Per row: communication and exposed communication per iteration (commtune's counters),
iteration time, throughput, speedup against one rank and scaling efficiency, with the
simulator's prediction beside it (from one rank's measured backward and a link model).

    python benchmarks/resnet50_scaling.py                   # every GPU: 1, 2, 4, ... ranks
    python benchmarks/resnet50_scaling.py --cpu             # 2 gloo ranks, a small model, 2 rows
    python benchmarks/resnet50_scaling.py --from results.json --predict-ranks 64 --link ib-400g
"""
import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from .. import sim
from .common import environment, format_rows, write_results

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "resnet50_ddp.py"

DEFAULT = "default DDP (AllReduce)"
# name -> (flags for the example, the simulator's view). NCCL settings change what the link
# delivers, which the simulator does not know: it predicts those rows as the default.
CONFIGS = {
    DEFAULT: ([], sim.Config("default")),
    "NCCL tree": (["--nccl-algo", "tree"], sim.Config("tree")),
    "NCCL 16 MiB buffers": (["--nccl-buffsize", "16MiB"], sim.Config("buffsize")),
    "bf16 on the wire": (["--hook", "bf16"], sim.Config("bf16", wire_factor=0.5)),
    "PowerSGD rank 4": (["--hook", "powersgd"], sim.Config("powersgd", powersgd_rank=4)),
    "optimizer overlap": (["--overlap-optimizer"], sim.Config("overlap", overlap_optimizer=True)),
    "accumulate 4": (["--accumulate", "4"], sim.Config("accumulate", accumulation=4)),
}
CPU_CONFIGS = [DEFAULT, "bf16 on the wire"]
# This machine's gloo allreduce on 2 ranks, fitted by benchmarks/plan_buckets.py (plan_buckets.json).
CPU_LINK = sim.Link("gloo, 2 CPU ranks (fitted)", alpha_us=231.0, busbw_GBps=1.12)


def run_example(ranks, flags, common, timeout_s):
    """One torchrun of the example; returns its figures."""
    if not EXAMPLE.exists():
        raise SystemExit(f"the scaling study runs {EXAMPLE}, which is missing (run it from a commtune checkout)")
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.jsonl")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               str(EXAMPLE), *common, *flags, "--result", result]
        env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
               "NVSHMEM_DISABLE_NVLS": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0 or not os.path.exists(result):
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        with open(result) as f:
            return json.loads(f.readline())


def one_rank_timeline(model_name, batch, device):
    """The simulator's input: one rank's backward timeline and optimizer step time."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("resnet50_ddp", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    torch.manual_seed(0)
    amp = device.type == "cuda"
    # As the example trains: channels_last and cuDNN's autotuner on GPUs.
    layout = torch.channels_last if amp else torch.contiguous_format
    torch.backends.cudnn.benchmark = True
    model = example.build_model(model_name).to(device, memory_format=layout)
    size = 224 if model_name != "tiny" else 64
    x = torch.randn(batch, 3, size, size, device=device).to(memory_format=layout)
    y = torch.randint(0, 1000, (batch,), device=device)

    def loss_fn(m, _):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            return torch.nn.functional.cross_entropy(m(x), y)

    timeline = sim.measure_backward(model, None, loss_fn, iters=5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    for _ in range(3):
        opt.step()
    if amp:
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(5):
        opt.step()
    if amp:
        torch.cuda.synchronize()
    return timeline, (time.perf_counter() - started) / 5 * 1e6


def hooked(name):
    """Whether the configuration runs a communication hook (a cost of its own on the GPU)."""
    return "--hook" in CONFIGS.get(name, ([], None))[0]


def hook_cost_per_mb(rows, name, timeline):
    """A hook's GPU time per MB of bucket, for the simulator: what the configuration's one-rank row
    took beyond the default's (at one rank a hook's work has nothing to hide behind), over the
    model's gradient bytes. None without both one-rank rows or for a configuration without a hook.
    Run-to-run spread enters it whole: at batch 128 on a host-bound machine, +-1-2 ms."""
    if not hooked(name):
        return None
    one = {r["config"]: r["iteration_ms"] for r in rows if r["ranks"] == 1}
    if name not in one or DEFAULT not in one:
        return None
    total_mb = sum(g[0] for g in timeline.gradients) / sim.MB
    return max(0.0, one[name] - one[DEFAULT]) * 1e3 / total_mb


def view_with_costs(view, rows, name, timeline):
    cost = hook_cost_per_mb(rows, name, timeline)
    return view if cost is None else dataclasses.replace(view, hook_us_per_mb=cost)


def predict_from(path, ranks, link):
    """Every configuration predicted at these rank counts from a saved study's one-rank timeline:
    "what if 64 GPUs over 400 Gb/s?" without running anything."""
    data = json.load(open(path))
    if "timeline" not in data.get("one_rank", {}):
        raise SystemExit(f"{path} holds no one-rank timeline (written by this benchmark since 2026-12-03)")
    timeline = sim.BackwardTimeline.from_dict(data["one_rank"]["timeline"])
    step_us = data["one_rank"]["optimizer_us"]
    table = []
    for name, (_, view) in CONFIGS.items():
        view = view_with_costs(view, data.get("rows", []), name, timeline)
        for n in ranks:
            p = sim.predict(timeline, link, n, view, optimizer_us=step_us) if view else None
            table.append([name, str(n), f"{p['iteration_us'] / 1e3:.1f}" if p else "-",
                          f"{p['exposed_us'] / 1e3:.2f}" if p else "-", f"{100 * p['efficiency']:.0f}%" if p else "-"])
    print(f"{data['model']}, batch {data['batch']} per rank, on {link.name} (alpha {link.alpha_us} us, "
          f"busbw {link.busbw_GBps} GB/s)")
    print(format_rows(["config", "ranks", "predicted ms", "exposed ms", "efficiency"], table))
    return table


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="gloo ranks and a small model (default without GPUs)")
    p.add_argument("--ranks", type=int, nargs="+", default=None, help="rank counts (default 1, 2, 4, ... GPUs; CPU: 2)")
    p.add_argument("--configs", nargs="+", default=None, choices=sorted(CONFIGS), metavar="CONFIG")
    p.add_argument("--batch", type=int, default=None, help="per rank (default 128 on GPUs, 8 on CPU)")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--link", default=None, help="simulator link: a preset or an allreduce sweep JSON")
    p.add_argument("--tuned-profile", default=None,
                   help="add an 'auto-tuned' row: NCCL settings from this `commtune tune nccl` profile")
    p.add_argument("--predict-ranks", type=int, nargs="+", default=[8],
                   help="also predict every row at these rank counts (default 8)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per run")
    p.add_argument("--out", default="benchmarks/results/resnet50_scaling.json")
    p.add_argument("--from", dest="saved", default=None,
                   help="predict only, from this saved study's one-rank timeline (at --predict-ranks, on --link)")
    args = p.parse_args(argv)
    if args.saved:
        return predict_from(args.saved, args.predict_ranks, sim.link_of(args.link or "nvlink4-nvswitch"))
    cpu = args.cpu or not torch.cuda.is_available()
    model = "tiny" if cpu else "resnet50"
    batch = args.batch or (8 if cpu else 128)
    ranks = args.ranks or ([2] if cpu else [2 ** k for k in range(8) if 2 ** k <= torch.cuda.device_count()][1:])
    configs = args.configs or (CPU_CONFIGS if cpu else list(CONFIGS))
    link = CPU_LINK if cpu and args.link is None else sim.link_of(args.link or "nvlink4-nvswitch")
    common = ["--model", model, "--batch", str(batch), "--iters", str(args.iters), "--warmup", str(args.warmup)]

    device = torch.device("cpu") if cpu else torch.device("cuda", 0)
    timeline, step_us = one_rank_timeline(model, batch, device)
    configs_here = dict(CONFIGS)
    if args.tuned_profile:
        # The simulator cannot know what a NCCL setting gains: it predicts the default's time.
        configs_here["auto-tuned (NCCL profile)"] = (["--nccl-profile", args.tuned_profile], sim.Config("tuned"))
        configs = configs + ["auto-tuned (NCCL profile)"]
    # One rank first: the default (the speedups' base), and every hooked configuration, whose
    # one-rank time gives the simulator its hook's GPU cost.
    runs = [(1, DEFAULT)] + [(1, c) for c in configs if hooked(c) and c != DEFAULT]
    runs += [(n, c) for n in ranks for c in configs if (n, c) not in runs]
    rows, started = [], time.monotonic()
    payload = {"benchmark": "resnet50_scaling", "environment": environment(), "args": vars(args), "model": model,
               "batch": batch, "link": vars(link),
               "one_rank": {"forward_us": timeline.forward_us, "backward_us": timeline.backward_us,
                            "optimizer_us": step_us, "gradients": len(timeline.gradients),
                            "timeline": timeline.to_dict()}, "rows": rows}
    for i, (n, name) in enumerate(runs):
        flags, view = configs_here[name]
        figures = run_example(n, flags, common, args.timeout)
        figures["config"] = name
        if view is not None:
            view = view_with_costs(view, rows + [figures], name, timeline)
            figures["hook_us_per_mb"] = view.hook_us_per_mb
            figures["predicted"] = sim.predict(timeline, link, n, view, optimizer_us=step_us)
            figures["predicted_at"] = {str(m): sim.predict(timeline, link, m, view, optimizer_us=step_us)
                                       for m in args.predict_ranks}
        rows.append(figures)
        write_results(args.out, payload)  # after every row: a long study keeps what it measured
        elapsed = time.monotonic() - started
        print(f"row {i + 1}/{len(runs)} done ({name}, {n} rank(s)): {figures['iteration_ms']:.1f} ms/iteration; "
              f"elapsed {elapsed:.0f} s, about {elapsed / (i + 1) * (len(runs) - i - 1):.0f} s to go", flush=True)
    single = rows[0]["samples_per_s"]
    for r in rows:
        r["speedup"] = r["samples_per_s"] / single
        r["efficiency"] = r["speedup"] / r["ranks"]
    table = [[r["config"], str(r["ranks"]), f"{r['comm_ms']:.2f}", f"{r['exposed_comm_ms']:.2f}",
              f"{r['iteration_ms']:.1f}", f"{r['samples_per_s']:.0f}", f"{r['speedup']:.2f}x",
              f"{100 * r['efficiency']:.0f}%",
              f"{r['predicted']['iteration_us'] / 1e3:.1f}" if "predicted" in r else "-",
              f"{100 * r['predicted']['efficiency']:.0f}%" if "predicted" in r else "-"] for r in rows]
    print(format_rows(["config", "ranks", "comm ms", "exposed ms", "iter ms", "samples/s", "speedup", "efficiency",
                       "predicted ms", "predicted eff."], table))
    for m in args.predict_ranks:
        print(f"predicted at {m} ranks on {link.name}: " + ", ".join(
            f"{r['config']} {100 * r['predicted_at'][str(m)]['efficiency']:.0f}%" for r in rows if "predicted_at" in r))
    write_results(args.out, payload)
    return rows


if __name__ == "__main__":
    main()
