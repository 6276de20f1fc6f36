"""Traces and pictures: the Chrome trace of the latest timed iteration (2 gloo ranks), the
profiler ranges around the hook's phases, and the PNGs commtune.plot writes."""
import json

import pytest
import torch

import distributed
from models import BUCKET_CAP_MB, batch, loss_fn, make_model


def traced_run(rank, world_size, folder):
    import commtune as ct

    ddp = ct.wrap(make_model(), hook=ct.hooks.AllReduce(), bucket_cap_mb=BUCKET_CAP_MB)
    for step in range(3):
        ddp.zero_grad()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            loss_fn(ddp, *batch(rank, step)).backward()
    names = {e.key for e in prof.key_averages()}
    path = f"{folder}/trace_rank{rank}.json"
    count = ct.export_chrome_trace(ddp, path)
    return {"count": count, "path": path, "stats": ct.stats(ddp), "names": names}


def test_chrome_trace_holds_every_bucket_of_the_latest_iteration(tmp_path):
    for rank, r in enumerate(distributed.run(traced_run, 2, str(tmp_path))):
        spans = r["stats"]["last_iteration"]
        assert r["count"] == len(spans) == len(r["stats"]["buckets"]) > 1
        trace = json.loads(open(r["path"]).read())
        comm = [e for e in trace["traceEvents"] if e.get("cat") == "communication"]
        assert [e["args"]["bucket"] for e in comm] == [s["bucket"] for s in spans]
        assert all(e["ts"] >= 0 and e["dur"] >= 0 and e["pid"] == rank for e in comm)
        assert comm[0]["ts"] == 0  # times count from the first hand-over
        # The finish range runs where the collective completes: on gloo a worker thread the
        # profiler does not watch (on NCCL, the launching thread).
        assert "commtune.AllReduce.communicate" in r["names"]


@pytest.fixture(scope="module")
def stats(tmp_path_factory):
    return distributed.run(traced_run, 2, str(tmp_path_factory.mktemp("trace")))[0]["stats"]


def _is_png(path):
    data = open(path, "rb").read()
    return data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000


def test_plots_are_written(tmp_path, stats):
    from commtune import plot

    rows = [{"config": "default", "ranks": n, "speedup": s, "predicted": {"speedup": p}}
            for n, s, p in [(1, 1.0, 1.0), (2, 1.7, 1.9), (4, 3.1, 3.5)]]
    rows += [{"config": "bf16", "ranks": n, "speedup": s} for n, s in [(1, 1.0), (2, 1.9), (4, 3.6)]]
    sweep = [{"op": op, "bytes": 2 ** k, "busbw_GBps": k / 3} for op in ("all_reduce", "all_gather") for k in range(3, 20)]
    for path in (plot.scaling_curve(rows, tmp_path / "scaling.png"), plot.timeline(stats, tmp_path / "timeline.png"),
                 plot.bandwidth(sweep, tmp_path / "bandwidth.png")):
        assert _is_png(path)
    with pytest.raises(ValueError, match="no timed iteration"):
        plot.timeline({"last_iteration": []}, tmp_path / "none.png")
