"""`python -m commtune tune nccl`: measured NCCL settings for the messages a model sends.

For the bucket sizes DDP makes of a model's gradients, each candidate setting is measured in
fresh processes (NCCL reads most variables once per process) with the collective sweep; the
fastest measured candidate wins each size range, and the profile JSON says how much every
candidate gained or lost against the default. Only measured candidates are ever recommended: a
candidate whose run fails is reported and left out.
"""
import json
import os
import subprocess
import sys
import tempfile

from .bench.common import format_rows
from .nccl import Settings

CANDIDATES = {
    "default": Settings(),
    "ring": Settings(algo="ring"),
    "tree": Settings(algo="tree"),
    "simple": Settings(proto="simple"),
    "no_ll128": Settings(proto="^ll128"),
    "buffsize_16MiB": Settings(buffsize="16MiB"),
}


def bucket_sizes(parameter_bytes, bucket_cap_mb=25.0, first_bucket_mb=1.0):
    """The bucket sizes (bytes) DDP's rebuilt buckets come to: parameters in reverse order,
    a bucket closes once it reaches its cap (the first bucket's cap is first_bucket_mb)."""
    sizes, current, cap = [], 0, first_bucket_mb * 2**20
    for nbytes in reversed(list(parameter_bytes)):
        current += nbytes
        if current >= cap:
            sizes.append(current)
            current, cap = 0, bucket_cap_mb * 2**20
    if current:
        sizes.append(current)
    return sizes


def model_bucket_sizes(model_name, bucket_cap_mb):
    """Bucket sizes of a torchvision model (fp32 gradients)."""
    try:
        import torchvision
    except ImportError:
        raise SystemExit("--model needs torchvision, which is not installed; give the message sizes with "
                         "--sizes instead (e.g. --sizes 1MiB 25MiB)") from None

    if not hasattr(torchvision.models, model_name):
        raise ValueError(f"unknown torchvision model {model_name!r}")
    model = getattr(torchvision.models, model_name)()
    return bucket_sizes((p.numel() * 4 for p in model.parameters()), bucket_cap_mb)


def measure(candidate, settings, sizes, ranks, iters, workdir):
    """Runs the sweep for `sizes` in fresh processes with the candidate's variables; returns
    {size: seconds}, or raises RuntimeError with the run's output."""
    out = os.path.join(workdir, f"{candidate}.json")
    env = dict(os.environ, **settings.environment())
    cmd = [sys.executable, "-m", "commtune", "bench", "allreduce", "--ops", "all_reduce", "--iters", str(iters),
           "--out", out, "--sizes", *map(str, sizes)] + (["--ranks", str(ranks)] if ranks else [])
    run = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"candidate {candidate} failed (exit {run.returncode}):\n{run.stderr[-2000:]}")
    with open(out) as f:
        rows = json.load(f)["rows"]
    return {r["bytes"]: r["time_us"] / 1e6 for r in rows}


def choose(times, default="default"):
    """Per size, the fastest measured candidate; consecutive sizes with one winner form a range."""
    sizes = sorted(next(iter(times.values())))
    ranges = []
    for size in sizes:
        best = min(times, key=lambda c: times[c][size])
        entry = {"candidate": best, "time_us": times[best][size] * 1e6,
                 "default_time_us": times[default][size] * 1e6 if default in times else None}
        if ranges and ranges[-1]["candidate"] == best:
            ranges[-1]["max_bytes"] = size
            ranges[-1]["sizes"].append(size)
        else:
            ranges.append({"min_bytes": size, "max_bytes": size, "sizes": [size], **entry})
    return ranges


def _single(value, names):
    """The one name a setting forces (e.g. algo="ring"), or "*" when it forces none or several."""
    if value is None or any(c in value for c in "^;,:"):
        return "*"
    value = value.strip().lower()
    return value if value in names else "*"


