"""How long communication takes and how much of it backward hides: a link model (alpha + bytes
over bus bandwidth per allreduce, nccl-tests' definition), DDP's bucketing replayed on a measured
backward timeline, and the bucket planner built on both.

The timeline comes from one GPU (or CPU): when each parameter's gradient became ready during
backward. Buckets fill in that order until they reach their cap (as DDP's rebuilt buckets do), a bucket
is sent when its last gradient is ready and after the previous bucket's send, and whatever is
still sending when backward ends is exposed. A hook's own GPU work (encoding, decoding) runs when
its bucket is ready, before the send, and shares the GPU with backward: it delays the send and
every later gradient by its length.
"""
import json
import statistics
import time
from dataclasses import dataclass, field

import torch

MB = 1024 * 1024


@dataclass(frozen=True)
class Link:
    """An allreduce of S bytes on n ranks takes alpha_us + S * 2(n-1)/n / busbw."""

    name: str
    alpha_us: float
    busbw_GBps: float

    def allreduce_us(self, nbytes, ranks):
        if ranks <= 1:
            return 0.0
        return self.alpha_us + nbytes * 2 * (ranks - 1) / ranks / (self.busbw_GBps * 1e3)

    @classmethod
    def from_sweep(cls, path_or_dict, name="measured"):
        """Least-squares alpha and busbw from `benchmarks/allreduce_sweep.py`'s all_reduce rows."""
        data = path_or_dict if isinstance(path_or_dict, dict) else json.load(open(path_or_dict))
        n = data["world_size"]
        rows = [r for r in data["rows"] if r["op"] == "all_reduce"]
        if n < 2 or len(rows) < 2:
            raise ValueError("Link.from_sweep needs all_reduce rows measured on 2 or more ranks")
        xs = [r["bytes"] * 2 * (n - 1) / n for r in rows]
        ys = [r["time_us"] for r in rows]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        if slope <= 0:
            raise ValueError("the sweep's times do not grow with size: cannot fit a bandwidth")
        return cls(name, max(0.0, my - slope * mx), 1e-3 / slope)


# Assumed, not measured here: NVLink4 through NVSwitch with multicast off (published 8-GPU
# Hopper all_reduce busbw ~370 GB/s), PCIe 4.0 x16 rings, and one NIC per GPU across nodes.
PRESETS = {
    "nvlink4-nvswitch": Link("nvlink4-nvswitch", 15.0, 360.0),
    "pcie4": Link("pcie4", 20.0, 20.0),
    "ib-100g": Link("ib-100g", 30.0, 11.0),
    "ib-400g": Link("ib-400g", 30.0, 45.0),
}


def link_of(link):
    """A Link from a Link, a preset name, or a sweep JSON path."""
    if isinstance(link, Link):
        return link
    if link in PRESETS:
        return PRESETS[link]
    if isinstance(link, str) and link.endswith(".json"):
        return Link.from_sweep(link)
    raise ValueError(f"link must be a commtune.sim.Link, one of {', '.join(PRESETS)}, or an allreduce "
                     f"sweep JSON path; got {link!r}")


@dataclass
class BackwardTimeline:
    """Gradients in the order they became ready: (bytes, ready_us after backward started[, shape])."""

    gradients: list
    backward_us: float
    forward_us: float = 0.0

    def to_dict(self):
        return {"gradients": [list(g) for g in self.gradients], "backward_us": self.backward_us,
                "forward_us": self.forward_us}

    @classmethod
    def from_dict(cls, d):
        return cls([tuple(g[:2]) + tuple(tuple(x) for x in g[2:]) for g in d["gradients"]], d["backward_us"],
                   d.get("forward_us", 0.0))


@dataclass
class Prediction:
    bucket_cap_mb: float
    first_bucket_mb: float
    buckets: list = field(default_factory=list)  # (bytes, ready_us, start_us, end_us)
    comm_us: float = 0.0
    exposed_us: float = 0.0
    hook_us: float = 0.0  # the hooks' GPU work, all buckets


def powersgd_wire_bytes(nbytes, shape, rank, min_compression_rate=2.0):
    """What PowerSGD sends for one gradient (torch's rule: matrices, conv weights as
    shape[0] x the rest, are compressed when (rows + cols) * rank * min_compression_rate
    < rows * cols; P and Q go out, rows * rank and cols * rank values)."""
    if shape is None or len(shape) <= 1:
        return nbytes
    rows = shape[0]
    cols = 1
    for d in shape[1:]:
        cols *= d
    if (rows + cols) * rank * min_compression_rate < rows * cols:
        return nbytes * (rows + cols) * rank / (rows * cols)
    return nbytes


