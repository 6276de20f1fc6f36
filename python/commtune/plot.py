"""Pictures (PNG, through matplotlib): the scaling curve, one iteration's communication timeline,
and bandwidth against message size."""


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("commtune.plot needs matplotlib: pip install matplotlib") from e
    return plt


def _save(fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


def scaling_curve(rows, path, title="speedup against ranks"):
    """rows: the scaling study's rows (config, ranks, speedup[, predicted]); one line per
    configuration, the ideal as a dashed diagonal, predictions as hollow markers."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    configs = sorted({r["config"] for r in rows}, key=[r["config"] for r in rows].index)
    top = max(r["ranks"] for r in rows)
    ax.plot([1, top], [1, top], "k--", linewidth=1, label="ideal")
    for name in configs:
        mine = sorted((r for r in rows if r["config"] == name), key=lambda r: r["ranks"])
        line, = ax.plot([r["ranks"] for r in mine], [r["speedup"] for r in mine], "o-", label=name)
        predicted = [r for r in mine if "predicted" in r]
        if predicted:
            ax.plot([r["ranks"] for r in predicted], [r["predicted"]["speedup"] for r in predicted], "o",
                    mfc="none", color=line.get_color())
    ax.set(xlabel="ranks", ylabel="speedup (hollow: predicted)", title=title)
    ax.legend(fontsize=8)
    return _save(fig, path)


def timeline(stats, path, title="communication per bucket, latest timed iteration"):
    """stats: a commtune stats() dict; one bar per bucket from hand-over to reduced."""
    plt = _pyplot()
    spans = stats.get("last_iteration", [])
    if not spans:
        raise ValueError("timeline: no timed iteration in these stats (train a few iterations with timing on)")
    fig, ax = plt.subplots(figsize=(7, 0.4 * len(spans) + 1.5))
    for i, s in enumerate(spans):
        ax.barh(i, (s["end_us"] - s["start_us"]) / 1e3, left=s["start_us"] / 1e3, color="tab:orange")
        ax.barh(i, s["host_us"] / 1e3, left=s["start_us"] / 1e3, color="tab:blue", height=0.4)
    ax.set_yticks(range(len(spans)), [f"bucket {s['bucket']}" for s in spans])
    ax.set(xlabel="ms from the first hand-over (orange: communication, blue: hook host time)", title=title)
    ax.invert_yaxis()
    return _save(fig, path)


def bandwidth(sweep_rows, path, title="bus bandwidth against message size"):
    """sweep_rows: the allreduce sweep's rows (op, bytes, busbw_GBps); one line per collective."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for op in sorted({r["op"] for r in sweep_rows}):
        mine = sorted((r for r in sweep_rows if r["op"] == op), key=lambda r: r["bytes"])
        ax.plot([r["bytes"] for r in mine], [r["busbw_GBps"] for r in mine], "o-", label=op)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="message bytes", ylabel="busbw GB/s", title=title)
    ax.legend()
    return _save(fig, path)
