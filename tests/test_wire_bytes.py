"""The wire benchmark on gloo ranks: every scheme's counted bytes against its formula."""
import json

import pytest

from commtune.__main__ import main as cli


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