def replay(timeline, link, ranks, bucket_cap_mb, first_bucket_mb=None, wire_factor=1.0, powersgd_rank=0,
           hook_us_per_mb=0.0):
    """DDP's buckets on this timeline and their sends on this link (see the module's doc).
    `wire_factor`: bytes a hook puts on the wire per gradient byte (0.5 for a bf16 cast);
    `powersgd_rank`: PowerSGD's rule instead (needs the gradients' shapes);
    `hook_us_per_mb`: the hook's GPU time per MB of bucket."""
    first_cap = (first_bucket_mb if first_bucket_mb is not None else bucket_cap_mb) * MB
    cap = bucket_cap_mb * MB
    buckets, size, wire, ready = [], 0, 0.0, 0.0
    for nbytes, at, *shape in timeline.gradients:
        # DDP's rule (compute_bucket_assignment_by_size): add, then close once at the limit.
        size, ready = size + nbytes, max(ready, at)
        wire += (powersgd_wire_bytes(nbytes, shape[0] if shape else None, powersgd_rank) if powersgd_rank
                 else nbytes * wire_factor)
        if size >= (first_cap if not buckets else cap):
            buckets.append((size, wire, ready))
            size, wire, ready = 0, 0.0, 0.0
    if size:
        buckets.append((size, wire, ready))
    pred = Prediction(bucket_cap_mb, first_bucket_mb if first_bucket_mb is not None else bucket_cap_mb)
    free = delay = 0.0
    for nbytes, wire, at in buckets:
        at += delay  # the GPU work of earlier buckets' hooks came first
        work = hook_us_per_mb * nbytes / MB
        delay += work
        start = max(at + work, free)
        cost = link.allreduce_us(wire, ranks)
        free = start + cost
        pred.buckets.append((nbytes, at, start, free))
        pred.comm_us += cost
    pred.hook_us = delay
    pred.exposed_us = max(0.0, free - (timeline.backward_us + delay))
    return pred


def measure_backward(model, sample_batch, loss_fn=None, iters=3):
    """When each parameter's gradient becomes ready in backward.

    Stamping every gradient costs host time, which a launch-bound backward turns into GPU time
    (ResNet-50 at batch 128 on the H200 we measure on: 32 ms of backward stamped, 17 ms plain). So forward and
    backward are timed in plain runs, the order and relative ready times come from stamped runs,
    and the ready times are scaled to the plain backward's length. Medians over `iters` runs each.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("measure_backward: the model has no parameters that require grad")
    if iters < 1:
        raise ValueError(f"measure_backward: iters must be >= 1, got {iters}")
    device = params[0].device
    cuda = device.type == "cuda"
    loss_fn = loss_fn or (lambda m, b: m(*b if isinstance(b, (tuple, list)) else (b,)).float().mean())
    # Stamps made once and reused: creating a CUDA event per gradient would add to what is measured.
    stamps = [torch.cuda.Event(enable_timing=True) for _ in range(len(params) + 3)] if cuda else None

    def stamp(i):
        if cuda:
            stamps[i].record()
            return stamps[i]
        return time.perf_counter()

    def between(a, b):
        return a.elapsed_time(b) * 1e3 if cuda else (b - a) * 1e6

    def run(marks=None):
        model.zero_grad(set_to_none=True)
        if marks is not None:
            marks.clear()
        begin = stamp(0)
        loss = loss_fn(model, sample_batch)
        started = stamp(1)
        loss.backward()
        ended = stamp(2)
        if cuda:
            torch.cuda.synchronize(device)
        return begin, started, ended

    plain = []
    for _ in range(iters):
        begin, started, ended = run()
        plain.append((between(begin, started), between(started, ended)))
    forward_us = statistics.median(f for f, _ in plain)
    backward_us = statistics.median(b for _, b in plain)

    marks = []
    handles = [p.register_post_accumulate_grad_hook(lambda p: marks.append((p, stamp(3 + len(marks)))))
               for p in params]
    stamped = []
    try:
        for _ in range(iters):
            _, started, ended = run(marks)
            total = between(started, ended)
            stamped.append((total, [(p, between(started, mark) / total if total > 0 else 1.0) for p, mark in marks]))
    finally:
        for h in handles:
            h.remove()
    _, fractions = sorted(stamped, key=lambda s: s[0])[len(stamped) // 2]
    gradients = [(p.numel() * p.element_size(), min(f, 1.0) * backward_us, tuple(p.shape)) for p, f in fractions]
    return BackwardTimeline(gradients, backward_us, forward_us)


@dataclass
class BucketPlan:
    bucket_cap_mb: float
    first_bucket_mb: float
    predicted_exposed_us: float
    candidates: list  # a Prediction per (cap, first bucket) tried, best first
    timeline: BackwardTimeline

    def ddp_kwargs(self):
        """What to pass to DDP (or ct.wrap). A first bucket smaller than the cap is DDP's default
        only with the default cap (25 MB, first 1 MB)."""
        return {"bucket_cap_mb": self.bucket_cap_mb}


def plan_buckets(model, sample_batch, link="nvlink4-nvswitch", ranks=8, loss_fn=None,
                 caps_mb=(1, 2, 4, 8, 16, 25, 50, 100), first_buckets_mb=(None, 1), iters=3):
    """The bucket cap (and first-bucket size) that minimises the communication left exposed
    after backward, for `ranks` ranks on `link`, from this model's measured backward."""
    link = link_of(link)
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"plan_buckets: ranks must be an integer >= 1, got {ranks!r}")
    timeline = measure_backward(model, sample_batch, loss_fn, iters)
    candidates = []
    for cap in caps_mb:
        for first in first_buckets_mb:
            if first is None or first < cap:
                candidates.append(replay(timeline, link, ranks, cap, first))
    candidates.sort(key=lambda p: (p.exposed_us, len(p.buckets)))
    best = candidates[0]
    return BucketPlan(best.bucket_cap_mb, best.first_bucket_mb, best.exposed_us, candidates, timeline)


