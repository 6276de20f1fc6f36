"""The scaling study's CPU mode end to end: torchrun of the example on 2 gloo ranks, two
configurations, the table and the JSON (with the simulator's prediction beside each row)."""
import json

import pytest

from commtune.bench import scaling
from commtune.sim import MB


def test_cpu_scaling_study_writes_every_row(tmp_path, capsys):
    out = tmp_path / "scaling.json"
    rows = scaling.main(["--cpu", "--iters", "3", "--warmup", "1", "--out", str(out)])
    data = json.loads(out.read_text())
    assert [(r["config"], r["ranks"]) for r in data["rows"]] == [
        ("default DDP (AllReduce)", 1), ("bf16 on the wire", 1), ("default DDP (AllReduce)", 2), ("bf16 on the wire", 2)]
    assert rows[0]["speedup"] == 1.0
    for r in data["rows"]:
        assert r["iteration_ms"] > 0 and r["samples_per_s"] > 0
        assert abs(r["efficiency"] - r["speedup"] / r["ranks"]) < 1e-12
        assert r["predicted"]["ranks"] == r["ranks"] and r["predicted"]["iteration_us"] > 0
    # The hook's GPU cost for the simulator: its one-rank row beyond the default's, per MB.
    one = {r["config"]: r["iteration_ms"] for r in data["rows"] if r["ranks"] == 1}
    total_mb = sum(g[0] for g in data["one_rank"]["timeline"]["gradients"]) / MB
    cost = max(0.0, one["bf16 on the wire"] - one["default DDP (AllReduce)"]) * 1e3 / total_mb
    for r in data["rows"]:
        expected = cost if r["config"] == "bf16 on the wire" else 0.0
        assert r["hook_us_per_mb"] == pytest.approx(expected)
        assert r["predicted"]["hook_us"] == pytest.approx(expected * total_mb)
    two = data["rows"][2]
    assert two["comm_ms"] > 0 and 0 <= two["exposed_comm_ms"] <= two["comm_ms"]  # from the counters
    printed = capsys.readouterr().out
    assert "row 4/4 done" in printed and "predicted eff." in printed

    # Offline: the same study's timeline predicted at 64 ranks over 400 Gb/s.
    table = scaling.main(["--from", str(out), "--predict-ranks", "2", "64", "--link", "ib-400g"])
    default = [row for row in table if row[0] == "default DDP (AllReduce)"]
    assert [row[1] for row in default] == ["2", "64"] and all(row[2] != "-" for row in default)
    assert "ib-400g" in capsys.readouterr().out


def test_auto_tuned_row_runs_the_example_with_the_profile(tmp_path):
    from commtune.nccl import Settings

    profile = tmp_path / "tuned.json"
    Settings(algo="ring", buffsize="8MiB").save_profile(str(profile))
    rows = scaling.main(["--cpu", "--configs", "default DDP (AllReduce)", "--tuned-profile", str(profile),
                         "--iters", "2", "--warmup", "1", "--out", str(tmp_path / "s.json")])
    assert [(r["config"], r["ranks"]) for r in rows] == [
        ("default DDP (AllReduce)", 1), ("default DDP (AllReduce)", 2), ("auto-tuned (NCCL profile)", 2)]
    assert rows[-1]["iteration_ms"] > 0 and "predicted" in rows[-1]
