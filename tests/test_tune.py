"""The NCCL tuner's pipeline on gloo ranks: every candidate measured in fresh processes, the
fastest measured one chosen per size, a profile Settings.from_profile loads."""
import json

import pytest

from commtune import tune
from commtune.__main__ import main as cli
from commtune.nccl import Settings


def test_bucket_sizes_follow_ddps_caps():
    mb = 2**20
    # reverse order: 0.6 + 0.6 MB close the 1 MB first bucket, then 25 MB buckets
    assert tune.bucket_sizes([10 * mb, 20 * mb, int(0.6 * mb), int(0.6 * mb)], 25, 1) == \
        [2 * int(0.6 * mb), 30 * mb]


def test_tuner_measures_candidates_and_writes_a_profile(tmp_path):
    out = tmp_path / "profile.json"
    cli(["tune", "nccl", "--sizes", "1KiB", "64KiB", "--candidates", "ring", "buffsize_16MiB", "--ranks", "2",
         "--iters", "3", "--out", str(out)])
    profile = json.loads(out.read_text())
    times = profile["times_us"]
    assert set(times) == {"default", "ring", "buffsize_16MiB"} and profile["failed"] == {}
    totals = {c: sum(t.values()) for c, t in times.items()}
    assert profile["chosen"] == min(totals, key=totals.get)
    for r in profile["ranges"]:
        for size in r["sizes"]:
            assert r["candidate"] == min(times, key=lambda c: times[c][str(size)])
    assert Settings.from_profile(out) == Settings(**tune.CANDIDATES[profile["chosen"]].to_dict())
    assert profile["gain_vs_default"]["default"] == 0
    assert (tmp_path / "profile.rules").read_text().startswith("# commtune NCCL tuner rules")


def test_a_failed_candidate_is_never_chosen(tmp_path, monkeypatch):
    def fake_measure(candidate, settings, sizes, ranks, iters, workdir):
        if candidate == "tree":
            raise RuntimeError("candidate tree failed (exit 1)")
        return {s: (1.0 if candidate == "default" else 2.0) for s in sizes}

    monkeypatch.setattr(tune, "measure", fake_measure)
    candidates = {"default": Settings(), "tree": Settings(algo="tree"), "ring": Settings(algo="ring")}
    with pytest.warns(UserWarning, match="Tree is a chain"):  # the profile's settings are checked
        profile = tune.tune([1024, 4096], candidates, out=str(tmp_path / "p.json"), say=lambda *a: None)
    assert "tree" in profile["failed"] and "tree" not in profile["times_us"]
    assert profile["chosen"] == "default" and profile["gain_vs_default"]["ring"] == pytest.approx(-0.5)
    monkeypatch.setattr(tune, "measure", lambda *a: (_ for _ in ()).throw(RuntimeError("down")))
    with pytest.raises(RuntimeError, match="default candidate could not be measured"):
        tune.tune([1024], {"default": Settings()}, out=str(tmp_path / "q.json"), say=lambda *a: None)


def test_rules_for_the_tuner_plugin(tmp_path):
    profile = {
        "candidates": {"default": {}, "ring": {"NCCL_ALGO": "ring"}, "simple": {"NCCL_PROTO": "Simple"},
                       "buffsize_16MiB": {"NCCL_BUFFSIZE": "16777216"}, "mixed": {"NCCL_ALGO": "ring;allreduce:tree"}},
        "ranges": [{"candidate": "ring", "min_bytes": 1024, "max_bytes": 4096},
                   {"candidate": "buffsize_16MiB", "min_bytes": 8192, "max_bytes": 8192},
                   {"candidate": "simple", "min_bytes": 16384, "max_bytes": 65536},
                   {"candidate": "mixed", "min_bytes": 2**20, "max_bytes": 2**20}],
    }
    path = tmp_path / "p.rules"
    assert tune.write_rules(profile, path) == 2
    lines = path.read_text().splitlines()
    assert lines[1:] == ["allreduce 0 6144 ring *", f"allreduce {(8192 + 16384) // 2 + 1} {(65536 + 2**20) // 2} * simple"]