@dataclass(frozen=True)
class Config:
    """One row of a scaling study, as the simulator sees it."""

    name: str
    bucket_cap_mb: float = 25.0
    first_bucket_mb: float = 1.0  # DDP's default first bucket; None: the cap
    wire_factor: float = 1.0  # bytes on the wire per gradient byte
    powersgd_rank: int = 0  # PowerSGD at this rank (its own rule for the wire bytes)
    link_scale: float = 1.0  # the link's bandwidth times this (an NCCL setting's measured gain)
    accumulation: int = 1  # micro-steps per communicating step
    overlap_optimizer: bool = False
    hook_us_per_mb: float = 0.0  # the hook's GPU work (encode + decode) per MB of bucket


def predict(timeline, link, ranks, config, optimizer_us=0.0):
    """Iteration time on `ranks` ranks from one rank's measured timeline (weak scaling: the same
    batch per rank). An iteration is `accumulation` micro-steps of forward + backward, the
    communication left exposed after the last backward, the hook's GPU work (it shares the GPU
    with backward), and the optimizer step (with `overlap_optimizer`, only the share of the last
    bucket's parameters stays exposed).
    Speedup is throughput against one rank running forward, backward and the step alone."""
    link = link_of(link)
    if config.link_scale != 1.0:
        link = Link(link.name, link.alpha_us, link.busbw_GBps * config.link_scale)
    pred = replay(timeline, link, ranks, config.bucket_cap_mb, config.first_bucket_mb, wire_factor=config.wire_factor,
                  powersgd_rank=config.powersgd_rank, hook_us_per_mb=config.hook_us_per_mb)
    compute = timeline.forward_us + timeline.backward_us
    step = optimizer_us
    if config.overlap_optimizer and pred.buckets:
        total = sum(b[0] for b in pred.buckets)
        step = optimizer_us * pred.buckets[-1][0] / total
    iteration = config.accumulation * compute + pred.hook_us + pred.exposed_us + step
    single = compute + optimizer_us
    speedup = ranks * config.accumulation * single / iteration
    return {"config": config.name, "ranks": ranks, "iteration_us": iteration, "exposed_us": pred.exposed_us,
            "comm_us": pred.comm_us, "hook_us": pred.hook_us, "buckets": len(pred.buckets), "speedup": speedup,
            "efficiency": speedup / ranks}
