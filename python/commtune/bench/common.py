"""What every benchmark shares: the environment record, interleaved timing, results files."""
import json
import os
import platform
import statistics
import sys
import time

import torch


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


def cuda_time_ms(fn, iters, warmup=3):
    """Median of `iters` CUDA-event timings of fn()."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
