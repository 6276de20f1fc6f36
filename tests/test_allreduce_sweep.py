"""The collective sweep on gloo ranks: a valid JSON whose bandwidths follow nccl-tests' formulas."""
import json

import pytest

from commtune.__main__ import main as cli
from commtune.bench.allreduce_sweep import bus_factor, sizes_between


def test_bus_factors_are_nccl_tests():
    assert bus_factor("all_reduce", 8) == 2 * 7 / 8
    assert bus_factor("reduce_scatter", 8) == bus_factor("all_gather", 8) == 7 / 8
    assert bus_factor("all_reduce", 1) == 0
    assert sizes_between(8, 64) == [8, 16, 32, 64]


@pytest.mark.parametrize("ranks", [2, 3])
def test_sweep_on_gloo_writes_rows_with_nccl_tests_bandwidths(ranks, tmp_path):
    out = tmp_path / "sweep.json"
    cli(["bench", "allreduce", "--ranks", str(ranks), "--max-size", "4KiB", "--iters", "3", "--warmup", "1",
         "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["world_size"] == ranks and data["backend"] == "gloo"
    rows = data["rows"]
    assert [r["op"] for r in rows] == [op for op in ("all_reduce", "reduce_scatter", "all_gather") for _ in range(10)]
    for r in rows:
        assert r["bytes"] % (4 * ranks) == 0 and r["time_us"] > 0
        # the hand check: algbw = S / t, busbw = algbw * factor(op, n)
        algbw = r["bytes"] / (r["time_us"] / 1e6) / 1e9
        assert r["algbw_GBps"] == pytest.approx(algbw, rel=1e-9)
        assert r["busbw_GBps"] == pytest.approx(algbw * bus_factor(r["op"], ranks), rel=1e-9)
    assert rows[-1]["bytes"] == 4096 - 4096 % (4 * ranks)


def test_sweep_refuses_bad_sizes():
    with pytest.raises(SystemExit):
        cli(["bench", "allreduce", "--min-size", "1MiB", "--max-size", "1KiB"])
    with pytest.raises(SystemExit):
        cli(["bench", "allreduce", "--max-size", "lots"])
