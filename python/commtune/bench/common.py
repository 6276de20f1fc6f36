"""What every benchmark shares: the environment record, interleaved timing, results files."""
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import hooks, launch, registration
from ..launch import NO_MULTICAST


def environment():
    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["gpus"] = torch.cuda.device_count()
        env["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
    return env


def summary(values):
    """Median and spread of repeated measurements."""
    values = sorted(values)
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"median": statistics.median(values), "min": values[0], "max": values[-1],
            "q1": q[0], "q3": q[2], "n": len(values), "values": values}


def interleaved(runners, reps, progress=print):
    """Times every runner once per repetition, rotating the order (A B C, B C A, ...).

    runners: {name: callable returning one measurement}. Returns {name: [measurement per rep]}.
    """
    names = list(runners)
    out = {n: [] for n in names}
    for rep in range(reps):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            out[name].append(runners[name]())
        progress(f"  repetition {rep + 1}/{reps} done")
    return out


def paired_ratios(values, baseline):
    """Per-repetition ratio to the baseline measured in the same repetition."""
    return [v / b for v, b in zip(values, baseline)]


def write_results(path, payload):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"results written to {path}")


def format_rows(header, rows):
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).rjust(w) for c, w in zip(r, widths))
    return "\n".join([line(header)] + [line(r) for r in rows])


SPIN_CYCLES = 2_000_000  # about 1 ms at H200 clocks: longer than enqueueing any pass timed here


def cuda_time_ms(fn, iters, warmup=3, queued=False):
    """Median of `iters` CUDA-event timings of fn(), from an idle device: the time includes the
    host's launch latency (the device waits for each launch). With `queued`, each call is
    enqueued behind a spin kernel (about a millisecond) so the device runs it back to back, as
    in a training step where earlier work hides the launches: the kernels' own time."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if queued:
            torch.cuda._sleep(SPIN_CYCLES)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def init_gpu_process_group(port):
    """One process per GPU under torchrun, or this process alone on GPU 0. Returns the device."""
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU (it measures on NCCL)")
    os.environ.update(NO_MULTICAST)
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        launch.init("nccl", int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    torch.backends.cudnn.benchmark = True
    return torch.device("cuda", torch.cuda.current_device())


def make_ddp(model, hook, device, bucket_mb):
    """DDP around `model` with one of: None (no hook), "builtin" (torch's C++ ALLREDUCE), a torch
    Python hook, (state_factory, torch hook), or a commtune hook config."""
    kw = dict(device_ids=[device.index], bucket_cap_mb=bucket_mb)
    if isinstance(hook, hooks.HookConfig):
        return registration.wrap(model, hook=hook, **kw)
    ddp = DDP(model, **kw)
    if hook == "builtin":
        ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    elif isinstance(hook, tuple):
        state_factory, fn = hook
        ddp.register_comm_hook(state_factory(), fn)
    elif hook is not None:
        ddp.register_comm_hook(None, hook)
    return ddp


def training_step(ddp, opt, loss_of):
    """One training iteration under bf16 autocast: loss_of(ddp), backward, optimizer step."""

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_of(ddp)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def timed_chunk(step, iters):
    """run() times `iters` calls of step() and returns the median iteration in ms (CUDA events
    between iterations, so a stray slow one does not move it). host_ms collects the host time
    to issue each chunk per iteration: close to the GPU's figure means the GPU waited for the CPU."""
    host_ms = []

    def run():
        events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
        torch.cuda.synchronize()
        started = time.perf_counter()
        events[0].record()
        for i in range(iters):
            step()
            events[i + 1].record()
        host_ms.append((time.perf_counter() - started) * 1e3 / iters)
        torch.cuda.synchronize()
        return statistics.median(a.elapsed_time(b) for a, b in zip(events, events[1:]))

    return run, host_ms


def profile_variants(steps, trace_dir, iters=5):
    """Where each variant's time goes: the top CUDA kernels and host ops of each in one table
    file, and one Chrome trace per variant (gzipped) to compare their timelines."""
    import gzip
    import shutil

    from torch.profiler import ProfilerActivity, profile

    os.makedirs(trace_dir, exist_ok=True)
    with open(os.path.join(trace_dir, "kernels.txt"), "w") as table:
        for name, step in steps.items():
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(iters):
                    step()
                torch.cuda.synchronize()
            table.write(f"== {name} ({iters} iterations)\n")
            averages = prof.key_averages()
            table.write(averages.table(sort_by="cuda_time_total", row_limit=40) + "\n")
            table.write(averages.table(sort_by="cpu_time_total", row_limit=15) + "\n")
            trace = os.path.join(trace_dir, "trace_" + "".join(c if c.isalnum() else "_" for c in name) + ".json")
            prof.export_chrome_trace(trace)
            with open(trace, "rb") as src, gzip.open(trace + ".gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.remove(trace)
    print(f"profiles written to {trace_dir}")
