"""The README's first command, `python -m commtune demo`: every hook trains on real ranks, and the
timing and the counters cover the measured iterations only, not the warm-up."""
import math
import os
import re
import subprocess
import sys

import pytest

from conftest import needs_cuda


def _demo(env_extra, *args):
    env = dict(os.environ, **env_extra)
    done = subprocess.run([sys.executable, "-m", "commtune", "demo", *args], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done


def _check(out, ranks, backend, iterations, warmup):
    assert f"commtune demo: {ranks} ranks, backend {backend}" in out
    assert f"{iterations} iterations per hook, timed and counted after {warmup} warm-up iterations" in out
    runs = re.findall(r"\[(\d+)/(\d+)\] (.+?): loss (\S+) -> (\S+), (\S+) ms/iteration", out)
    total = int(runs[0][1])
    assert [int(r[0]) for r in runs] == list(range(1, total + 1)) and total >= 10
    for _, _, label, first, last, ms in runs:
        assert math.isfinite(float(first)) and math.isfinite(float(last)) and float(ms) > 0, label
    # Every hook's table counts the measured iterations alone: reset after the warm-up.
    counted = re.findall(r"^iterations: (\d+)", out, flags=re.M)
    assert len(counted) == total - 1  # all but plain DDP
    assert set(counted) == {str(iterations)}


def test_demo_on_gloo_ranks_counts_the_measured_iterations():
    done = _demo({"CUDA_VISIBLE_DEVICES": ""}, "--ranks", "2", "--iterations", "3", "--warmup", "2")
    _check(done.stdout, 2, "gloo", 3, 2)


@needs_cuda
@pytest.mark.needs_cuda
def test_demo_on_one_gpu_with_nccl():
    done = _demo({}, "--ranks", "1", "--iterations", "4")
    _check(done.stdout, 1, "nccl", 4, 3)
    assert "barrier()" not in done.stderr  # the demo names its device to the barrier


def test_demo_refuses_bad_counts():
    for args in (["--iterations", "0"], ["--warmup", "-1"], ["--ranks", "0"]):
        done = subprocess.run([sys.executable, "-m", "commtune", "demo", *args], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 2 and "must be at least" in done.stderr, args
