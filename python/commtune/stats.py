"""Counters as a dict, and as a readable table."""
from .hooks import _C

COLUMNS = (
    ("calls", "calls", "{:d}"),
    ("bytes_in", "MB in", "{:.2f}"),
    ("bytes_out", "MB out", "{:.2f}"),
    ("compression_ratio", "ratio", "{:.2f}"),
    ("wire_bytes", "MB sent", "{:.2f}"),
    ("wire_ratio", "vs allreduce", "{:.2f}"),
    ("hook_host_us", "host ms", "{:.3f}"),
    ("comm_us", "comm ms", "{:.3f}"),
    ("exposed_comm_us", "exposed ms", "{:.3f}"),
)
_SCALE = {"bytes_in": 1e-6, "bytes_out": 1e-6, "wire_bytes": 1e-6,
          "hook_host_us": 1e-3, "comm_us": 1e-3, "exposed_comm_us": 1e-3}


def _with_ratios(row, ranks):
    row["compression_ratio"] = row["bytes_in"] / row["bytes_out"] if row["bytes_out"] else 0.0
    # What a ring allreduce of the same buckets would have sent, over what was sent (0: one rank).
    plain = _C.allreduce_wire_bytes(round(row["bytes_in"]), ranks)
    row["wire_ratio"] = plain / row["wire_bytes"] if row["wire_bytes"] else 0.0
    return row


def from_counters(raw, ranks):
    """Adds the derived keys to the C++ counters' dict of a hook on `ranks` ranks."""
    stats = _with_ratios(dict(raw), ranks)
    stats["buckets"] = [_with_ratios(dict(b), ranks) for b in raw["buckets"]]
    stats["ranks"] = ranks
    return stats


def format_table(stats, title=""):
    """Per-bucket rows, then the total and the per-iteration average."""
    header = ["bucket"] + [label for _, label, _ in COLUMNS]
    rows = [[str(i)] + _cells(b) for i, b in enumerate(stats["buckets"])]
    rows.append(["total"] + _cells(stats))
    n, timed = stats["iterations"], stats["timed_iterations"]
    if n:
        per_iter = {k: stats[k] / n for k in ("calls", "bytes_in", "bytes_out", "wire_bytes", "hook_host_us")}
        # Times come from the timed iterations only (one in handle.timing_every on GPUs).
        for k in ("comm_us", "exposed_comm_us"):
            per_iter[k] = stats[k] / timed if timed else 0.0
        per_iter["calls"] = round(per_iter["calls"])
        rows.append(["per iter"] + _cells(_with_ratios(per_iter, stats["ranks"])))
    widths = [max(len(r[c]) for r in [header] + rows) for c in range(len(header))]
    lines = [title] if title else []
    lines.append(f"iterations: {n} ({timed} timed)")
    lines.append("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


# A ratio over nothing (one rank sends no bytes; Fused hands a held bucket nothing) reads "-".
_RATIO_OVER = {"compression_ratio": "bytes_out", "wire_ratio": "wire_bytes"}


def _cells(row):
    return ["-" if key in _RATIO_OVER and not row[_RATIO_OVER[key]] else fmt.format(row[key] * _SCALE.get(key, 1))
            for key, _, fmt in COLUMNS]


def chrome_trace_events(stats, rank=0):
    """The latest timed iteration as Chrome trace events (times from its first bucket's hand-over):
    per bucket, its communication (hand-over to reduced) and the hook's host time."""
    events = [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}}]
    for span in stats.get("last_iteration", []):
        args = {k: span[k] for k in ("bucket", "bytes_in", "bytes_out")}
        events.append({"name": f"bucket {span['bucket']}", "cat": "communication", "ph": "X", "pid": rank,
                       "tid": "communication", "ts": span["start_us"],
                       "dur": max(0.0, span["end_us"] - span["start_us"]), "args": args})
        events.append({"name": f"hook, bucket {span['bucket']}", "cat": "hook", "ph": "X", "pid": rank,
                       "tid": "hook (host)", "ts": span["start_us"], "dur": span["host_us"], "args": args})
    return events


def export_chrome_trace(ddp, path):
    """Writes the latest timed iteration of a commtune DDP module as a Chrome/Perfetto trace (JSON);
    returns the number of buckets in it. Every rank can write its own file."""
    import json

    import torch.distributed as dist

    from .registration import handle_of

    rank = dist.get_rank() if dist.is_initialized() else 0
    events = chrome_trace_events(handle_of(ddp).stats(), rank)
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return sum(1 for e in events if e.get("cat") == "communication")