def write_rules(profile, path):
    """The rules file the NCCL tuner plugin reads (COMMTUNE_TUNER_RULES): for each size range
    whose winner forces an algorithm or a protocol, `allreduce min max algorithm protocol`.
    Winners that force neither (the default, buffer sizes) leave NCCL's own choice; returns the
    number of rules written."""
    from .nccl import ALGORITHMS, PROTOCOLS

    lines = ["# commtune NCCL tuner rules: collective min_bytes max_bytes algorithm protocol"]
    ranges = profile["ranges"]
    for i, r in enumerate(ranges):
        env = profile["candidates"][r["candidate"]]
        algo = _single(env.get("NCCL_ALGO"), ALGORITHMS)
        proto = _single(env.get("NCCL_PROTO"), PROTOCOLS)
        if algo == "*" and proto == "*":
            continue
        # Between measured sizes the nearer measurement decides: ranges meet halfway.
        low = 0 if i == 0 else (ranges[i - 1]["max_bytes"] + r["min_bytes"]) // 2 + 1
        high = 2**64 - 1 if i == len(ranges) - 1 else (r["max_bytes"] + ranges[i + 1]["min_bytes"]) // 2
        lines.append(f"allreduce {low} {high} {algo} {proto}")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return len(lines) - 1


def tune(sizes, candidates, ranks=None, iters=20, out="nccl_profile.json", say=print):
    """Measures every candidate on `sizes`, writes the profile, returns it."""
    times, failed = {}, {}
    with tempfile.TemporaryDirectory() as workdir:
        for i, (name, settings) in enumerate(candidates.items(), 1):
            say(f"candidate {i}/{len(candidates)}: {name} {settings.environment() or '(NCCL defaults)'}")
            try:
                times[name] = measure(name, settings, sizes, ranks, iters, workdir)
            except RuntimeError as e:
                failed[name] = str(e)
                say(f"  failed, left out: {str(e).splitlines()[0]}")
    if "default" not in times:
        raise RuntimeError("the default candidate could not be measured; nothing to compare with")
    measured_sizes = sorted(times["default"])
    ranges = choose(times)
    total = {name: sum(t.values()) for name, t in times.items()}
    best = min(total, key=total.get)
    gains = {name: total["default"] / t - 1 for name, t in total.items()}
    profile = Settings(**candidates[best].to_dict())
    profile.save_profile(out, chosen=best, ranges=ranges, sizes=measured_sizes,
                         candidates={n: candidates[n].environment() for n in times},
                         gain_vs_default=gains, failed=failed,
                         times_us={n: {str(s): t * 1e6 for s, t in ts.items()} for n, ts in times.items()})
    rows = [[name, f"{total[name] * 1e6:.1f}", f"{gains[name]:+.1%}"] for name in times]
    say(format_rows(["candidate", "sum of times (us)", "vs default"], rows))
    say(f"chosen: {best}; per size range: " +
        ", ".join(f"{r['min_bytes']}-{r['max_bytes']} B {r['candidate']}" for r in ranges))
    with open(out) as f:
        written = json.load(f)
    rules = os.path.splitext(out)[0] + ".rules"
    count = write_rules(written, rules)
    say(f"profile written to {out} (load with commtune.nccl.Settings.from_profile); {count} per-size "
        f"rule(s) for the tuner plugin in {rules} (NCCL_TUNER_PLUGIN=.../libcommtune_nccl_tuner.so "
        f"COMMTUNE_TUNER_RULES={rules})")
    return written


def main(argv=None):
    import argparse

    p = argparse.ArgumentParser(prog="python -m commtune tune nccl", description=__doc__)
    p.add_argument("--model", default="resnet50", help="torchvision model whose bucket sizes to tune for")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--sizes", nargs="+", default=None, help="message sizes (bytes or '16MiB') instead of a model's")
    p.add_argument("--candidates", nargs="+", default=list(CANDIDATES), choices=list(CANDIDATES))
    p.add_argument("--ranks", type=int, default=None, help="ranks (default: every GPU, or 2 CPU ranks)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default="nccl_profile.json")
    args = p.parse_args(argv)
    from .nccl import parse_size

    sizes = ([parse_size(s, "--sizes") for s in args.sizes] if args.sizes
             else model_bucket_sizes(args.model, args.bucket_cap_mb))
    sizes = sorted(set(sizes))
    if "default" not in args.candidates:
        args.candidates.insert(0, "default")
    tune(sizes, {c: CANDIDATES[c] for c in args.candidates}, args.ranks, args.iters, args.out)
