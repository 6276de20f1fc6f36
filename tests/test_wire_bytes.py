"""The wire benchmark on gloo ranks: every scheme's counted bytes against its formula."""
import json

import pytest

from commtune.__main__ import main as cli
from commtune.stats import format_table, from_counters


@pytest.mark.parametrize("ranks", [2, 3])
def test_every_scheme_sends_what_its_formula_says(ranks, tmp_path):
    out = tmp_path / "wire.json"
    cli(["bench", "wire", "--ranks", str(ranks), "--mb", "0.5", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["world_size"] == ranks
    assert data["bars"] == {"bytes on the wire per rank equal the analytic figure": True}
    rows = {r["scheme"]: r for r in data["rows"]}
    assert len(rows) == 8 and all(r["equal"] and r["calls"] == 2 for r in rows.values())
    plain = rows["AllReduce (default DDP)"]
    assert plain["wire_bytes_per_rank"] == pytest.approx(2 * (ranks - 1) / ranks * 500_000)
    for r in rows.values():  # the ratio is the plain allreduce's bytes over the scheme's
        assert r["vs_ring_allreduce"] == pytest.approx(plain["wire_bytes_per_rank"] / r["wire_bytes_per_rank"])


def test_the_benchmark_refuses_one_rank():
    with pytest.raises(SystemExit):
        cli(["bench", "wire", "--ranks", "1"])


def _counters(bytes_out, wire_bytes):
    bucket = dict(calls=1, bytes_in=4_000_000, bytes_out=bytes_out, wire_bytes=wire_bytes,
                  hook_host_us=10.0, comm_us=20.0, exposed_comm_us=5.0)
    return dict(bucket, iterations=1, timed_iterations=1, buckets=[bucket])


def _ratio_cells(stats):
    """The "ratio" and "vs allreduce" cells of the table's rows (bucket 0, total, per iter)."""
    rows = [line.replace("per iter", "per-iter").split() for line in format_table(stats).splitlines()[2:]]
    return [(cells[4], cells[6]) for cells in rows]  # label, calls, MB in, MB out, ratio, MB sent, vs


def test_report_shows_no_ratio_over_nothing():
    # One rank: a ring allreduce sends nothing, so there is no "times fewer" to show.
    one = from_counters(_counters(bytes_out=4_000_000, wire_bytes=0), ranks=1)
    assert one["wire_ratio"] == 0.0 and _ratio_cells(one) == [("1.00", "-")] * 3
    # A bucket Fused held sends nothing of its own.
    held = from_counters(_counters(bytes_out=0, wire_bytes=0), ranks=2)
    assert _ratio_cells(held) == [("-", "-")] * 3
    two = from_counters(_counters(bytes_out=1_000_000, wire_bytes=500_000), ranks=2)
    assert _ratio_cells(two) == [("4.00", "8.00")] * 3
